"""frtools snapshots into the Trace: names, seq ids, peers, states, call sites, groups;
torn slots, damaged files, live copies; and the analyzer reading them end to end."""

from __future__ import annotations

import ast
import json
import random
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import start_ranks, stop

import frtools.formats.blackbox as blackbox
from frtools.analyze.readers import frtools_snapshot as reader
from frtools.analyze.readers import load_trace
from frtools.analyze.readers.base import DumpError
from frtools.formats.blackbox import (
    SLOT_DTYPE,
    SnapshotError,
    copy_consistent,
    read_header,
    read_snapshot,
)
from frtools.recorder.native import load_native

native = load_native()
WORLD = 4
USER_FILE = "/home/alice/train.py"


def stack(*frames: tuple[str, int, str]) -> str:
    """The interned stack format: innermost first, one "file:line in func" per line."""
    return "\n".join(f"{f}:{line} in {fn}" for f, line, fn in frames)


def write_rank(directory: Path, rank: int, hang_rank: int = 3, capacity: int = 64) -> Path:
    """A rank of a 4-rank Gloo job: 3 completed all_reduces on the default group, a
    send/recv pair between ranks 0 and 1 on group "1", then all_reduce #4 that every rank
    but ``hang_rank`` issued and nobody finished."""
    path = directory / f"rank_{rank}.frt"
    identity = {
        "job_id": "job-1",
        "rank": rank,
        "world_size": WORLD,
        "host": f"node{rank // 2}",
        "pid": 1000 + rank,
        "local_rank": rank % 2,
        "device": "cpu",
        "device_id": None,
        "torch_version": "2.13.0",
        "backend": "gloo",
    }
    box = native.BlackBox(str(path), capacity, 1 << 16, json.dumps(identity))
    default = box.add_process_group("0", "default_pg", list(range(WORLD)))
    pair = box.add_process_group("1", "pair", [0, 1])
    allreduce = box.intern("gloo:all_reduce")
    sizes = box.intern("[[4,2]]")
    dtypes = box.intern("Float")
    step = box.intern(
        stack(
            (
                "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
                2800,
                "all_reduce",
            ),
            (USER_FILE, 42, "step"),
            (USER_FILE, 77, "main"),
        )
    )
    for seq in (1, 2, 3):
        rid = box.record(default, allreduce, seq, 0, -1, False, sizes, sizes, dtypes, dtypes, step)
        box.mark_started(rid)
        box.mark_completed(rid)
    if rank in (0, 1):
        op = box.intern("send" if rank == 0 else "recv")
        rid = box.record(pair, op, 0, 1, 1 - rank, True, sizes, sizes, dtypes, dtypes, step)
        box.completer(rid)(None)
    if rank != hang_rank:
        box.record(default, allreduce, 4, 0, -1, False, sizes, sizes, dtypes, dtypes, step)
    box.close()
    return path


