"""Host summaries for fleet analysis (docs/fleet.md): ``frtools summarize`` of a host's black
boxes, the packed format (round trip, size, hostile input), ``frtools synth --format
summary`` equal to summarizing the written boxes, and the verdict of summaries equal to the
verdict of the full records over simulated jobs of every fault kind."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.analyze.summarize import summarize_path
from frtools.formats.summary import SummaryError
from frtools.formats.summary_packed import (
    MAGIC,
    decode_packed,
    decode_packed_many,
    to_summaries,
)
from frtools.synth import FAULTS, synthesize

pytestmark = pytest.mark.timeout(240)


def _verdict_key(v) -> tuple:
    pg = v.process_group
    return (v.kind, tuple(sorted(v.guilty_ranks)), pg.name if pg else None, v.op)


def _boxes(tmp: Path, fault: str, seed: int = 0, **layout) -> Path:
    layout = layout or {"world_size": 16, "tp": 2, "pp": 2}
    out = tmp / f"boxes-{fault}-{seed}"
    synthesize(out, fault=fault, seed=seed, format="frtools", workers=1, **layout)
    return out


def _by_host(boxes: Path, out: Path, window: int = 64) -> Path:
    """``frtools summarize`` (in process) of each 8-rank host folder of ``boxes``."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = sorted(int(p.stem.split("_")[1]) for p in boxes.glob("rank_*.frt"))
    for host in sorted({r // 8 for r in ranks}):
        folder = out.parent / f"host-{host}"
        folder.mkdir(exist_ok=True)
        for r in ranks:
            if r // 8 == host:
                os.link(boxes / f"rank_{r}.frt", folder / f"rank_{r}.frt")
        result = summarize_path(folder, window=window, workers=1)
        (out / f"{result.host}.summary").write_bytes(result.encode())
    return out


def test_packed_summary_round_trips_and_a_host_stays_under_64_kb(tmp_path):
    boxes = _boxes(tmp_path, "missing", world_size=8, tp=2, pp=2)
    result = summarize_path(boxes, workers=1)
    data = result.encode()
    assert len(data) <= 64 * 1024
    back = to_summaries(decode_packed(data))
    assert [s.rank for s in back] == list(range(8))
    for a, b in zip(result.summaries, back, strict=True):
        assert len(a.entries) == len(b.entries) >= 64
        assert [dataclasses.astuple(e) for e in a.entries] == [
            dataclasses.astuple(e) for e in b.entries
        ]
        assert [g.ranks for g in a.groups] == [g.ranks for g in b.groups]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: b"NOTMAGIC" + d[8:], "no FRTSUMPK/FRTSUMPZ magic"),
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: MAGIC + b"\x00garbage", "corrupt"),
        (lambda d: MAGIC + zlib.compress(b"\xff\xff\xff\x7f{}"), "header is cut"),
        (lambda d: MAGIC + zlib.compress(b"\x02\x00\x00\x00[]"), "not an frtools summary"),
    ],
)
def test_hostile_packed_summary_is_refused_with_one_line(tmp_path, mutate, reason):
    boxes = _boxes(tmp_path, "missing", world_size=8, tp=2, pp=2)
    data = summarize_path(boxes, workers=1).encode()
    with pytest.raises(SummaryError, match=reason) as e:
        decode_packed(mutate(data))
    assert "\n" not in str(e.value)


def _with_header(data: bytes, change) -> bytes:
    """A packed summary whose JSON header ``change`` edited (columns left as they were)."""
    raw = zlib.decompress(data[len(MAGIC) :])
    (n,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4 : 4 + n])
    change(header)
    head = json.dumps(header).encode()
    return MAGIC + zlib.compress(struct.pack("<I", len(head)) + head + raw[4 + n :])


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda h: h["strings"].pop(), "names a string beyond the table"),
        (lambda h: h["columns"].pop(), "bytes after its last column"),
        (lambda h: h["ranks"][0].update(entries=h["ranks"][0]["entries"] + 1), "is cut"),
        (lambda h: h["ranks"][1]["groups"][0].__setitem__(0, 99), "beyond the host's table"),
    ],
)
def test_a_bad_host_in_a_batch_is_refused_alone(tmp_path, change, reason):
    """Hosts are decoded together (one numpy call per column for all of them): a host whose
    columns do not fit its header is refused with its reason, the others read as alone."""
    boxes = _boxes(tmp_path, "missing", world_size=24, tp=2, pp=2)
    hosts = sorted(_by_host(boxes, tmp_path / "summaries").glob("*.summary"))
    good = [p.read_bytes() for p in hosts]
    bad = _with_header(good[1], change)
    with pytest.raises(SummaryError, match=reason):
        decode_packed(bad)
    out = decode_packed_many([good[0], bad, good[2]])
    assert isinstance(out[1], SummaryError) and reason in str(out[1])
    for got, data in ((out[0], good[0]), (out[2], good[2])):
        assert not isinstance(got, SummaryError)
        assert to_summaries(got) == to_summaries(decode_packed(data))
        assert len(to_summaries(got)) == 8


def test_a_bomb_is_refused_before_it_is_inflated():
    z = zlib.compressobj(1)
    chunk = bytes(1 << 20)
    bomb = MAGIC + b"".join(z.compress(chunk) for _ in range(300)) + z.flush()
    with pytest.raises(SummaryError, match="expands beyond"):
        decode_packed(bomb)


@pytest.mark.parametrize("fault", FAULTS)
def test_host_summaries_give_the_full_records_verdict(tmp_path, fault):
    boxes = _boxes(tmp_path, fault, seed=3)
    summaries = _by_host(boxes, tmp_path / "summaries")
    assert len(list(summaries.glob("*.summary"))) == 2
    full = diagnose(load_trace(boxes, workers=1))
    assert _verdict_key(diagnose(load_trace(summaries, workers=1))) == _verdict_key(full)


