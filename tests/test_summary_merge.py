"""Merged host summaries (docs/summary-format.md, "Partials"; docs/fleet.md): a partial of
many hosts' ranks is the same bytes whatever order and grouping the hosts were merged in,
and ``frtools analyze`` of it gives the verdict of the folder of host summaries it came
from, on every fault kind the simulator makes. Hostile inputs to a merge are refused with
one line naming the file."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from test_summaries import _boxes, _by_host

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.analyze.summarize import merge_files
from frtools.formats.summary import SummaryError
from frtools.formats.summary_packed import (
    MAGIC,
    PARTIAL_PREFIX,
    ZSTD_MAGIC,
    decode_packed,
    merge_packed,
    to_summaries,
)
from frtools.synth import FAULTS

pytestmark = pytest.mark.timeout(240)

LAYOUT = {"world_size": 32, "tp": 2, "pp": 2}  # four hosts of 8 ranks


def _key(v) -> tuple:
    """What a user reads first: kind, guilty ranks, group, op, who waits, the headline."""
    pg = v.process_group
    return (
        v.kind,
        tuple(sorted(v.guilty_ranks)),
        pg.name if pg else None,
        v.op,
        tuple(sorted(v.waiting)),
        v.headline,
    )


def _random_tree(parts: list, rng: random.Random) -> bytes:
    """Merge ``parts`` in a random order as a random tree of merges."""
    level = [p for p in parts]
    rng.shuffle(level)
    while len(level) > 1:
        fan_in = rng.randint(2, max(2, len(level)))
        nxt = []
        for i in range(0, len(level), fan_in):
            group = level[i : i + fan_in]
            nxt.append(group[0] if len(group) == 1 else decode_packed(merge_packed(group)))
        rng.shuffle(nxt)
        level = nxt
    return merge_packed(level)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_merged_partial_is_one_set_of_bytes_and_gives_the_flat_verdict(tmp_path, fault):
    boxes = _boxes(tmp_path, fault, seed=3, **LAYOUT)
    hosts = _by_host(boxes, tmp_path / "hosts")
    files = sorted(hosts.glob("*.summary"))
    assert len(files) == 4
    parts = [decode_packed(f.read_bytes()) for f in files]
    flat = merge_packed(parts)
    rng = random.Random(fault)
    for _ in range(4):
        assert _random_tree(parts, rng) == flat
    merged = decode_packed(flat)
    assert [r.rank for r in merged.ranks] == sorted(r.rank for p in parts for r in p.ranks)
    assert merged.hosts == [p.host for p in parts]
    # every rank's summary is the one its host wrote: nothing pruned, nothing changed
    assert to_summaries(merged) == sorted(
        (s for p in parts for s in to_summaries(p)), key=lambda s: s.rank
    )
    one = tmp_path / "partial"
    one.mkdir()
    (one / "job.summary").write_bytes(flat)
    expected = _key(diagnose(load_trace(hosts, workers=1)))
    assert _key(diagnose(load_trace(one, workers=1))) == expected


def test_summarize_merge_per_rack_then_the_job_reads_as_the_hosts(tmp_path):
    """The SLURM recipe's shape: hosts -> racks -> job with the command, then analyze."""
    boxes = _boxes(tmp_path, "missing", **LAYOUT)
    hosts = sorted(_by_host(boxes, tmp_path / "hosts").glob("*.summary"))
    racks = tmp_path / "racks"
    racks.mkdir()

    def merge(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "frtools", "summarize", "--merge", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    for rack in (hosts[:2], hosts[2:]):
        res = merge(*map(str, rack), "-o", str(racks))
        assert res.returncode == 0, res.stderr
    assert "merged 2 file(s): 16 rank(s) 16-31 of 2 host(s) -> " in res.stderr
    job = tmp_path / "job"
    job.mkdir()
    res = merge(str(racks), "-o", str(job / "job.summary"))
    assert res.returncode == 0, res.stderr
    assert (job / "job.summary").read_bytes() == merge_files(hosts[::-1]).data
    out = [
        subprocess.run(
            [sys.executable, "-m", "frtools", "analyze", str(d), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for d in (tmp_path / "hosts", job)
    ]
    assert [o.returncode for o in out] == [1, 1]
    flat, merged = (json.loads(o.stdout)["verdict"] for o in out)
    assert merged["kind"] == flat["kind"] == "missing"
    assert merged["guilty"] == flat["guilty"]
    assert merged["headline"] == flat["headline"]


def _raw(data: bytes) -> bytes:
    """A packed file's document, zstd (a partial) or zlib (a host, or an older partial)."""
    if data.startswith(ZSTD_MAGIC):
        (size,) = struct.unpack_from("<Q", data, len(ZSTD_MAGIC))
        return pa.Codec("zstd").decompress(data[16:], decompressed_size=size, asbytes=True)
    return zlib.decompress(data[len(MAGIC) :])


def _zstd_file(raw: bytes, size: int | None = None) -> bytes:
    frame = pa.Codec("zstd").compress(raw, asbytes=True)
    return ZSTD_MAGIC + struct.pack("<Q", len(raw) if size is None else size) + frame


def _frame(raw: bytes, like: bytes) -> bytes:
    """``raw`` compressed as ``like`` was."""
    return _zstd_file(raw) if like.startswith(ZSTD_MAGIC) else MAGIC + zlib.compress(raw)


def _edit(data: bytes, change) -> bytes:
    raw = _raw(data)
    (n,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4 : 4 + n])
    body = change(header, raw[4 + n :])
    head = json.dumps(header, separators=(",", ":")).encode()
    return _frame(struct.pack("<I", len(head)) + head + body, data)


def _with_extra(h: dict, body: bytes) -> bytes:
    return body + b"\0"


def _claims_one_host(h: dict, body: bytes) -> bytes:
    h["hosts"] = 7
    return body


def _version_twice(data: bytes) -> bytes:
    """A partial whose header starts as a partial's and names version 1 again at its end
    (JSON keeps the last): it may not keep the ceilings its prefix claimed."""
    raw = _raw(data)
    (n,) = struct.unpack_from("<I", raw)
    head = raw[4 : 4 + n - 1] + b',"version":1}'
    return _frame(struct.pack("<I", len(head)) + head + raw[4 + n :], data)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("two")
    boxes = _boxes(tmp, "missing", world_size=16, tp=2, pp=2)
    return sorted(_by_host(boxes, tmp / "hosts").glob("*.summary"))


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d, p: b"NOTMAGIC" + d[8:], "no FRTSUMPK/FRTSUMPZ magic"),
        (lambda d, p: d[: len(d) // 2], "truncated"),
        (lambda d, p: _edit(p, _with_extra), "bytes after its last column"),
        (lambda d, p: _edit(p, _claims_one_host), "hosts is not a list"),
        (lambda d, p: _version_twice(p), "names another version"),
        (lambda d, p: d, "rank 0 is in both"),
    ],
)
def test_a_hostile_merge_input_is_refused_with_one_line_naming_the_file(
    tmp_path, two_hosts, make, reason
):
    good = two_hosts[0].read_bytes()
    partial = merge_files(two_hosts).data
    bad = tmp_path / "bad.summary"
    bad.write_bytes(make(good, partial))
    with pytest.raises(SummaryError, match=reason) as e:
        merge_files([two_hosts[0], bad])
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    res = subprocess.run(
        [sys.executable, "-m", "frtools", "summarize", "--merge", str(two_hosts[0]), str(bad)]
        + ["-o", str(tmp_path / "out.summary")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and str(bad) in res.stderr and reason in res.stderr
    assert not (tmp_path / "out.summary").exists()


def test_a_partial_larger_than_a_hosts_bound_reads_only_as_a_partial(two_hosts):
    """Past a host file's 256 MiB only a partial may go, and only as far as its header's
    columns reach: a host file's header does not get a partial's ceiling by claiming it."""
    partial = merge_files(two_hosts).data
    back = decode_packed(partial)
    assert partial.startswith(ZSTD_MAGIC) and _raw(partial)[4:].startswith(PARTIAL_PREFIX)
    assert len(back.ranks) == 16
    z = zlib.compressobj(1)
    head = b'{"format":"frtools-summary","version":1,' + b" " * 64 + b"}"
    bomb = MAGIC + z.compress(struct.pack("<I", len(head)) + head)
    bomb += b"".join(z.compress(bytes(1 << 20)) for _ in range(300)) + z.flush()
    with pytest.raises(SummaryError, match="expands beyond"):
        decode_packed(bomb)
    head = b'{"format":"frtools-summary","version":2,"kind":"host-packed","hosts":[],'
    head += b'"strings":[""],"groups":[],"columns":[],"ranks":[]}'
    z = zlib.compressobj(1)
    bomb = MAGIC + z.compress(struct.pack("<I", len(head)) + head)
    bomb += b"".join(z.compress(bytes(1 << 20)) for _ in range(300)) + z.flush()
    with pytest.raises(SummaryError, match="bytes after its last column"):
        decode_packed(bomb)


def _as_version_2(h: dict, body: bytes) -> bytes:
    """A version 3 partial's header as version 2 wrote it: one object per rank."""
    table = h.pop("rank_table")
    ranks = []
    for i, rank in enumerate(table["rank"]):
        item = {
            key: table[key][i]
            for key in ("world_size", "taken_ns", "heartbeat_ns", "dump_time_ns", "stalled")
            + ("alive", "wrapped", "records_written", "omitted", "startup_phase", "stacks")
            + ("notes", "groups", "entries")
        }
        item["identity"] = {k: v[i] for k, v in table["identity"].items() if v[i] is not None}
        item["exit"] = {"kind": table["exit_kind"][i], "detail": table["exit_detail"][i]}
        ranks.append({"rank": rank, **item})
    h["ranks"] = ranks
    h["version"] = 2
    return body


def test_a_partial_lists_its_ranks_as_columns_and_version_2_partials_still_read(two_hosts):
    """Version 3 writes a partial's ranks as one list per field (half the header at 32,768
    ranks, read a column at a time); a version 2 partial, one object per rank, written by
    an older frtools on another host, reads as the same ranks and ops."""
    partial = merge_files(two_hosts).data
    raw = _raw(partial)
    (n,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4 : 4 + n])
    assert header["version"] == 3 and "ranks" not in header
    assert header["rank_table"]["rank"] == list(range(16))
    assert header["rank_table"]["identity"]["host"][8] is not None
    hosts = [to_summaries(decode_packed(p.read_bytes())) for p in two_hosts]
    assert to_summaries(decode_packed(partial)) == sorted(hosts[0] + hosts[1], key=lambda s: s.rank)
    old = _edit(partial, _as_version_2)
    assert _raw(old)[4:].startswith(b'{"format":"frtools-summary","version":2,')
    assert to_summaries(decode_packed(old)) == to_summaries(decode_packed(partial))
    # merging a version 2 partial with the rest gives the bytes of an all-new merge
    assert merge_packed([decode_packed(old)]) == merge_packed([decode_packed(partial)])


def _table(change):
    def edit(h: dict, body: bytes) -> bytes:
        change(h["rank_table"])
        return body

    return edit


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda t: t.update(rank=5), "rank_table rank is not a short list"),
        (lambda t: t["taken_ns"].pop(), "rank_table taken_ns is not a list of 16"),
        (lambda t: t.pop("entries"), "rank_table entries is not a list of 16"),
        (lambda t: t["rank"].__setitem__(3, True), "rank_table rank holds a value that is not"),
        (lambda t: t["rank"].__setitem__(3, 1 << 20), "rank_table rank holds a value out of"),
        (lambda t: t["world_size"].__setitem__(9, 9), "rank 9 is not below world_size 9"),
        (lambda t: t["entries"].__setitem__(0, "64"), "rank_table entries holds a value that"),
        (lambda t: t["omitted"].__setitem__(0, -1), "rank_table omitted holds a value out of"),
        (lambda t: t["stalled"].__setitem__(2, 1), "rank_table stalled holds a value that is"),
        (lambda t: t["wrapped"].__setitem__(2, None), "rank_table wrapped holds a value that"),
        (lambda t: t["exit_kind"].__setitem__(4, "vanished"), "exit_kind holds an unknown"),
        (lambda t: t["startup_phase"].__setitem__(4, 7), "startup_phase holds a value that is"),
        (lambda t: t["stacks"].__setitem__(1, "x" * 70_000), "stacks holds a text longer"),
        (lambda t: t["notes"].__setitem__(1, "a note"), "rank_table notes is not a list"),
        (lambda t: t["notes"].__setitem__(1, ["x" * 2000]), "notes holds a note that is not"),
        (lambda t: t["groups"][5][0].__setitem__(0, 10**6), "rank_table groups are not lists"),
        (lambda t: t["groups"][5][0].__setitem__(2, -2), "rank_table groups are not lists"),
        (lambda t: t["groups"][5].__setitem__(0, [0, 1]), "rank_table groups are not lists"),
        (lambda t: t.update(identity=[]), "rank_table identity is not an object"),
        (lambda t: t["identity"]["host"].__setitem__(0, ["h"]), "identity host holds a value"),
        (lambda t: t["identity"]["host"].__setitem__(0, "h" * 600), "identity host holds a"),
        (lambda t: t["identity"]["pid"].pop(), "rank_table identity pid is not a list of 16"),
    ],
)
def test_a_hostile_rank_table_is_refused_with_one_line(two_hosts, change, reason):
    partial = _edit(merge_files(two_hosts).data, _table(change))
    with pytest.raises(SummaryError, match=reason) as e:
        decode_packed(partial)
    assert "\n" not in str(e.value)
    with pytest.raises(SummaryError, match="rank_table is not an object"):
        decode_packed(_edit(merge_files(two_hosts).data, lambda h, b: h.pop("rank_table") and b))


