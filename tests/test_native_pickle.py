"""The native Flight Recorder pickle parser (``_frpickle``): for every dump it either gives
exactly the ``RankDump`` the Python reader gives, or leaves the file to it (returns None);
it never runs code from a pickle, never crashes on hostile bytes, and parses with the GIL
released so that the loader's threads read files in parallel.

Inputs: the real Gloo dumps of ``sample_dumps/`` (torch 2.13's C++ pickler), ``frtools synth``
jobs (NCCL-style, wrapped buffers, P2P), one small dict per PyTorch dump version (the
builder of tests/test_readers.py) written with every pickle protocol, and hand-made odd and
hostile pickles.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from test_readers import VERSIONS, fr_dump, fr_entry

_frpickle = pytest.importorskip("frtools.analyze.readers._frpickle")

from frtools.analyze.readers import torch_pickle  # noqa: E402
from frtools.analyze.readers.base import DumpError, RankDump  # noqa: E402
from frtools.formats.torch_fr import READ_KEYS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE_PICKLES = sorted((REPO / "sample_dumps").glob("*/*.pkl"))
HEALTHY = REPO / "sample_dumps" / "healthy" / "rank_0.pkl"


def test_native_parser_reads_the_entry_keys_formats_torch_fr_names() -> None:
    """The C++ parser's key list (read from its source) is formats/torch_fr's READ_KEYS."""
    source = (REPO / "frtools/analyze/readers/_native/frpickle.cpp").read_text()
    names = re.search(r"kKeyNames\[NKEYS\] = \{([^}]*)\}", source).group(1)
    assert sorted(re.findall(r'"(\w+)"', names)) == sorted(READ_KEYS)


def _plain(table: pa.Table) -> pa.Table:
    """Dictionary columns decoded: two equal tables may order their dictionaries apart."""
    return pa.table(
        {
            name: col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
            for name, col in zip(table.column_names, table.columns, strict=True)
        }
    )


def _python_read(data: bytes, path: Path) -> RankDump | str:
    try:
        return torch_pickle.read_python(data, path)
    except DumpError as e:
        return f"DumpError: {e}"


def assert_same(data: bytes, path: Path, *, native_required: bool = False) -> RankDump | None:
    """The native path gives what the Python path gives, or None (then Python decides)."""
    got = torch_pickle.read_native(data, path)
    if got is None:
        assert not native_required, f"{path}: the native parser left a plain dump to Python"
        return None
    want = _python_read(data, path)
    assert not isinstance(want, str), f"{path}: native read a dump Python refuses ({want})"
    assert_same_dump(got, got.entries, want)
    return got


def assert_same_dump(got: RankDump, entries: pa.Table, want: RankDump) -> None:
    """``got`` (its rows ``entries``) is the dump ``want`` is, field by field."""
    assert entries.schema == want.entries.schema
    assert _plain(entries).equals(_plain(want.entries)), want.rank_info.source
    assert got.rank_info == want.rank_info
    assert got.process_groups == want.process_groups
    assert got.unmapped_peer_groups == want.unmapped_peer_groups
    assert got.notes == want.notes
    assert got.bad_entries == want.bad_entries
    assert got.max_time_created_ns == want.max_time_created_ns
    assert got.default_pg_all == want.default_pg_all


# --- equivalence ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_real_torch_dumps_read_natively_as_python_reads_them() -> None:
    assert SAMPLE_PICKLES
    for path in SAMPLE_PICKLES:
        data = path.read_bytes()
        got = assert_same(data, path)
        if got is None:  # only the deliberately damaged file is left to Python
            assert isinstance(_python_read(data, path), str), path


SYNTH_JOBS = {
    # P2P between pipeline stages, ring buffers wrapped, durations
    "missing-pp-wrapped": "-n 16 --tp 2 --pp 2 --fault missing --seed 3 --buffer-size 300",
    # unwrapped, coalesced data-parallel reduce, no timing
    "mismatch-coalesced": (
        "-n 16 --tp 4 --fault mismatch-op --seed 4 --buffer-size 5000 --steps 1 "
        "--no-timing --dp-coalesced"
    ),
}


@pytest.fixture(scope="session", params=sorted(SYNTH_JOBS))
def synth_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"synth-{request.param}")
    cmd = [sys.executable, "-m", "frtools", "synth", "-o", str(out), "--workers", "1", "--force"]
    subprocess.run(cmd + SYNTH_JOBS[request.param].split(), check=True, timeout=60)
    return out


@pytest.mark.timeout(120)
def test_synth_job_dumps_read_natively_as_python_reads_them(synth_job: Path) -> None:
    files = sorted(synth_job.glob("nccl_trace_rank_*"))
    assert len(files) == 16
    wrapped = 0
    for path in files:
        got = assert_same(path.read_bytes(), path, native_required=True)
        wrapped += got.rank_info.wrapped
    if "wrapped" in synth_job.name:
        assert wrapped == 16


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_dump_version_and_protocol_reads_natively_as_python(
    protocol: int, tmp_path: Path
) -> None:
    for version in VERSIONS:
        path = tmp_path / "rank_1.pkl"
        data = pickle.dumps(fr_dump(version, n=5), protocol=protocol)
        # protocol 0 writes strings as text escapes: those are Python's to read
        assert_same(data, path, native_required=protocol >= 1)


@pytest.mark.timeout(60)
def test_gzipped_dump_reads_natively_through_read(tmp_path: Path) -> None:
    path = tmp_path / "rank_2.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(fr_dump("2.10", n=7), protocol=2)))
    native = torch_pickle.read(path)
    python = torch_pickle.read_python(gzip.decompress(path.read_bytes()), path)
    assert _plain(native.entries).equals(_plain(python.entries))
    assert native.entries.num_rows == 7


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["every entry", "the last entry only"])
def test_a_dump_with_split_sizes_is_left_to_python_which_reads_them(
    where: str, tmp_path: Path
) -> None:
    """The parser finds the all_to_all split keys among the entry keys it reads and leaves
    the dump to Python, the reader of split sizes; ``read`` then gives Python's columns
    (no scan of the file's bytes first). A key in the top level or in a value is no entry
    key: such a dump stays native."""
    dump = fr_dump("2.11", n=4)
    a2a = {"profiling_name": "nccl:all_to_all", "input_split_sizes": [1, 3],
           "output_split_sizes": [2, 2]}  # fmt: skip
    for e in dump["entries"] if where == "every entry" else dump["entries"][-1:]:
        e.update(a2a)
    data = pickle.dumps(dump, protocol=2)
    assert _frpickle.parse(data) is None
    path = tmp_path / "rank_1.pkl"
    path.write_bytes(data)
    got = torch_pickle.read(path)
    assert got.entries.column("input_split_sizes").to_pylist()[-1] == [1, 3]
    assert got.entries.column("output_split_sizes").to_pylist()[-1] == [2, 2]
    assert _plain(got.entries).equals(_plain(torch_pickle.read_python(data, path).entries))
    # the words elsewhere than as an entry's key: parsed natively
    other = fr_dump("2.11", n=4, input_split_sizes=[1])
    other["entries"][0]["thread_name"] = "output_split_sizes"
    assert _frpickle.parse(pickle.dumps(other, protocol=2)) is not None


@pytest.mark.timeout(120)
def test_a_chunk_of_dumps_reads_in_one_table_as_each_file_alone(
    synth_job: Path, tmp_path: Path
) -> None:
    """``read_many`` (a worker's chunk) joins the entries of the dumps the native parser
    reads into one table, one dictionary per column over all of them; each file's rows,
    rank, groups and notes are what ``read`` gives for it alone, and a file read the Python
    way (protocol 0, split sizes) or refused keeps its own table or its error."""
    paths = sorted(synth_job.glob("nccl_trace_rank_*"))[:6]
    odd = fr_dump("2.10", n=3)
    odd["pg_config"]["0"]["ranks"] = "[]"  # members unknown: a send's peer stays local
    odd["entries"][1]["profiling_name"] = "nccl:send 0->5000000000"  # beyond int32
    splits = fr_dump("2.11", n=2)
    splits["entries"][0].update(
        profiling_name="nccl:all_to_all", input_split_sizes=[1, 3], output_split_sizes=[2, 2]
    )
    malformed = fr_dump("2.10", n=2)
    malformed["entries"] = [1, "x"]  # every entry malformed: none kept, both counted
    lone, replaced = fr_dump("2.10", n=3), fr_dump("2.10", n=3)
    for e in lone["entries"]:
        e["thread_name"] = "w\ud800"  # a lone surrogate: U+FFFD once read
    for e in replaced["entries"]:
        e["thread_name"] = "w\ufffd"  # what that reads as, in another file of the chunk
    made = {
        "rank_40.pkl": pickle.dumps(fr_dump("2.10", n=4), protocol=0),
        "rank_41.pkl": pickle.dumps(splits, protocol=2),
        "rank_42.pkl": b"\x80\x02}q\x00(X\x07\x00\x00\x00entries",  # truncated
        "rank_43.pkl": pickle.dumps(odd, protocol=2),
        "rank_44.pkl": pickle.dumps(fr_dump("2.10", n=0), protocol=2),
        "rank_45.pkl.gz": gzip.compress(pickle.dumps(fr_dump("2.10", n=5), protocol=2)),
        "rank_46.pkl": pickle.dumps(malformed, protocol=2),
        "rank_47.pkl": pickle.dumps(lone, protocol=2),
        "rank_48.pkl": pickle.dumps(replaced, protocol=2),
    }
    for name, data in made.items():
        (tmp_path / name).write_bytes(data)
        paths.insert(2, tmp_path / name)
    outs, table, rows = torch_pickle.read_many(paths)
    assert len(outs) == len(rows) == len(paths)
    assert table.num_rows == sum(sum(r) for r in rows) > 0
    assert all(c.num_chunks == 1 for c in table.columns)
    offset = 0
    for path, out, counts in zip(paths, outs, rows, strict=True):
        try:
            alone = torch_pickle.read(path)
        except DumpError as e:
            assert isinstance(out, DumpError) and str(out) == str(e), path
            assert counts == []
            continue
        [got] = out
        if counts:  # native: rows of the chunk's table
            assert got.entries is None
            entries = table.slice(offset, counts[0])
            offset += counts[0]
        else:  # read the Python way: its own table
            assert path.name in ("rank_40.pkl", "rank_41.pkl")
            entries = got.entries
        assert_same_dump(got, entries, alone)
    assert offset == table.num_rows
    # distinct texts once read: pandas' categories (the alignment's) must be
    for name in table.column_names:
        if pa.types.is_dictionary(table.column(name).type):
            values = table.column(name).chunk(0).dictionary.to_pylist()
            assert len(values) == len(set(values)), name
    assert table.to_pandas()["thread_name"].str.startswith("w").sum() == 6
    assert outs[[p.name for p in paths].index("rank_46.pkl")][0].bad_entries == 2
    odd_read = outs[[p.name for p in paths].index("rank_43.pkl")][0]
    assert "unreadable values in 'peer' set to null" in odd_read.notes
    # and what the Python path makes of the same dump
    python = torch_pickle.read_python(made["rank_43.pkl"], tmp_path / "rank_43.pkl")
    assert odd_read.notes == python.notes


def _odd_entries() -> dict[str, list]:
    """Entries whose values are odd but legal: each either matches Python or goes to it."""
    e = fr_entry
    v = "2.10"
    send = {"profiling_name": "nccl:send 0->1", "is_p2p": None}
    return {
        "truthy is_p2p": [e(v, 0, is_p2p=1), e(v, 1, is_p2p="yes"), e(v, 2, is_p2p=[])],
        "missing is_p2p from name": [e(v, 0, **send), e(v, 1, profiling_name="gloo:recv 1<-0")],
        "mapped and unmapped peers": [
            e(v, 0, **send),
            e(v, 1, profiling_name="nccl:send 0->7", process_group=("9", "pp")),
            e(v, 2, profiling_name="nccl:recv 3<-2", process_group=("5", "x")),
        ],
        "duration of any type": [e(v, 0, duration_ms="1.5"), e(v, 1, duration_ms=3), e(v, 2)],
        "int thread ids, odd states": [
            e(v, 0, thread_id=12, state=None),
            e(v, 1, thread_name=None, state=0),
            e(v, 2, state=""),
        ],
        "frames of every shape": [
            e(v, 0, frames=[]),
            e(v, 1, frames=({"filename": "a.py", "line": 1, "name": "f"},)),
            e(v, 2, frames=[{"filename": "a.py", "line": True, "name": "f"}]),
            e(v, 3, frames=[{"filename": "a.py", "name": "f"}]),
            e(v, 4, frames=["a.py:1"]),
            e(v, 5, frames=[{"filename": "a.py", "line": 1.0, "name": "f", "extra": [1]}]),
            e(v, 6, frames=None),
        ],
        "sizes and dtypes of every shape": [
            e(v, 0, input_sizes=((4, 2), (3,)), output_sizes=[], input_dtypes=("Float",)),
            e(v, 1, input_sizes=None, input_dtypes="Half", output_dtypes=None),
            e(v, 2, input_sizes=[[-1, 0]], output_sizes=7, input_dtypes=5),
            e(v, 3, input_sizes=[[2**40], []], output_dtypes={"a": 1}),
        ],
        "sizes and dtypes Python cleans": [
            e(v, 0, input_sizes=[[True]], input_dtypes=[1, 2]),
            e(v, 1, input_sizes="[[4]]", output_sizes=[4, 2]),
        ],
        "process groups of every shape": [
            e(v, 0, process_group=["3", "tp"], pg_id=3),
            e(v, 1, process_group="4", pg_id="4"),
            e(v, 2, process_group=None, pg_id=5),
            e(v, 3, process_group=("6",), pg_id=None),
            e(v, 4, process_group=(), pg_id=None),
            e(v, 5, process_group=(7, None)),
        ],
        "keys in some entries only": [
            e(v, 0),
            {"profiling_name": "nccl:all_reduce"},
            e(v, 2, record_id=None, timeout_ms=None, retired=None),
        ],
        "malformed entries": [e(v, 0), "oops", 3, {"no": "name"}, {"profiling_name": 5}, None],
        "unexpected int column types": [e(v, 0, record_id="12"), e(v, 1, retired=1)],
        "big ints": [e(v, 0, time_created_ns=2**64), e(v, 1, duration_ms=2**60)],
        "repeated key": [e(v, 0, statf="started")],
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(_odd_entries()))
def test_odd_entry_values_read_natively_as_python_or_left_to_it(case: str, tmp_path: Path) -> None:
    dump = fr_dump("2.10", n=0)
    dump["entries"] = _odd_entries()[case]
    dump["pg_config"]["0"]["ranks"] = "[0, 1, 2, 3]"
    dump["pg_config"]["9"] = {"name": "9", "desc": "pp", "ranks": "[4, 6]"}
    left_to_python = case in _LEFT_TO_PYTHON
    for protocol in (2, 4):
        data = pickle.dumps(dump, protocol=protocol)
        if case == "repeated key":  # one dict, "state" twice: the last one wins
            data = data.replace(b"statf", b"state")
        got = assert_same(data, tmp_path / "rank_0.pkl", native_required=not left_to_python)
        assert (got is None) == left_to_python


# values whose cleaning (and the note saying so) is Python's
_LEFT_TO_PYTHON = {"sizes and dtypes Python cleans", "unexpected int column types", "big ints"}


@pytest.mark.timeout(30)
def test_surrogates_outside_the_entries_are_cleaned_natively_as_python_cleans_them(
    tmp_path: Path,
) -> None:
    """The native path skips the per-text cleaning of the top level when the parser saw no
    surrogate; one in the host, a group's description or a group name must still be
    replaced, as the Python path replaces it."""
    clean = fr_dump("2.10", n=2)
    assert _frpickle.parse(pickle.dumps(clean, protocol=2))[1]["surrogates"] is False
    for where in ("host", "desc", "group"):
        dump = fr_dump("2.10", n=2)
        if where == "host":
            dump["host"] = "node\ud8007"
        elif where == "desc":
            dump["pg_config"]["0"]["desc"] = "default_pg\udcff"
        else:
            for entry in dump["entries"]:
                entry["process_group"] = ["0", "tp\ud800"]
        data = pickle.dumps(dump, protocol=2)
        assert _frpickle.parse(data)[1]["surrogates"] is True, where
        got = assert_same(data, tmp_path / "rank_0.pkl", native_required=True)
        texts = repr((got.rank_info, got.process_groups, _plain(got.entries).to_pylist()))
        assert "\\ufffd" in texts or "\ufffd" in texts, where
        assert "\\ud8" not in texts and "\\udc" not in texts, where


@pytest.mark.timeout(30)
def test_empty_all_malformed_and_shared_entry_lists_read_natively(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.pkl"
    empty, old_empty = fr_dump("2.10", n=0), fr_dump("1.0", n=0)
    malformed = fr_dump("2.10", n=0)
    malformed["entries"] = [1, "x", None]
    shared = fr_dump("2.10", n=3)
    shared["extra"] = shared["entries"]  # the top level refers to the entries list again
    p2p_by_name = fr_dump("2.10", n=4)  # no is_p2p anywhere: the op name says it
    for e in p2p_by_name["entries"]:
        del e["is_p2p"]
    p2p_by_name["entries"][1]["profiling_name"] = "nccl:recv 0<-1"
    old_p2p = fr_dump("1.0", n=4)  # one seq_id for both kinds
    old_p2p["entries"][1]["profiling_name"] = "nccl:send 0->1"
    rows = {}
    for name, dump in [
        ("empty", empty),
        ("old_empty", old_empty),
        ("malformed", malformed),
        ("shared", shared),
        ("p2p_by_name", p2p_by_name),
        ("old_p2p", old_p2p),
    ]:
        rows[name] = assert_same(pickle.dumps(dump, protocol=2), path, native_required=True)
    assert rows["malformed"].bad_entries == 3
    assert rows["malformed"].notes == ["3 malformed entries skipped"]
    assert rows["p2p_by_name"].entries.column("is_p2p").to_pylist() == [False, True, False, False]
    assert rows["old_p2p"].entries.column("p2p_seq_id").to_pylist() == [0, 2, 0, 0]


@pytest.mark.timeout(30)
def test_memo_shared_values_are_read_once_and_alike(tmp_path: Path) -> None:
    """One frames list / shape list shared by every entry (as the synth's pickler and
    PyTorch's memo write them) gives one dictionary value."""
    frames = [{"filename": "/job/train.py", "line": 7, "name": "step"}]
    sizes = [[8, 8]]
    entries = [fr_entry("2.10", i, frames=frames, input_sizes=sizes) for i in range(50)]
    dump = fr_dump("2.10", n=0)
    dump["entries"] = entries
    got = assert_same(pickle.dumps(dump, protocol=2), tmp_path / "rank_0.pkl")
    assert got.entries.column("stack").combine_chunks().dictionary.to_pylist() == [
        "/job/train.py:7 in step"
    ]
    assert set(got.entries.column("input_sizes").to_pylist()) == {"[[8,8]]"}


# --- hostile and broken input ----------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (str(self.marker),))


@pytest.mark.timeout(30)
def test_code_in_a_pickle_is_never_run_and_refused_with_pythons_message(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    global_pickle = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    reduce_pickle = pickle.dumps({"entries": [], "version": "2.10", "x": _Payload(marker)}, 2)
    stack_global = pickle.dumps({"entries": [_Payload(marker)], "version": "2.10"}, 4)
    for data in (global_pickle, reduce_pickle, stack_global):
        assert _frpickle.parse(data) is None
        path = tmp_path / "rank_0.pkl"
        path.write_bytes(data)
        with pytest.raises(DumpError, match="refused: the pickle tries to load"):
            torch_pickle.read(path)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_truncated_dumps_are_left_to_python_at_every_cut(synth_job: Path, tmp_path: Path) -> None:
    real = [HEALTHY.read_bytes(), (synth_job / "nccl_trace_rank_3").read_bytes()]
    path = tmp_path / "rank_0.pkl"
    for data in real:
        for cut in range(0, len(data), 97):
            assert _frpickle.parse(data[:cut]) is None, cut
        for cut in range(1, len(data), max(1, len(data) // 10)):
            path.write_bytes(data[:cut])
            with pytest.raises(DumpError, match="^truncated pickle"):
                torch_pickle.read(path)


@pytest.mark.timeout(90)
def test_random_byte_flips_give_pythons_answer_or_none() -> None:
    sources = [
        HEALTHY.read_bytes(),  # torch's C++ pickler
        pickle.dumps(fr_dump("2.10", n=20), protocol=4),  # FRAME, MEMOIZE, SHORT_BINUNICODE
        pickle.dumps(fr_dump("1.4", n=10), protocol=1),  # protocol 1: no PROTO, BINPUT
    ]
    rnd = random.Random(1234)
    path = Path("rank_0.pkl")
    for data in sources:
        native = tried = 0
        deadline = time.monotonic() + 15
        while tried < 1500 and time.monotonic() < deadline:
            mutant = bytearray(data)
            for _ in range(rnd.randint(1, 4)):
                mutant[rnd.randrange(len(mutant))] = rnd.randrange(256)
            native += assert_same(bytes(mutant), path) is not None
            tried += 1
        # many flips only change a value: those the native path reads, as Python does
        assert native > tried // 20, (native, tried)


def _huge_lengths() -> dict[str, bytes]:
    head = b"\x80\x04"
    return {
        "BINUNICODE 4 GB": head + b"X" + struct.pack("<I", 0xFFFFFFFF) + b"abc",
        "BINUNICODE8 2**63": head + b"\x8d" + struct.pack("<Q", 2**63) + b"abc",
        "BINSTRING negative": b"\x80\x02T" + struct.pack("<i", -5) + b"abc.",
        "LONG4 2 GB": head + b"\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01.",
        "LONG4 9 bytes": head + b"\x8b" + struct.pack("<i", 9) + b"\x01" * 9 + b".",
        "FRAME 2**62": head + b"\x95" + struct.pack("<Q", 2**62) + b"}.",
        "LONG_BINPUT 4 G": head + b"}r" + struct.pack("<I", 0xFFFFFFFF) + b".",
        "LONG_BINGET unknown": head + b"}j" + struct.pack("<I", 7) + b".",
        "PUT negative": b"(dp-1\n.",
        "protocol 6": b"\x80\x06}.",
        "empty": b"",
        "STOP on empty stack": b"\x80\x02.",
        "APPEND to a dict": b"\x80\x02}K\x01a.",
        "SETITEMS odd": b"\x80\x02}(K\x01u.",
        "list as dict key": b"\x80\x02}]K\x01s.",
        "POP_MARK without MARK": b"\x80\x02}1.",
        "top level is a list": b"\x80\x02].",
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(_huge_lengths()))
def test_bad_lengths_and_opcodes_are_left_to_python(case: str) -> None:
    start = time.monotonic()
    assert _frpickle.parse(_huge_lengths()[case]) is None
    assert time.monotonic() - start < 5  # no allocation sized by a hostile length


@pytest.mark.timeout(60)
def test_deep_nesting_and_cycles_do_not_crash(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.pkl"
    deep = 200_000
    nested = b"]" * deep + b"a" * (deep - 1)
    # a deep list as the top level, in the entries, in an unused entry key, in pg_status
    cases = [
        b"\x80\x02" + nested + b".",
        b"\x80\x02}(X\x07\x00\x00\x00entries" + nested + b"u.",
    ]
    # a deep list as frames, as an unused entry key, as pg_status (a placeholder string
    # replaced by the nested list in the pickle bytes)
    placeholder = "DEEP_LIST_HERE"
    encoded = b"X" + struct.pack("<I", len(placeholder)) + placeholder.encode()
    for where in ("frames", "unused", "pg_status"):
        dump = fr_dump("2.10", n=2)
        if where == "pg_status":
            dump["pg_status"] = placeholder
        else:
            dump["entries"][1][where] = placeholder
        cases.append(pickle.dumps(dump, protocol=2).replace(encoded, nested))
    # a list that contains itself, as frames and as a top-level value
    for where in ("frames", "pg_status"):
        dump = fr_dump("2.10", n=2)
        cycle: list = []
        cycle.append(cycle)
        if where == "pg_status":
            dump["pg_status"] = cycle
        else:
            dump["entries"][0]["frames"] = cycle
        cases.append(pickle.dumps(dump, protocol=2))
    for data in cases:
        assert_same(data, path)


@pytest.mark.timeout(60)
def test_unreadable_column_values_give_pythons_notes(tmp_path: Path) -> None:
    """A str in an int column is Python's to clean (and to say so): the native parser
    leaves the file to it, and ``read`` reports what the Python path reports."""
    dump = fr_dump("2.10", n=3)
    dump["entries"][1]["record_id"] = "1"
    path = tmp_path / "rank_0.pkl"
    path.write_bytes(pickle.dumps(dump, protocol=2))
    assert _frpickle.parse(path.read_bytes()) is None
    got = torch_pickle.read(path)
    assert "unreadable values in 'record_id' set to null" in got.notes


# --- the GIL ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_dump() -> bytes:
    """A ~30 MB dump: 150,000 entries, values not shared, like a long buffer of a big job."""
    entries = [
        fr_entry(
            "2.10",
            i,
            input_sizes=[[i % 97, 4]],
            frames=[
                {"filename": f"/job/model_{i % 13}.py", "line": i % 501, "name": "forward"},
                {"filename": "/job/train.py", "line": 42, "name": "step"},
            ],
        )
        for i in range(150_000)
    ]
    dump = fr_dump("2.10", n=0)
    dump["entries"] = entries
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=2).dump(dump)
    data = buf.getvalue()
    assert len(data) > 20_000_000
    return data


@pytest.mark.timeout(120)
def test_parse_releases_the_gil_so_another_thread_keeps_running(big_dump: bytes) -> None:
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # pure Python: runs only while it holds the GIL
        n = 0
        while not stop.is_set():
            n += 1
            if n % 2000 == 0:
                stamps.append(time.perf_counter())

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        windows = []
        for _ in range(3):
            t0 = time.perf_counter()
            result = _frpickle.parse(big_dump)
            t1 = time.perf_counter()
            assert result is not None and result[1]["n"] == 150_000
            windows.append((t0, t1))
    finally:
        stop.set()
        ticker.join(10)
    # in the middle 80% of each parse, the ticker ran: the GIL was free
    ticking = 0
    for t0, t1 in windows:
        lo, hi = t0 + 0.1 * (t1 - t0), t1 - 0.1 * (t1 - t0)
        ticking += any(lo < s < hi for s in stamps)
    assert ticking >= 2, f"ticker stalled during {3 - ticking} of 3 parses"


@pytest.mark.timeout(120)
def test_two_threads_parse_at_once_and_agree(big_dump: bytes) -> None:
    results: list = [None, None]

    def work(i: int) -> None:
        results[i] = _frpickle.parse(big_dump)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a, b = results
    assert a is not None and b is not None
    assert a[1]["n"] == b[1]["n"] == 150_000
    assert a[1]["input_sizes"] == b[1]["input_sizes"]
    assert a[1]["time_created_ns"] == b[1]["time_created_ns"]


# --- the user's view -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_analyze_reports_the_same_with_and_without_the_native_parser(synth_job: Path) -> None:
    def analyze(native: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, FRTOOLS_NATIVE_PICKLE=native)
        cmd = [sys.executable, "-m", "frtools", "analyze", "--format", "json", str(synth_job)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)

    native, python = analyze("1"), analyze("0")
    assert native.returncode == python.returncode == 1, native.stderr + python.stderr
    assert native.stdout == python.stdout