@pytest.fixture(scope="session")
def hung_job(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hung_job")
    for rank in range(WORLD):
        write_rank(directory, rank)
    return directory


@pytest.mark.timeout(30)
def test_snapshot_entries_use_pytorch_names_and_global_ranks(hung_job):
    trace = load_trace(hung_job)
    assert [i.status for i in trace.inputs] == ["ok"] * WORLD
    df = trace.entries.to_pandas()
    r0 = df[df["rank"] == 0].sort_values("record_id")
    assert r0["op"].tolist() == ["all_reduce"] * 3 + ["send", "all_reduce"]
    assert r0["profiling_name"].tolist()[:1] == ["gloo:all_reduce"]
    assert r0["collective_seq_id"].tolist() == [1, 2, 3, 0, 4]
    assert r0["p2p_seq_id"].tolist() == [0, 0, 0, 1, 0]
    assert r0["state"].tolist() == ["completed"] * 4 + ["scheduled"]
    send = r0[r0["op"] == "send"].iloc[0]
    assert bool(send["is_p2p"]) and send["peer"] == 1 and send["pg_name"] == "1"
    assert send["input_sizes"] == "[[4,2]]" and send["input_dtypes"] == "Float"
    first = r0.iloc[0]
    assert first["pg_desc"] == "default_pg"
    assert first["time_created_ns"] <= first["time_started_ns"] <= first["time_completed_ns"]
    assert first["call_site"] == f"{USER_FILE}:42 in step"
    assert str(first["stack"]).splitlines()[1] == f"{USER_FILE}:42 in step"
    assert r0.iloc[-1]["time_completed_ns"] != r0.iloc[-1]["time_completed_ns"]  # NaN: null
    assert df[df["rank"] == 3]["collective_seq_id"].max() == 3


@pytest.mark.timeout(30)
def test_snapshot_rank_identity_and_real_group_membership(hung_job):
    trace = load_trace(hung_job)
    info = trace.ranks[2]
    assert (info.host, info.pid, info.local_rank, info.device) == ("node1", 1002, 0, "cpu")
    assert info.format == "frtools" and info.world_size == WORLD and not info.wrapped
    assert info.pg_status["0"] == {
        "last_enqueued_collective": 4,
        "last_started_collective": 3,
        "last_completed_collective": 3,
    }
    assert trace.process_groups["0"].ranks == (0, 1, 2, 3)
    assert trace.process_groups["1"].ranks == (0, 1)
    assert not trace.process_groups["0"].inferred


@pytest.mark.timeout(60)
def test_analyze_blames_the_rank_that_never_issued_the_collective(hung_job):
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(hung_job), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = json.loads(proc.stdout)["verdict"]
    assert verdict["kind"] == "missing"
    assert [g["rank"] for g in verdict["guilty"]] == [3]
    assert verdict["guilty"][0]["call_site"] == f"{USER_FILE}:42 in step"
    assert verdict["waiting"] == [0, 1, 2]
    assert verdict["collective_seq_id"] == 4 and verdict["process_group"]["name"] == "0"


@pytest.mark.timeout(30)
def test_wrapped_ring_is_reported_on_the_rank(tmp_path):
    path = write_rank(tmp_path, 0, capacity=4)
    dump = reader.read(path)
    assert dump.rank_info.wrapped
    assert dump.entries.column("record_id").to_pylist() == [1, 2, 3, 4]


@pytest.mark.timeout(30)
def test_torn_slot_is_dropped_and_said_so(hung_job, tmp_path):
    src = hung_job / "rank_0.frt"
    torn = tmp_path / "rank_0.frt"
    shutil.copy(src, torn)
    header = read_header(torn)
    with open(torn, "r+b") as f:  # slot 1 looks half-written: odd sequence counter
        offset = header["slots_offset"] + 1 * SLOT_DTYPE.itemsize
        f.seek(offset)
        (seq,) = struct.unpack("<Q", f.read(8))
        f.seek(offset)
        f.write(struct.pack("<Q", seq | 1))
    dump = reader.read(torn)
    assert dump.bad_entries == 1
    assert dump.entries.column("record_id").to_pylist() == [0, 2, 3, 4]
    trace = load_trace(tmp_path)
    assert "dropped 1 torn slot" in trace.inputs[0].reason


@pytest.mark.timeout(30)
def test_damaged_snapshots_give_one_line_reasons(hung_job, tmp_path):
    data = (hung_job / "rank_1.frt").read_bytes()
    truncated = tmp_path / "rank_1.frt"
    truncated.write_bytes(data[:6000])
    with pytest.raises(DumpError, match="truncated frtools snapshot"):
        reader.read(truncated)
    future = tmp_path / "rank_2.frt"
    future.write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    with pytest.raises(DumpError, match="unsupported frtools snapshot version 99"):
        reader.read(future)
    with pytest.raises(SnapshotError, match="bad magic"):
        read_snapshot(b"PK\3\4" + b"\0" * 8188)
    # a box the recorder has created and sized but not yet written its header to
    with pytest.raises(SnapshotError, match=r"incomplete \(file being created\?\)"):
        read_snapshot(b"\0" * 8192)
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert proc.returncode == 2, out
    assert "rank_1.frt" in out


LIVE_WRITER = textwrap.dedent(
    """
    import json, sys, time
    from frtools.recorder._blackbox import BlackBox
    box = BlackBox(sys.argv[1], 256, 1 << 20, json.dumps({"rank": 0}))
    pg = box.add_process_group("0", "default_pg", [0])
    deadline = time.monotonic() + float(sys.argv[2])
    seq = 0
    while time.monotonic() < deadline:
        seq += 1
        op = box.intern(f"op{seq % 50}")
        rid = box.record(pg, op, seq, 0, -1, False, op, op, 0, 0, 0)
        box.mark_completed(rid)
    """
)


@pytest.mark.timeout(60)
def test_copy_of_a_live_file_parses_with_consistent_slots(tmp_path):
    live = tmp_path / "live" / "rank_0.frt"
    live.parent.mkdir()
    procs = start_ranks([sys.executable, "-c", LIVE_WRITER, str(live), "20"], 1)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if live.exists() and live.stat().st_size > 0:
                try:
                    if read_header(live)["next_record_id"] > 1000:
                        break
                except (OSError, ValueError):
                    pass
            time.sleep(0.05)
        copies = 0
        for i in range(30):
            dst = tmp_path / f"copy_{i}.frt"
            copy_consistent(live, dst)
            # the copy, and the live file read in place: only whole records are kept
            for snap in (read_snapshot(dst), read_snapshot(live)):
                slots = snap.slots
                assert len(slots) >= 250 - snap.torn
                # a kept slot is one whole record: its op and sizes ids match as written
                assert (slots["op"] == slots["input_sizes"]).all()
                assert (slots["collective_seq_id"] == slots["record_id"] + 1).all()
                ops = set(slots["op"].tolist())
                assert all(snap.string(int(i)).startswith("op") for i in ops)
            copies += 1
        assert copies == 30
        assert procs[0].poll() is None, "the writer must still be running while we copy"
    finally:
        stop(procs)


@pytest.mark.timeout(60)
def test_reading_a_snapshot_costs_about_a_millisecond(tmp_path):
    """16,384 ranks must be readable in well under a minute on 2 cores: keep per-file CPU
    small (measured ~1 ms for 400 entries; the bound leaves room for a loaded machine)."""
    files = []
    for rank in range(100):
        path = tmp_path / f"rank_{rank}.frt"
        box = native.BlackBox(str(path), 512, 1 << 16, json.dumps({"rank": rank}))
        pg = box.add_process_group("0", "default_pg", list(range(100)))
        op = box.intern("nccl:all_reduce")
        sizes = [box.intern(f"[[{k},1024]]") for k in range(4)]
        dtypes = box.intern("BFloat16")
        stacks = [box.intern(stack((USER_FILE, 10 * j + 1, "step"))) for j in range(5)]
        for i in range(400):
            rid = box.record(
                pg,
                op,
                i + 1,
                0,
                -1,
                False,
                sizes[i % 4],
                sizes[i % 4],
                dtypes,
                dtypes,
                stacks[i % 5],
            )
            box.mark_completed(rid)
        box.close()
        files.append(path)
    reader.read(files[0])
    t0 = time.process_time()
    rows = sum(reader.read(f).entries.num_rows for f in files)
    per_file_ms = (time.process_time() - t0) * 1e3 / len(files)
    assert rows == 40_000
    assert per_file_ms < 5, f"{per_file_ms:.2f} ms of CPU per snapshot"


@pytest.mark.timeout(60)
def test_corrupted_snapshots_are_read_or_refused_never_crash(hung_job, tmp_path):
    """Random byte damage in every region: the reader gives a Trace or a DumpError."""
    data = (hung_job / "rank_0.frt").read_bytes()
    h = read_snapshot(data).header
    regions = [
        (0, 200),
        (512, 700),
        (h["pg_offset"], h["pg_offset"] + 128),
        (h["slots_offset"], h["slots_offset"] + 6 * SLOT_DTYPE.itemsize),
        (h["strings_offset"], h["strings_offset"] + h["strings_used"]),
    ]
    rng = random.Random(7)
    damaged = tmp_path / "rank_0.frt"
    outcomes = {"read": 0, "refused": 0}
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            lo, hi = rng.choice(regions)
            buf[rng.randrange(lo, hi)] = rng.randrange(256)
        if rng.random() < 0.1:
            buf = buf[: rng.randrange(len(buf))]
        damaged.write_bytes(bytes(buf))
        try:
            reader.read(damaged)
            outcomes["read"] += 1
        except DumpError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
    assert outcomes["read"] and outcomes["refused"]


# --- the native writer and formats/blackbox agree on the layout -----------------------------

BLACKBOX_CPP = Path(blackbox.__file__).parents[1] / "recorder" / "_native" / "blackbox.cpp"
_C_SIZES = {"char": 1, "uint8_t": 1, "uint16_t": 2, "int32_t": 4, "uint32_t": 4}
_C_SIZES |= {"int64_t": 8, "uint64_t": 8, "double": 8}


def c_struct(source: str, name: str) -> tuple[list[tuple[str, int, int]], int]:
    """``(field, offset, size)`` of a C struct of fixed-size members at natural alignment,
    and the struct's size."""
    body = re.search(rf"^struct {name} {{\n(.*?)^}};", source, re.S | re.M)
    assert body, f"struct {name} not found in {BLACKBOX_CPP}"
    fields, offset, align = [], 0, 1
    for m in re.finditer(r"^\s*(\w+)\s+(\w+)(?:\[(\d+)\])?;", body.group(1), re.M):
        size = _C_SIZES[m.group(1)]
        offset += -offset % size
        fields.append((m.group(2), offset, size * int(m.group(3) or 1)))
        offset += size * int(m.group(3) or 1)
        align = max(align, size)
    return fields, offset + -offset % align


def c_constant(source: str, name: str) -> str:
    m = re.search(rf"\b{name}(?:\[\d+\])? = ([^;]+);", source)
    assert m, f"{name} not found in {BLACKBOX_CPP}"
    return m.group(1).strip()


def test_native_black_box_layout_is_the_one_formats_blackbox_reads():
    """The C++ writer's constants and structs (read from its source, nothing compiled) match
    the Python side field by field: magic, version, header size, identity offset, string
    ids, slot states and every offset of the header, slot and process-group structs."""
    source = BLACKBOX_CPP.read_text()
    magic = c_constant(source, "kMagic").strip("{}").split(",")
    assert bytes(ord(ast.literal_eval(c.strip())) for c in magic) == blackbox.MAGIC
    assert int(c_constant(source, "kVersion")) == blackbox.FORMAT_VERSION
    assert int(c_constant(source, "kHeaderBytes")) == blackbox.HEADER_BYTES
    assert int(c_constant(source, "kIdentityOffset")) == blackbox.IDENTITY_OFFSET
    assert int(c_constant(source, "kStringsReserved")) == blackbox.STRINGS_RESERVED
    assert int(c_constant(source, "kStrNone")) == blackbox.STRING_NONE
    assert int(c_constant(source, "kStrFull").rstrip("uU"), 16) == blackbox.STRING_FULL
    states = re.search(r"enum : uint8_t \{([^}]*)\}", source).group(1)
    for name, value in re.findall(r"k(\w+) = (\d+)", states):
        assert blackbox.STATE_NAMES[int(value)] == ("" if name == "Empty" else name.lower())

    header, header_size = c_struct(source, "Header")
    assert header_size <= blackbox.IDENTITY_OFFSET
    layout = dict(blackbox.HEADER_LAYOUT)
    assert [(f, off, size) for f, off, size in header] == [
        (f, blackbox.HEADER_OFFSETS[f], struct.calcsize("<" + layout[f])) for f in layout
    ]
    for struct_name, dtype in (("Slot", blackbox.SLOT_DTYPE), ("PgEntry", blackbox.PG_DTYPE)):
        fields, size = c_struct(source, struct_name)
        assert size == dtype.itemsize, struct_name
        named = [(f, off, n) for f, off, n in fields if f != "reserved"]
        assert named == [(f, dtype.fields[f][1], dtype.fields[f][0].itemsize) for f in dtype.names]


def test_pack_header_and_file_offsets_write_what_the_native_black_box_writes(tmp_path):
    """The writer's side of formats/blackbox (used by ``frtools synth``) reproduces a header
    the native black box wrote, byte for byte, and lays the file out the same way."""
    path = write_rank(tmp_path, 0)
    header = read_header(path)
    assert blackbox.file_offsets(header["capacity"], header["pg_capacity"]) == (
        header["pg_offset"],
        header["slots_offset"],
        header["strings_offset"],
    )
    fields = {name: header[name] for name, _ in blackbox.HEADER_LAYOUT}
    packed = blackbox.pack_header(**fields)
    assert packed == path.read_bytes()[: len(packed)]
    with pytest.raises(TypeError, match="not a header field"):
        blackbox.pack_header(capacty=1)


def test_version_1_files_are_still_read(hung_job, tmp_path):
    """Version 1 had no failure facts; its bytes there are zero, so it reads the same, with
    no errors, and a box its process closed ended clean."""
    data = bytearray((hung_job / "rank_0.frt").read_bytes())
    struct.pack_into("<I", data, blackbox.HEADER_OFFSETS["version"], 1)
    old = tmp_path / "rank_0.frt"
    old.write_bytes(bytes(data))
    dump = reader.read(old)
    assert dump.rank_info.version == "1"
    assert dump.entries.column("error").null_count == dump.entries.num_rows
    assert (dump.rank_info.exit_kind, dump.rank_info.exit_detail) == ("clean", None)
    assert dump.rank_info.last_heartbeat_ns is None  # no watchdog ran in write_rank


def test_a_box_of_this_host_is_running_or_killed_by_its_process(tmp_path):
    """Nothing recorded: the owner's process decides — alive here: running; gone: killed
    (a pid reused by a process started after the box was created is gone too)."""
    import os
    import socket

    identity = {"rank": 0, "host": socket.gethostname(), "backend": "gloo"}
    path = tmp_path / "rank_0.frt"
    box = native.BlackBox(str(path), 8, 1 << 16, json.dumps(identity))
    dump = reader.read(path)
    assert (dump.rank_info.exit_kind, dump.rank_info.alive) == ("running", True)
    del box
    data = bytearray(path.read_bytes())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    struct.pack_into("<q", data, blackbox.HEADER_OFFSETS["owner_pid"], int(child.stdout))
    path.write_bytes(bytes(data))
    assert reader.read(path).rank_info.exit_kind == "killed"
    # a live process that started after the box was created holds a reused pid
    struct.pack_into("<q", data, blackbox.HEADER_OFFSETS["owner_pid"], os.getpid())
    struct.pack_into("<q", data, blackbox.HEADER_OFFSETS["created_ns"], 1)
    path.write_bytes(bytes(data))
    assert reader.read(path).rank_info.exit_kind == "killed"
    struct.pack_into("<q", data, blackbox.HEADER_OFFSETS["created_ns"], time.time_ns() + 10**12)
    path.write_bytes(bytes(data))
    assert reader.read(path).rank_info.exit_kind == "running"


@pytest.mark.timeout(60)
def test_a_chunk_of_boxes_reads_as_one_table_equal_to_the_boxes_read_one_by_one(hung_job, tmp_path):
    """A worker's chunk of boxes becomes one table (one Arrow array per column, not ~30 per
    box): row for row what each box gives alone, in Arrow's unified dictionaries' order,
    and a damaged box in the middle costs only itself."""
    from frtools.model.trace import concat_entries

    for rank in range(WORLD):
        shutil.copy(hung_job / f"rank_{rank}.frt", tmp_path / f"rank_{rank}.frt")
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(write_rank(other, rank=1, hang_rank=1), tmp_path / "rank_4.frt")
    (tmp_path / "rank_5.frt").write_bytes((hung_job / "rank_1.frt").read_bytes()[:6000])
    empty = native.BlackBox(str(tmp_path / "rank_6.frt"), 16, 1 << 12, json.dumps({"rank": 6}))
    empty.add_process_group("0", "default_pg", [6])
    empty.close()
    files = [tmp_path / f"rank_{r}.frt" for r in (0, 1, 5, 2, 6, 3, 4)]

    outs, table, rows = reader.read_many(files)

    assert isinstance(outs[2], DumpError) and "truncated frtools snapshot" in str(outs[2])
    assert rows[2] == [] and rows[4] == [0]
    alone = [reader.read(f) for f in files if f.name != "rank_5.frt"]
    assert table.equals(concat_entries([d.entries for d in alone]).combine_chunks())
    offset = 0
    batched = [out[0] for out in outs if not isinstance(out, Exception)]
    for one, many, (n,) in zip(alone, batched, [r for r in rows if r], strict=True):
        assert many.entries is None and n == one.entries.num_rows
        part = table.slice(offset, n)
        assert part.to_pylist() == one.entries.to_pylist()
        offset += n
        assert many.rank_info == one.rank_info and many.notes == one.notes
        assert many.process_groups == one.process_groups
    assert offset == table.num_rows == sum(d.entries.num_rows for d in alone) > 0