def test_synth_summaries_equal_summarize_of_the_written_boxes(tmp_path):
    layout = {"world_size": 16, "tp": 2, "pp": 2, "fault": "missing", "seed": 5, "workers": 1}
    boxes = tmp_path / "boxes"
    synthesize(boxes, format="frtools", **layout)
    synth = tmp_path / "synth"
    synthesize(synth, format="summary", window=64, **layout)
    made = _by_host(boxes, tmp_path / "made", window=64)
    names = sorted(p.name for p in synth.glob("*.summary"))
    assert (
        names
        == sorted(p.name for p in made.glob("*.summary"))
        == [
            "node00000.summary",
            "node00001.summary",
        ]
    )
    for name in names:
        a = to_summaries(decode_packed((synth / name).read_bytes()))
        b = to_summaries(decode_packed((made / name).read_bytes()))
        for x, y in zip(a, b, strict=True):
            assert x.rank == y.rank
            assert [dataclasses.astuple(e) for e in x.entries] == [
                dataclasses.astuple(e) for e in y.entries
            ]
            assert x.groups == y.groups
    v_synth, v_boxes = (diagnose(load_trace(d, workers=1)) for d in (synth, boxes))
    assert _verdict_key(v_synth) == _verdict_key(v_boxes)


def test_summarize_command_writes_a_host_file_that_analyze_reads_mixed_with_boxes(tmp_path):
    boxes = _boxes(tmp_path, "missing")
    out = tmp_path / "mixed"
    out.mkdir()
    host0 = tmp_path / "host0"
    host0.mkdir()
    for r in range(8):
        os.link(boxes / f"rank_{r}.frt", host0 / f"rank_{r}.frt")
    for r in range(8, 16):  # the second host's boxes, the first host's summary
        os.link(boxes / f"rank_{r}.frt", out / f"rank_{r}.frt")
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "frtools", "summarize", str(host0)]
        + ["-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "node00000: 8 rank(s) 0-7 ->" in res.stderr
    # the per-host step's process reads Arrow without importing pandas (a quarter of its time)
    imported = set(re.findall(r"^import time:.*\|\s+(\S+)$", res.stderr, re.M))
    assert "pyarrow.lib" in imported
    assert not [m for m in imported if m.startswith("pandas.")]
    assert (out / "node00000.summary").exists()
    full = diagnose(load_trace(boxes, workers=1))
    trace = load_trace(out, workers=1)
    assert sorted(trace.ranks) == list(range(16))
    assert _verdict_key(diagnose(trace)) == _verdict_key(full)


def _rank_item(change):
    def edit(h):
        change(h["ranks"][1])

    return edit


@pytest.mark.parametrize(
    "change",
    [
        lambda r: None,
        lambda r: r.update(rank=True),
        lambda r: r.update(rank=-1),
        lambda r: r.update(world_size="8"),
        lambda r: r.update(world_size=r["rank"]),
        lambda r: r.update(identity={"host": "h" * 600, "pid": 7}),
        lambda r: r.update(identity={"host": "a", "colour": "blue"}),
        lambda r: r.update(identity={"pid": 2**70}),
        lambda r: r.update(identity={"local_rank": True}),
        lambda r: r.update(identity=["host"]),
        lambda r: r.update(exit={"kind": "vanished"}),
        lambda r: r.update(exit={"kind": ["exit"]}),
        lambda r: r.update(exit={"kind": "signal", "detail": "SIGKILL"}),
        lambda r: r.update(exit="exit"),
        lambda r: r.update(notes=["a note", None]),
        lambda r: r.update(notes="a note"),
        lambda r: r.update(taken_ns=-5),
        lambda r: r.update(taken_ns=None),
        lambda r: r.update(heartbeat_ns=None, dump_time_ns=12),
        lambda r: r.update(records_written=True),
        lambda r: r.update(omitted=2**64),
        lambda r: r.update(stalled=1),
        lambda r: r.update(alive=True, wrapped=None),
        lambda r: r.update(stacks=5),
        lambda r: r.update(stacks="x" * 70000),
        lambda r: r.update(startup_phase="nope"),
        lambda r: r.update(startup_phase=["init"]),
        lambda r: r.update(startup_phase="init"),
        lambda r: r["groups"][0].__setitem__(1, True),
        lambda r: r["groups"][0].__setitem__(1, -2),
        lambda r: r["groups"][0].__setitem__(0, -1),
        lambda r: r["groups"].__setitem__(0, r["groups"][0][:3]),
        lambda r: r.update(groups="0"),
        lambda r: r.update(groups=[]),
        lambda r: r.update(entries="64"),
        lambda r: r.clear(),
    ],
)
def test_a_rank_header_reads_as_the_field_by_field_checks_read_it(tmp_path, monkeypatch, change):
    """A partial's 131,072 rank headers are taken whole where nothing in them is unusual
    (``_plain_rank_fields``, ``_plain_groups``): whatever the header, the file reads back,
    or is refused with the reason, exactly as with those shortcuts off."""
    import frtools.formats.summary as summary
    import frtools.formats.summary_packed as packed

    boxes = _boxes(tmp_path, "missing", world_size=8, tp=2, pp=2)
    data = _with_header(summarize_path(boxes, workers=1).encode(), _rank_item(change))

    def read() -> object:
        try:
            return to_summaries(decode_packed(data))
        except SummaryError as e:
            return f"refused: {e}"

    fast = read()
    monkeypatch.setattr(summary, "_plain_rank_fields", lambda doc: None)
    monkeypatch.setattr(packed, "_plain_groups", lambda raw, n: False)
    assert read() == fast