def test_a_partial_is_zstd_and_zlib_partials_still_read(two_hosts):
    """A merge writes zstd (ten times faster to write, three to read than zlib at 256 MB);
    a zlib partial, as frtools wrote them before, reads as the same ranks and ops."""
    partial = merge_files(two_hosts).data
    assert partial.startswith(ZSTD_MAGIC)
    old = MAGIC + zlib.compress(_raw(partial), 1)
    assert to_summaries(decode_packed(old)) == to_summaries(decode_packed(partial))
    assert merge_packed([decode_packed(old)]) == partial


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda raw, p: p[:12], "no document size"),
        (lambda raw, p: _zstd_file(raw, 5 << 30), "expands beyond 4294967296 bytes"),
        (lambda raw, p: p[:8] + struct.pack("<Q", 1 << 30) + p[16:40], "frame cannot hold"),
        (lambda raw, p: _zstd_file(raw, len(raw) - 1), "corrupt"),
        (lambda raw, p: _zstd_file(raw, len(raw) + 1), "corrupt"),
        (lambda raw, p: p[: len(p) - 50], "corrupt"),
        (lambda raw, p: p[:16] + bytes(len(p) - 16), "corrupt"),
        (lambda raw, p: _zstd_file(raw + b"\0"), "bytes after its last column"),
        # a host's file past a host's bound: zstd framing gives it no partial's ceiling
        (lambda raw, p: _zstd_file(_host_doc(300 << 20)), "expands beyond 268435456 bytes"),
    ],
)
def test_a_hostile_zstd_file_is_refused_with_one_line(two_hosts, make, reason):
    partial = merge_files(two_hosts).data
    with pytest.raises(SummaryError, match=reason) as e:
        decode_packed(make(_raw(partial), partial))
    assert "\n" not in str(e.value)


def _host_doc(size: int) -> bytes:
    head = b'{"format":"frtools-summary","version":1,"kind":"host-packed"}'
    return struct.pack("<I", len(head)) + head + bytes(size)


def test_a_worker_hands_a_partials_ranks_over_as_columns_and_they_read_as_in_process(
    two_hosts, tmp_path
):
    """A worker process does not make (nor pickle) a RankDump per rank of a partial: it
    hands the rank table's columns over and the parent makes the dumps, equal to those an
    in-process read makes, for a version 3 and a version 2 partial alike; where the spool
    cannot take the table, the dumps are made in the worker and go by the pipe."""
    import pickle

    from frtools.analyze.readers.loader import _read_chunk_to_spool, read_rank_dumps
    from frtools.analyze.readers.parallel import _unspool

    partial = merge_files(two_hosts).data
    paths = [tmp_path / "new.summary", tmp_path / "old.summary"]
    paths[0].write_bytes(partial)
    paths[1].write_bytes(_edit(partial, _as_version_2))

    def facts(dumps) -> list:
        return [
            (vars(d.rank_info) | {"source": None}, d.process_groups, d.notes,
             d.max_time_created_ns, d.default_pg_all, d.unmapped_peer_groups)
            for d in dumps
        ]  # fmt: skip

    expected = [read_rank_dumps(p, workers=1)[1] for p in paths]
    assert [sorted(e) for e in expected] == [list(range(16))] * 2
    want_facts = facts(expected[0][r] for r in range(16))
    assert facts(expected[1][r] for r in range(16)) == want_facts
    want_rows = pa.concat_tables(expected[0][r].entries for r in range(16))

    spool = tmp_path / "spool"
    spool.mkdir()
    results, table_path, where = _read_chunk_to_spool(([str(p) for p in paths], str(spool)))
    assert table_path is not None
    assert all(r.block is not None and r.dump is None and not r.more for r in results)
    assert [r.input.reason for r in results] == ["ranks 0-15"] * 2
    table = _unspool(table_path)
    results = pickle.loads(pickle.dumps(results))  # as the pool hands them over
    for r, mine in zip(results, where, strict=True):
        assert facts(r.unblock()) == want_facts and r.block is None
        rows = pa.concat_tables(table.slice(offset, n) for offset, n in mine)
        assert rows.equals(want_rows)

    # a spool that cannot take the table: the worker makes the dumps, entries and all
    results, table_path, _ = _read_chunk_to_spool(([str(paths[0])], str(tmp_path / "gone")))
    (r,) = results
    assert table_path is None and r.block is None and facts(r.dumps) == want_facts
    assert pa.concat_tables(d.entries for d in r.dumps).equals(want_rows)

    # and the whole load through worker processes is the in-process one
    one = tmp_path / "one"
    one.mkdir()
    for k, host in enumerate(two_hosts):  # a partial of each host's 8 ranks
        (one / f"{k}.summary").write_bytes(merge_files([host]).data)
    pooled, serial = load_trace(one, workers=2), load_trace(one, workers=1)
    assert sorted(pooled.ranks) == list(range(16))
    # the same rows (each worker's table has its own dictionaries)
    assert pooled.ranks == serial.ranks
    assert pooled.entries.to_pylist() == serial.entries.to_pylist()
    assert pooled.process_groups == serial.process_groups


def test_a_partial_whose_ranks_cannot_be_made_costs_only_itself(two_hosts, tmp_path, monkeypatch):
    """Making a file's RankDumps from its rank table fails as reading it would (here: out of
    memory): it is that file's reason wherever the dumps are made (in process, in the
    parent from a worker's columns, in a worker whose spool is full), and the file beside
    it reads as usual, its rows its own."""
    from frtools.analyze.readers import summary
    from frtools.analyze.readers.loader import _read_chunk_to_spool
    from frtools.analyze.readers.parallel import entries, read_chunk

    folder = tmp_path / "parts"
    folder.mkdir()
    paths = [folder / f"{k}.summary" for k in range(2)]
    for path, host in zip(paths, two_hosts, strict=True):  # a partial of each host's 8 ranks
        path.write_bytes(merge_files([host]).data)
    whole = load_trace(folder, workers=1)
    second = {d.rank_info.rank for d in read_chunk([str(paths[1])], {})[0].dumps}
    assert len(second) == 8 and len(whole.ranks) == 16
    want = [row for row in whole.entries.to_pylist() if row["rank"] in second]

    made = summary.PackedRanks.dumps

    def dumps(self):
        if self.source == str(paths[0]):
            raise MemoryError
        return made(self)

    monkeypatch.setattr(summary.PackedRanks, "dumps", dumps)
    reason = "too large to load (out of memory)"

    spans: dict = {}
    bad, good = read_chunk([str(p) for p in paths], spans)
    assert (bad.input.status, bad.input.reason, bad.dumps) == ("error", reason, [])
    assert good.input.status == "ok" and {d.rank_info.rank for d in good.dumps} == second
    assert pa.concat_tables(entries(d, spans) for d in good.dumps).to_pylist() == want

    trace = load_trace(folder, workers=2)  # the parent makes the dumps
    assert [(i.status, i.reason) for i in trace.inputs] == [("error", reason), ("ok", "ranks 8-15")]
    assert set(trace.ranks) == second and trace.entries.to_pylist() == want

    (bad, good), table_path, _ = _read_chunk_to_spool(
        ([str(p) for p in paths], str(tmp_path / "gone"))
    )
    assert table_path is None and (bad.input.reason, bad.dumps) == (reason, [])
    assert pa.concat_tables(d.entries for d in good.dumps).to_pylist() == want
