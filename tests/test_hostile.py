"""Hostile inputs hold (issue #11): each case a security review reproduced, run through the
real code in a child process whose address space is capped at 1 GiB (``RLIMIT_AS``) and
killed at 30 s: the file is refused, named, with the limit or the reason, and the rest of
the analysis (or collection) goes on. The builders are in tests/hostile.py; the limits in
``frtools.formats.limits`` (docs/security.md).
"""

from __future__ import annotations

import http.server
import io
import json
import os
import pickle
import socketserver
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from hostile import (
    NO_NATIVE,
    STEERING,
    analyze_limited,
    code_pickles,
    deep_pickle,
    gzip_bomb,
    huge_group_pickle,
    inputs_by_name,
    load_limited,
    long_strings_snapshot,
    manifest,
    memo_bomb,
    rank_inside_pickle,
    run_limited,
    shared_sizes_pickle,
    slots_2_32_snapshot,
    snapshot,
    sparse_snapshot,
    steering_dumps,
    valid_dump,
    valid_snapshot,
)

from frtools.analyze.readers import safe_pickle
from frtools.model.ranks import MAX_WORLD_SIZE

PY = sys.executable
SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
# the three ways a pickle can be read: the native parser first (it leaves a hostile pickle
# to Python), the Python unpickler turned on by the variable, and no native parser at all
PICKLE_PATHS = {
    "native": ({}, ""),
    "FRTOOLS_NATIVE_PICKLE=0": ({"FRTOOLS_NATIVE_PICKLE": "0"}, ""),
    "not built": ({}, NO_NATIVE),
}


def _load(directory: Path, path_kind: str = "native") -> dict:
    env, prelude = PICKLE_PATHS[path_kind]
    got = load_limited(directory, env=env, prelude=prelude)
    assert got.returncode == 0, (
        f"rc={got.returncode} after {got.seconds:.1f} s: {got.stderr[-2000:]}"
    )
    return got.json()


def _refused(result: dict, name: str, *words: str) -> str:
    item = inputs_by_name(result)[name]
    assert item["status"] == "error", item
    for word in words:
        assert word in item["reason"], item
    return item["reason"]


# --- analyzer: tiny files that took gigabytes --------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path_kind", sorted(PICKLE_PATHS))
def test_memo_index_beyond_the_input_is_refused(tmp_path: Path, path_kind: str) -> None:
    """9 bytes with memo index 2**27: CPython's unpickler sized its memo from it (2 GB)."""
    valid_dump(tmp_path, 1)
    (tmp_path / "rank_0.pkl").write_bytes(memo_bomb())
    result = _load(tmp_path, path_kind)
    _refused(result, "rank_0.pkl", "memo index 134,217,728 beyond its own 9 bytes")
    assert result["ranks"] == [1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path_kind", sorted(PICKLE_PATHS))
def test_frame_inside_a_frame_is_refused_as_corrupt(tmp_path: Path, path_kind: str) -> None:
    """A protocol-4 dump with a copy of its start inside its first frame (what the fuzzer
    made of one by duplicating a range; CPython's C unpickler answered that one with a
    MemoryError at once, which read as "too large to load (out of memory)"): refused by the
    scan as the corrupt pickle it is, before the unpickler sees it."""
    import pickletools

    valid_dump(tmp_path, 1)
    data = pickle.dumps(pickle.loads((SAMPLES / "missing" / "rank_2.pkl").read_bytes()), 4)
    assert data[2] == 0x95  # FRAME, after PROTO 4
    at = [pos for _, _, pos in pickletools.genops(data)][40]  # an opcode in the first frame
    (tmp_path / "rank_0.pkl").write_bytes(data[:at] + data[:at] + data[at:])
    result = _load(tmp_path, path_kind)
    _refused(result, "rank_0.pkl", "corrupt pickle: a frame begins inside another frame")
    assert result["ranks"] == [1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path_kind", sorted(PICKLE_PATHS))
def test_shared_references_count_for_what_they_expand_to(tmp_path: Path, path_kind: str) -> None:
    """60 KB whose input_sizes is one 15,000-int list 15,000 times (pickle memo sharing):
    2.4 GB and exit 0 before; both the native parser and the Python unpickler count it."""
    valid_dump(tmp_path, 1)
    data = shared_sizes_pickle()
    assert len(data) < 80_000
    (tmp_path / "rank_0.pkl").write_bytes(data)
    result = _load(tmp_path, path_kind)
    _refused(result, "rank_0.pkl", "limit expanded_values")


@pytest.mark.timeout(120)
def test_gzip_bomb_is_refused_at_its_ratio(tmp_path: Path) -> None:
    """About 1 MB of gzip holding 1 GiB of zeros."""
    valid_dump(tmp_path, 1)
    bomb = gzip_bomb(tmp_path / "rank_0.pkl.gz")
    assert bomb.stat().st_size < 2 << 20
    result = _load(tmp_path)
    _refused(result, "rank_0.pkl.gz", "limit gunzip_ratio")


@pytest.mark.timeout(120)
def test_sparse_snapshot_claiming_millions_of_slots_is_refused(tmp_path: Path) -> None:
    """A black box claiming 2**23 slots (1 GiB of ring), all holes on disk."""
    (tmp_path / "rank_1.frt").write_bytes(valid_snapshot(1, 2))
    sparse_snapshot(tmp_path / "rank_0.frt")
    result = _load(tmp_path)
    reason = _refused(result, "rank_0.frt")
    assert "limit sparse_bytes" in reason or "limit snapshot_slots" in reason, reason
    # not sparse, but too many slots: refused by the slot limit, before any is read
    (tmp_path / "rank_0.frt").write_bytes(snapshot(capacity=(1 << 20) + 1))
    _refused(_load(tmp_path), "rank_0.frt", "limit snapshot_slots")


@pytest.mark.timeout(120)
def test_snapshot_strings_of_a_mebibyte_each_are_refused(tmp_path: Path) -> None:
    """A gzip'd black box of a few KB whose 1,024 string ids each decode to 1 MiB."""
    (tmp_path / "rank_1.frt").write_bytes(valid_snapshot(1, 2))
    data = long_strings_snapshot()
    assert len(data) < 16_000
    (tmp_path / "rank_0.frt.gz").write_bytes(data)
    reason = _refused(_load(tmp_path), "rank_0.frt.gz")
    assert "limit text_bytes" in reason or "limit string_bytes" in reason, reason


@pytest.mark.timeout(180)
def test_world_sizes_and_ranks_beyond_the_largest_world(tmp_path: Path) -> None:
    """Every path a rank or world size comes in by is bounded by MAX_WORLD_SIZE (2**20):
    a group's member list, a manifest's world_size, --world-size, a snapshot header's
    world_size and rank, a snapshot's rank-range text, a rank in a file name or inside a
    dump. Before, each built set(range(4e9)) or a world of 4e9 expected ranks."""
    # a member list: the group is inferred from who recorded ops instead
    one = tmp_path / "members"
    one.mkdir()
    (one / "rank_0.pkl").write_bytes(huge_group_pickle())
    result = _load(one)
    assert result["ranks"] == [0] and result["world_size"] == 1

    # a manifest's world_size: ignored, and said so
    two = tmp_path / "manifest"
    two.mkdir()
    valid_dump(two, 0)
    (two / "manifest.json").write_text(manifest(4_000_000_000))
    result = _load(two)
    assert result["expected"] == 1
    assert (
        "world_size 4000000000 is beyond the limit"
        in inputs_by_name(result)["manifest.json"]["reason"]
    )

    # --world-size: a usage error, exit 2, one line
    got = analyze_limited(two, "--world-size", "4000000000")
    assert got.returncode == 2 and "beyond the limit of 1048576 ranks" in got.stderr, got

    # a snapshot header's world_size (ignored, noted) and rank (refused); a rank-range text
    three = tmp_path / "snapshot"
    three.mkdir()
    (three / "rank_0.frt").write_bytes(
        snapshot(
            identity={"rank": 0, "world_size": 4_000_000_000, "backend": "gloo"},
            groups=[("0", "default_pg", "0"), ("1", "tp", "0-4000000000")],
            entries=[{"op": "gloo:all_reduce"}],
        )
    )
    (three / "rank_1.frt").write_bytes(
        snapshot(identity={"rank": 4_000_000_000, "world_size": 2}, entries=[{"op": "x"}])
    )
    result = _load(three)
    assert result["ranks"] == [0] and result["expected"] == 1
    assert (
        "world_size 4000000000 in the header identity is beyond the limit"
        in inputs_by_name(result)["rank_0.frt"]["reason"]
    )
    _refused(result, "rank_1.frt", "rank 4000000000 in the header identity is not a rank")

    # a rank in a file name, a rank inside a dump
    four = tmp_path / "names"
    four.mkdir()
    valid_dump(four, 0)
    (four / "rank_4000000000.pkl").write_bytes((four / "rank_0.pkl").read_bytes())
    (four / "rank_1.pkl").write_bytes(rank_inside_pickle(2_000_000_000))
    result = _load(four)
    assert result["ranks"] == [0] and result["expected"] == 2
    _refused(result, "rank_4000000000.pkl", "cannot tell which rank")
    _refused(result, "rank_1.pkl", f"out of range (0 … {MAX_WORLD_SIZE - 1})")


@pytest.mark.timeout(120)
def test_rank_summary_is_estimated_before_it_is_parsed(tmp_path: Path) -> None:
    """A rank summary (frtools.recovery's JSON) is read within ``parsed_bytes`` like a JSON
    dump: 200 KB of empty objects would take ~16 MB parsed; with the limit lowered to 1 MiB
    through FRTOOLS_LIMITS (a file may take 32 bytes per byte: 6.4 MB) it is refused."""
    valid_dump(tmp_path, 1)
    pad = ",".join(["{}"] * 66_000)
    (tmp_path / "rank_0.summary.json").write_text(
        f'{{"format": "frtools-summary", "version": 1, "kind": "rank", "pad": [{pad}]}}'
    )
    got = load_limited(tmp_path, env={"FRTOOLS_LIMITS": "parsed_bytes=1M"})
    assert got.returncode == 0, got.stderr[-2000:]
    _refused(got.json(), "rank_0.summary.json", "JSON would take", "limit parsed_bytes")


# --- analyzer: side files that hung it -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_fifo_and_device_named_as_side_files_are_refused(tmp_path: Path) -> None:
    """A FIFO named manifest.json hung ``frtools analyze``; a link to /dev/zero named
    rank_0.stacks read forever (MemoryError)."""
    valid_dump(tmp_path, 0)
    valid_dump(tmp_path, 1)
    os.mkfifo(tmp_path / "manifest.json")
    (tmp_path / "rank_0.stacks").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "rank_1.stacks")
    got = analyze_limited(tmp_path)
    assert got.returncode in (0, 1), f"rc={got.returncode}: {got.stderr[-2000:]}"
    inputs = {Path(i["path"]).name: i for i in got.json()["inputs"]}
    assert inputs["manifest.json"]["status"] == "error"
    assert "FIFO" in inputs["manifest.json"]["reason"]
    assert "symbolic link" in inputs["rank_0.stacks"]["reason"]
    assert "FIFO" in inputs["rank_1.stacks"]["reason"]


# --- analyzer: a real snapshot that crashed it ------------------------------------------------------

JOB = """
import os
import torch
import torch.distributed as dist


def reduce(t):
    dist.all_reduce(t)  # the innermost user frame of both call sites


def forward(t):
    reduce(t)


def backward(t):
    reduce(t)


dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1
)
t = torch.ones(4)
forward(t)
backward(t)
dist.destroy_process_group()
"""


@pytest.mark.torch  # runs the recorder: again on the older torch (scripts/test.sh)
@pytest.mark.timeout(180)
def test_two_call_sites_sharing_their_innermost_frame(tmp_path: Path) -> None:
    """A real 1-rank recorder run calling all_reduce from two functions through one helper:
    two stacks, one call site. The reader's dictionaries repeated the call site and the
    analysis died ("Categorical categories must be unique")."""
    pytest.importorskip("torch")
    from jobs import free_port

    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ, PORT=str(free_port()), FRTOOLS_JOB_ID="shared-frame")
    run = subprocess.run(
        [PY, "-m", "frtools", "run", "--dir", str(tmp_path / "rec"), "--",
         PY, str(tmp_path / "job.py")],
        capture_output=True, text=True, timeout=150, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = analyze_limited(tmp_path / "rec" / "shared-frame")
    assert got.returncode == 0, got.stderr
    verdict = got.json()["verdict"]
    assert verdict["kind"] == "healthy"


# --- frtools dump --------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_dump_of_a_job_folder_with_planted_files(tmp_path: Path) -> None:
    """A FIFO, a /dev/zero link and a header claiming a 1 TiB file in a job folder: the
    dump hung, copied /dev/zero without end, or wrote a 1 TiB sparse file. Now each is
    refused for its rank, and every copy is no larger than what was read."""
    job = tmp_path / "root" / "job"
    job.mkdir(parents=True)
    os.mkfifo(job / "rank_0.frt")
    (job / "rank_1.frt").symlink_to("/dev/zero")
    box = snapshot(
        identity={"rank": 2, "world_size": 4, "backend": "gloo", "pid": 2**22 + 7},
        groups=[("0", "default_pg", "0-3")],
        entries=[{"op": "gloo:all_reduce"}],
        file_bytes=1 << 40,
    )
    (job / "rank_2.frt").write_bytes(box)
    os.mkfifo(job / "rank_2.stacks")
    (job / "rank_3.frt").write_bytes(b"garbage " * 100)
    (job / "rank_3.stacks").symlink_to("/dev/zero")
    out = tmp_path / "out"
    got = run_limited(
        [PY, "-m", "frtools", "dump", "job", "--dir", str(job.parent), "-o", str(out),
         "--timeout", "2"],
        timeout=20, file_size=64 << 20,
    )  # fmt: skip
    assert got.returncode == 0, f"rc={got.returncode} after {got.seconds:.1f} s: {got.stderr}"
    assert got.seconds < 15
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    assert sizes["rank_2.frt"] <= len(box)
    assert sizes["rank_3.frt"] == 800  # the garbage, kept for the reader to name
    summaries = {n for n in sizes if n.endswith(".summary")}  # the host's, docs/fleet.md
    devices = {n for n in sizes if n.startswith("device_") and n.endswith(".json")}
    assert len(devices) == 1  # the host's device facts (docs/device-evidence.md)
    assert set(sizes) - summaries - devices == {"rank_2.frt", "rank_3.frt", "manifest.json"}
    assert len(summaries) <= 1 and all(sizes[n] < 64 << 10 for n in summaries)
    ranks = json.loads((out / "manifest.json").read_text())["ranks"]
    assert "FIFO" in ranks["0"]["error"]
    assert "symbolic link" in ranks["1"]["error"]
    assert "rank_2.stacks not collected" in ranks["2"]["note"]
    assert "rank_3.stacks not collected" in ranks["3"]["note"]


class _Dripping(socketserver.BaseRequestHandler):
    """Answers a request with a promised 1,000-byte body, one byte every 0.5 s."""

    def handle(self) -> None:
        self.request.recv(65536)
        try:
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(1000):
                self.request.sendall(b"x")
                time.sleep(0.5)
        except OSError:
            pass


class _Huge(socketserver.BaseRequestHandler):
    """Announces a 1 TiB body, then sends zeros as fast as it can."""

    def handle(self) -> None:
        self.request.recv(65536)
        try:
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n")
            zeros = bytes(1 << 20)
            while True:
                self.request.sendall(zeros)
        except OSError:
            pass


class _Chunked(http.server.BaseHTTPRequestHandler):
    """An endless chunked body: no length announced."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"%x\r\n%s\r\n" % (1 << 20, bytes(1 << 20))
        try:
            while True:
                self.wfile.write(chunk)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def _serve(path: Path, handler: type) -> socketserver.UnixStreamServer:
    server = socketserver.ThreadingUnixStreamServer(str(path), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.timeout(120)
def test_torch_socket_answers_are_bounded_in_time_and_size(tmp_path: Path) -> None:
    """A worker socket dripping a byte every 0.5 s kept ``--timeout 2`` running past 20 s;
    an answer's size was unbounded. Now one deadline bounds every read of the request and
    an answer beyond ``response_bytes`` is refused."""
    servers = [
        _serve(tmp_path / "ws_0.sock", _Dripping),
        _serve(tmp_path / "ws_1.sock", _Huge),
        _serve(tmp_path / "ws_2.sock", _Chunked),
    ]
    try:
        got = run_limited(
            [PY, "-m", "frtools", "dump", "--torch-socket", str(tmp_path / "ws_*.sock"),
             "--timeout", "2", "-o", str(tmp_path / "out")],
            timeout=20,
        )  # fmt: skip
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert got.returncode is not None, f"still running after 20 s: {got.stdout}"
    assert got.seconds < 10, got.seconds
    ranks = json.loads((tmp_path / "out" / "manifest.json").read_text())["ranks"]
    assert "timed out" in ranks["0"]["note"]
    assert "limit response_bytes" in ranks["1"]["note"]
    assert "limit response_bytes" in ranks["2"]["note"] or "timed out" in ranks["2"]["note"]
    assert not any(ranks[r]["files"] for r in ("0", "1", "2"))


@pytest.mark.timeout(60)
def test_torch_pipe_is_written_only_when_it_is_a_fifo(tmp_path: Path) -> None:
    """A regular file planted as a link where rank 0's pipe should be got "1\\n" written
    into it; a regular file planted as rank 1's pipe too."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "pipe_0.pipe").symlink_to(target)
    (tmp_path / "pipe_1.pipe").write_text("not a pipe\n")
    got = run_limited(
        [PY, "-m", "frtools", "dump", "--torch-pipe", str(tmp_path / "pipe_"),
         "--torch-dump-prefix", str(tmp_path / "dump_"), "--timeout", "1",
         "-o", str(tmp_path / "out")],
        timeout=30,
    )  # fmt: skip
    assert got.returncode == 2, got.stderr  # nothing collected
    assert target.read_text() == "keep me\n"
    assert (tmp_path / "pipe_1.pipe").read_text() == "not a pipe\n"
    assert "rank 0: " in got.stdout and "not a FIFO" in got.stdout


@pytest.mark.timeout(60)
def test_planted_torch_dump_file_is_not_taken(tmp_path: Path) -> None:
    """``/tmp/nccl_trace_rank_0`` planted by another user was taken as rank 0's answer.
    Now a dump file counts only when it is a regular file of the user who asked, written
    after the request."""
    if os.getuid() != 0:
        pytest.skip("planting a file of another user needs root")
    prefix, dump_prefix = tmp_path / "pipe_", tmp_path / "nccl_trace_rank_"
    for rank in (0, 1):
        os.mkfifo(f"{prefix}{rank}.pipe")
    planted = Path(f"{dump_prefix}0")
    planted.write_bytes(b"\x80\x04planted")
    os.chown(planted, 65534, 65534)  # nobody's, fresh
    stale = Path(f"{dump_prefix}1")
    stale.write_bytes(b"\x80\x04stale")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # ours, from an hour ago

    def monitor(rank: int) -> None:  # reads the byte, writes nothing (its dump never comes)
        fd = os.open(f"{prefix}{rank}.pipe", os.O_RDONLY)
        os.read(fd, 16)
        os.close(fd)

    readers = [threading.Thread(target=monitor, args=(r,), daemon=True) for r in (0, 1)]
    for t in readers:
        t.start()
    time.sleep(0.2)
    got = run_limited(
        [PY, "-m", "frtools", "dump", "--torch-pipe", str(prefix), "--torch-dump-prefix",
         str(dump_prefix), "--timeout", "2", "-o", str(tmp_path / "out")],
        timeout=30,
    )  # fmt: skip
    for t in readers:
        t.join(timeout=5)
    assert got.returncode == 2, got.stdout + got.stderr  # nothing taken
    assert not (tmp_path / "out" / "rank_0.pkl").exists()
    assert not (tmp_path / "out" / "rank_1.pkl").exists()
    assert "belongs to uid 65534" in got.stdout


# --- all of it at once, and what held up before --------------------------------------------------


@pytest.mark.timeout(180)
def test_analyze_on_the_hostile_directory_stays_within_1_gib_and_30_s(tmp_path: Path) -> None:
    """Every analyzer case above in one directory, with what held up before (code in a
    pickle, deep nesting, a device or a FIFO as a rank file, a header claiming 2**32 slots)
    and one real dump: ``frtools analyze`` finishes under 1 GiB and 30 s, names every
    hostile file with its reason, and analyzes the real dump."""
    valid_dump(tmp_path, 0)
    files = {
        "rank_1.pkl": memo_bomb(),
        "rank_2.pkl": shared_sizes_pickle(),
        "rank_3.pkl": huge_group_pickle(),
        "rank_4.frt.gz": long_strings_snapshot(),
        "rank_5.frt": slots_2_32_snapshot(),
        "rank_6.pkl": deep_pickle(),
        "rank_7.pkl": rank_inside_pickle(),
        **{f"rank_{8 + i}_{name}": data for i, (name, data) in enumerate(code_pickles().items())},
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    gzip_bomb(tmp_path / "rank_11.pkl.gz")
    sparse_snapshot(tmp_path / "rank_12.frt")
    (tmp_path / "rank_13.pkl").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "rank_14.pkl")
    os.mkfifo(tmp_path / "manifest.json")
    (tmp_path / "rank_0.stacks").symlink_to("/dev/zero")
    got = analyze_limited(tmp_path)
    assert got.returncode in (0, 1), f"rc={got.returncode} after {got.seconds:.1f} s: {got.stderr}"
    inputs = {Path(i["path"]).name: i for i in got.json()["inputs"]}
    hostile = set(files) | {"rank_11.pkl.gz", "rank_12.frt", "rank_13.pkl", "rank_14.pkl"}
    for name in hostile - {"rank_3.pkl"}:
        assert inputs[name]["status"] == "error" and inputs[name]["reason"], inputs[name]
    assert inputs["rank_3.pkl"]["status"] in ("ok", "duplicate")  # its group is inferred
    for name in ("manifest.json", "rank_0.stacks"):
        assert inputs[name]["status"] == "error", inputs[name]
    assert "a dump is data, never code" in inputs["rank_8_global_reduce.pkl"]["reason"]
    assert "never code" in inputs["rank_9_inst.pkl"]["reason"]
    assert "never code" in inputs["rank_10_stack_global.pkl"]["reason"]
    assert not Path("/tmp/frtools-pwned").exists()
    assert inputs["rank_0.pkl"]["status"] == "ok"


# --- the estimate both parsers keep ------------------------------------------------------------


def _pickles() -> dict[str, bytes]:
    from hostile import sample_dump_dict

    dump = sample_dump_dict(2)
    return {
        **{p.parent.name: p.read_bytes() for p in sorted(SAMPLES.glob("*/rank_1.pkl"))},
        "protocol 4": pickle.dumps(dump, protocol=4),
        "shared frames": pickle.dumps(
            dict(
                dump,
                entries=[dict(e, frames=dump["entries"][0]["frames"]) for e in dump["entries"]],
            ),
            protocol=2,
        ),
    }


@pytest.mark.timeout(60)
def test_native_parser_keeps_the_estimate_and_expansion_python_computes() -> None:
    """The native parser reads a pickle at exactly the estimate and expansion
    safe_pickle computes, and leaves it to Python one byte or one value below."""
    native = pytest.importorskip("frtools.analyze.readers._frpickle")
    for name, data in _pickles().items():
        need = safe_pickle.scan(data)
        values = safe_pickle.expanded_values(pickle.loads(data))
        assert native.parse(data, need, values) is not None, name
        assert native.parse(data, need - 1, values) is None, name
        assert native.parse(data, need, values - 1) is None, name


@pytest.mark.timeout(60)
def test_estimate_bounds_what_loading_takes() -> None:
    """For every kind of opcode a pickle may repeat, what CPython takes to load it
    (tracemalloc's peak) stays within the estimate the limit is checked against."""
    patterns = {
        "empty dict": b"}", "empty list": b"]", "empty set": b"\x8f", "dict item": b"}K\x01K\x01s",
        "dict from mark": b"(K\x01K\x02d", "str": b"\x8c\x02ab", "bytes": b"C\x02ab",
        "int": b"J\x01\x02\x03\x04", "int2": b"M\x01\x02", "float": b"G?\xf0\x00\x00\x00\x00\x00\x00",
        "tuple": b"M\x01\x02M\x03\x04\x86", "list item": b"]K\x01a", "nested": b"]]a",
        "None": b"N", "memoized dict": b"}\x94",
    }  # fmt: skip
    n = 50_000
    for name, pattern in patterns.items():
        data = b"\x80\x04(" + pattern * n + b"l."
        need = safe_pickle.scan(data)
        tracemalloc.start()
        try:
            obj = safe_pickle.DataUnpickler(io.BytesIO(data)).load()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del obj
        assert peak <= need, f"{name}: {peak} bytes taken, {need} estimated"


@pytest.mark.timeout(120)
def test_frtools_limits_raises_or_lowers_a_limit_and_a_wrong_name_is_one_line() -> None:
    """``FRTOOLS_LIMITS`` reaches the readers of `frtools analyze` (a lowered ``dump_bytes``
    refuses three of four sample dumps, each named with the limit, and the analysis goes on);
    a name that is not a limit stops the command with one line (exit 2)."""
    from frtools import config
    from frtools.formats import limits

    assert config.parse_limits("dump_bytes=1G, parsed_bytes=512MiB gunzip_ratio=1000") == {
        "dump_bytes": 1 << 30, "parsed_bytes": 512 << 20, "gunzip_ratio": 1000,
    }  # fmt: skip
    assert limits.from_environment({"FRTOOLS_LIMITS": "string_bytes=4M"}).string_bytes == 4 << 20
    for wrong in ("dump_byte=1G", "dump_bytes=0", "dump_bytes=lots", "dump_bytes"):
        with pytest.raises(config.ConfigError, match="FRTOOLS_LIMITS"):
            limits.from_environment({"FRTOOLS_LIMITS": wrong})

    def analyze(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "FRTOOLS_LIMITS": value}
        cmd = [PY, "-m", "frtools", "analyze", str(SAMPLES / "missing"), "--format", "json"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    got = analyze("dump_bytes=2700")  # rank_1.pkl: 2,663 bytes; the others 2,787
    assert got.returncode == 1, got.stderr
    inputs = {Path(i["path"]).name: i for i in json.loads(got.stdout)["inputs"]}
    assert inputs["rank_1.pkl"]["status"] == "ok"
    for name in ("rank_0.pkl", "rank_2.pkl", "rank_3.pkl"):
        assert inputs[name]["status"] == "error"
        assert "(limit dump_bytes = 2.6 KiB); refused" in inputs[name]["reason"]
    got = analyze("dump_byte=1G")
    assert got.returncode == 2
    assert got.stdout == ""
    assert got.stderr.count("\n") == 1 and "FRTOOLS_LIMITS: not a limit: dump_byte" in got.stderr


# --- issue #20: outputs, history, `frtools dump -o`, strings, claimed world sizes -------------


def _no_steering(text: str, where: str) -> None:
    """No line a CI runner would read as a workflow command, no escape byte."""
    commands = [x for x in text.splitlines() if x.lstrip().startswith("::")]
    assert commands == [], f"{where}: {commands}"
    assert "\x1b" not in text and "\x07" not in text, f"{where}: {text!r}"


@pytest.mark.timeout(180)
def test_dump_strings_cannot_steer_the_terminal_a_ci_log_or_the_summary(tmp_path: Path) -> None:
    """A group described as newlines + ``::add-mask::`` + escape sequences + rich markup +
    a markdown heading and an HTML comment: before, the terminal report, the stderr line of
    `report` and `timeline` and the markdown summary carried them as they were (32 and 10
    workflow-command lines in a CI log). Now each output shows them as text."""
    dumps = steering_dumps(tmp_path / "dumps")
    shown = []
    for args in (
        ["analyze", str(dumps)],
        ["analyze", str(dumps), "-v", "-o", str(tmp_path / "report.txt")],
        ["report", str(dumps), "-o", str(tmp_path / "r.html")],
        ["timeline", str(dumps), "-o", str(tmp_path / "t.json")],
    ):
        got = run_limited([PY, "-m", "frtools", *args], timeout=90)
        assert got.returncode == 1, f"{args}: rc={got.returncode} {got.stderr[-2000:]}"
        _no_steering(got.stdout + got.stderr, args[0])
        shown.append(got.stdout + got.stderr)
    text = (tmp_path / "report.txt").read_text()
    _no_steering(text, "analyze -o")
    assert "\\n::add-mask::hunter2\\n" in text and "\\x1b]0;pwned\\x07" in text
    assert "[red]red[/red]" in text  # markup shown, not read
    assert "::add-mask::" in shown[2] and "\\n::add-mask" in shown[2]  # report's stderr line

    got = run_limited([PY, "-m", "frtools", "analyze", str(dumps), "--format", "markdown"])
    md = got.stdout
    _no_steering(md, "markdown")
    headings = [x for x in md.splitlines() if x.startswith("#")]
    assert all(h.startswith(("## ", "### ")) and "injected" not in h for h in headings), headings
    assert "<!--" not in md and "\\<\\!-- hide the rest" in md


@pytest.mark.timeout(120)
def test_history_terminal_view_shows_hostile_names_as_text(tmp_path: Path) -> None:
    """`frtools history` printed job ids and group names raw (escape sequences, markup)."""
    from frtools.formats.incidents import GuiltyRecord, IncidentRecord, record_incident

    catalog = tmp_path / "c.sqlite"
    for n in range(2):
        record_incident(
            catalog,
            IncidentRecord(
                fingerprint=f"f{n}", job_id="job\x1b]0;pwned\x07\n::add-mask::x",
                job_id_source="manifest", path="/d", kind="missing", headline="h",
                verdict_document={}, pg_name="0", pg_desc=STEERING, op="all_reduce",
                guilty=[GuiltyRecord(rank=1, host="node1", device="cuda:0")],
            ),
        )  # fmt: skip
    got = run_limited([PY, "-m", "frtools", "history", str(catalog)], timeout=60)
    assert got.returncode == 0, got.stderr
    _no_steering(got.stdout, "history")
    assert "node1" in got.stdout and "REPEAT" in got.stdout


@pytest.mark.timeout(120)
def test_html_report_runs_its_script_by_hash_not_unsafe_inline(tmp_path: Path) -> None:
    """The CSP allowed 'unsafe-inline' scripts; now only the hash of its own one script."""
    import base64
    import hashlib
    import html
    import re

    out = tmp_path / "r.html"
    got = run_limited(
        [PY, "-m", "frtools", "report", str(SAMPLES / "missing"), "-o", str(out)], timeout=90
    )
    assert got.returncode == 1, got.stderr
    page = out.read_text()
    policy = html.unescape(re.search(r'Content-Security-Policy" content="([^"]+)"', page)[1])
    script = re.search(r"<script>(.*?)</script>", page, re.S)[1]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    scripts = policy.split("script-src", 1)[1].split(";")[0].split()
    assert scripts == [f"'sha256-{digest}'"], policy


@pytest.mark.timeout(180)
def test_a_copied_dump_folder_is_the_same_incident(tmp_path: Path) -> None:
    """The fingerprint was path + mtime: the same dumps analyzed from a copy were a second
    incident, and one hang put a host on the drain list. Now it is the records' content."""
    import shutil

    catalog = tmp_path / "c.sqlite"
    first, copy = tmp_path / "a", tmp_path / "b"
    shutil.copytree(SAMPLES / "missing", first)
    shutil.copytree(SAMPLES / "missing", copy)  # new paths, new mtimes
    for d in (first, copy):
        got = run_limited([PY, "-m", "frtools", "analyze", str(d), "--history", str(catalog)])
        assert got.returncode == 1, got.stderr
    got = run_limited([PY, "-m", "frtools", "history", str(catalog), "--format", "json"])
    doc = got.json()
    assert doc["incidents_in_window"] == 1 and doc["incidents"][0]["analyses"] == 2
    other = tmp_path / "other"  # other records: another incident
    shutil.copytree(SAMPLES / "dead", other)
    run_limited([PY, "-m", "frtools", "analyze", str(other), "--history", str(catalog)])
    got = run_limited([PY, "-m", "frtools", "history", str(catalog), "--format", "json"])
    assert got.json()["incidents_in_window"] == 2


@pytest.mark.timeout(180)
def test_history_hosts_are_validated_and_long_lists_read_whole(tmp_path: Path) -> None:
    """A host named ``x\\n::add-mask::y`` went on the drain list as it was; 200 guilty ranks
    on one host failed `frtools history` for the whole catalog (a cut GROUP_CONCAT parsed as
    ints: "internal error: ValueError")."""
    from frtools.formats.incidents import GuiltyRecord, IncidentRecord, record_incident

    catalog = tmp_path / "c.sqlite"

    def incident(n: int, guilty: list[GuiltyRecord]) -> IncidentRecord:
        return IncidentRecord(
            fingerprint=f"f{n}", job_id=f"j{n}", job_id_source="manifest", path="/d",
            kind="missing", headline="h", verdict_document={}, guilty=guilty,
        )  # fmt: skip

    many = [GuiltyRecord(rank=r, host="node7", device=f"cuda:{r % 8}") for r in range(200)]
    for n in range(2):
        record_incident(catalog, incident(n, many))
        record_incident(catalog, incident(10 + n, [GuiltyRecord(rank=0, host="x\n::add-mask::y")]))
    got = run_limited([PY, "-m", "frtools", "history", str(catalog), "--format", "json"])
    assert got.returncode == 0, got.stderr
    doc = got.json()
    assert [h["host"] for h in doc["drain"]["hosts"]] == ["node7"]
    assert doc["drain"]["hosts"][0]["evidence"][0]["ranks"] == list(range(200))
    got = run_limited([PY, "-m", "frtools", "history", str(catalog)])
    assert got.returncode == 0 and "node7" in got.stdout, got.stderr


@pytest.mark.timeout(300)
def test_history_of_a_catalog_without_its_indexes_is_bounded(tmp_path: Path) -> None:
    """A catalog of 60,000 incidents on 1,000 hosts whose indexes were dropped: `--hosts`
    ran two scans per host (25 s on a 21 MB catalog); now a fixed number of queries, within
    one total deadline, and the next writer puts the indexes back."""
    import sqlite3

    from frtools.formats.incidents import GuiltyRecord, IncidentRecord, record_incident

    catalog = tmp_path / "c.sqlite"
    record_incident(
        catalog,
        IncidentRecord(
            fingerprint="seed", job_id="j", job_id_source="manifest", path="/d",
            kind="missing", headline="h", verdict_document={},
            guilty=[GuiltyRecord(rank=0, host="node0")],
        ),
    )  # fmt: skip
    now = time.time_ns()
    with sqlite3.connect(catalog) as conn:
        conn.executemany(
            "INSERT INTO incidents (id, fingerprint, job_id, job_id_source, path, recorded_ns, "
            "analyzed_ns, kind, headline, frtools_version, verdict_json) "
            "VALUES (?, ?, 'j', 'manifest', '/d', ?, ?, 'missing', 'h', '0', '{}')",
            [(i, f"f{i}", now - i, now - i) for i in range(2, 60_002)],
        )
        conn.executemany(
            "INSERT INTO guilty (incident_id, rank, host) VALUES (?, ?, ?)",
            [(i, r, f"node{i % 1000}") for i in range(2, 60_002) for r in range(2)],
        )
        for index in ("incidents_by_time", "incidents_by_job", "guilty_by_host", "guilty_by_gpu"):
            conn.execute(f"DROP INDEX {index}")
    got = run_limited(
        [PY, "-m", "frtools", "history", str(catalog), "--hosts", "--format", "json"], timeout=60
    )
    assert got.returncode == 0, got.stderr
    assert got.seconds < 15, got.seconds
    assert len(got.json()["hosts"]) == 1000
    record_incident(
        catalog,
        IncidentRecord(
            fingerprint="next", job_id="j", job_id_source="manifest", path="/d", kind="healthy",
            headline="h", verdict_document={},
        ),
    )  # fmt: skip
    with sqlite3.connect(catalog) as conn:
        names = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"guilty_by_host", "incidents_by_time"} <= names


def _job_folder(root: Path) -> Path:
    job = root / "job"
    job.mkdir(parents=True)
    box = job / "rank_0.frt"
    box.write_bytes(valid_snapshot(0, 1))
    box.chmod(0o600)
    (job / "rank_0.stacks").write_text('Thread 0x1 (most recent call first):\n  File "t.py"\n')
    (job / "rank_0.stacks").chmod(0o600)
    return job


@pytest.mark.timeout(120)
def test_dump_output_folder_is_private_and_never_written_through_a_link(tmp_path: Path) -> None:
    """`frtools dump -o DIR` wrote into a 0777 folder another user prepared, through their
    ``rank_0.stacks -> victim`` link, under predictable temp names; copies of 0600 boxes came
    out 0644. Now DIR is created 0700 or must be ours and private (else one line naming it),
    every file is new, 0600, renamed over whatever was planted."""
    job = _job_folder(tmp_path / "root")
    dump = [PY, "-m", "frtools", "dump", "job", "--dir", str(job.parent), "--timeout", "1"]

    out = tmp_path / "fresh"
    got = run_limited([*dump, "-o", str(out)], timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    assert out.stat().st_mode & 0o777 == 0o700
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes
    assert not [n for n in modes if n.endswith(".tmp")]

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (shared / "rank_0.stacks").symlink_to(victim)
    got = run_limited([*dump, "-o", str(shared)], timeout=60)
    assert got.returncode == 2, got.stdout + got.stderr
    assert f"{shared} is writable by other users" in got.stderr
    assert got.stderr.count("\n") == 1, got.stderr
    if os.getuid() == 0:  # another user's folder
        os.chown(shared, 65534, 65534)
        shared.chmod(0o755)
        got = run_limited([*dump, "-o", str(shared)], timeout=60)
        assert got.returncode == 2 and "belongs to another user" in got.stderr, got.stderr

    ours = tmp_path / "ours"  # our own private folder with a link planted earlier
    ours.mkdir(mode=0o700)
    (ours / "rank_0.stacks").symlink_to(victim)
    (ours / "rank_0.frt").symlink_to(victim)
    got = run_limited([*dump, "-o", str(ours)], timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    assert victim.read_text() == "keep me\n"
    assert not (ours / "rank_0.frt").is_symlink() and not (ours / "rank_0.stacks").is_symlink()
    assert (ours / "rank_0.frt").stat().st_mode & 0o777 == 0o600


PLUGIN_TEST = """
import os, pathlib, time

def test_hangs():
    pathlib.Path(os.environ["WHERE"]).write_text(os.environ["FRTOOLS_DIR"])
    time.sleep(30)
"""


@pytest.mark.timeout(120)
def test_pytest_plugin_cleans_its_live_folder_when_the_thread_timeout_ends_the_run(
    tmp_path: Path,
) -> None:
    """pytest-timeout's thread method ends pytest with os._exit: /dev/shm/frtools-pytest-*
    stayed behind. Now the plugin removes it before that; --frtools-dir is created private."""
    pytest.importorskip("pytest_timeout")
    (tmp_path / "test_hang.py").write_text(PLUGIN_TEST)
    where = tmp_path / "live.txt"
    keep = tmp_path / "keep"
    got = run_limited(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--frtools", "--frtools-dir",
         str(keep), "--timeout", "3", "--timeout-method", "thread", "test_hang.py"],
        timeout=90, cwd=tmp_path, env={"WHERE": str(where)}, memory=4 * (1 << 30),
    )  # fmt: skip
    assert got.returncode not in (0, None), got.stdout[-2000:]
    live = Path(where.read_text())
    assert live.name.startswith("frtools-pytest-")
    assert not live.exists(), f"{live} left behind"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path_kind", sorted(PICKLE_PATHS))
def test_lone_surrogates_in_a_dump_are_replaced_not_fatal(tmp_path: Path, path_kind: str) -> None:
    """``\\ud800`` in an op name, a frame and a group: the reader failed the file with
    UnicodeEncodeError. Now the text is kept with U+FFFD in its place, pickle and JSON."""
    import pickle

    from hostile import surrogate_dump

    valid_dump(tmp_path, 1)
    (tmp_path / "rank_0.pkl").write_bytes(pickle.dumps(surrogate_dump(0), protocol=2))
    (tmp_path / "rank_2.json").write_text(json.dumps(surrogate_dump(2)))  # "\\ud800" escapes
    result = _load(tmp_path, path_kind)
    inputs = inputs_by_name(result)
    assert inputs["rank_0.pkl"]["status"] == "ok", inputs["rank_0.pkl"]
    assert inputs["rank_2.json"]["status"] == "ok", inputs["rank_2.json"]
    assert result["ranks"] == [0, 1, 2]
    got = analyze_limited(tmp_path)
    assert got.returncode in (0, 1), got.stderr[-2000:]
    assert "\\ufffd" in got.stdout or "\ufffd" in got.stdout


@pytest.mark.timeout(120)
def test_a_world_size_the_records_cannot_support_is_refused(tmp_path: Path) -> None:
    """A 110-byte manifest saying world_size 1,048,576 beside four small dumps ran past 30 s
    under 1 GiB (every absent rank a guilty entry). Now it is ignored, named with the limit;
    --world-size beyond what the records support is one line, exit 2."""
    for rank in range(4):
        (tmp_path / f"rank_{rank}.pkl").write_bytes(
            (SAMPLES / "missing" / f"rank_{rank}.pkl").read_bytes()
        )
    (tmp_path / "manifest.json").write_text(manifest(1 << 20))
    got = analyze_limited(tmp_path)
    assert got.returncode == 1, f"rc={got.returncode} after {got.seconds:.1f} s: {got.stderr}"
    assert got.seconds < 15, got.seconds
    reason = inputs_by_name(got.json())["manifest.json"]["reason"]
    assert "world_size 1,048,576 is more than 4 rank record(s) can support" in reason
    assert "limit ranks_per_record" in reason and "ignored" in reason
    assert got.json()["ranks"]["expected"] == 4
    (tmp_path / "manifest.json").unlink()
    got = analyze_limited(tmp_path, "--world-size", str(1 << 20))
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
    assert "world size 1,048,576 is more than 4 rank record(s) can support" in got.stderr


@pytest.mark.timeout(120)
def test_a_member_range_the_records_cannot_support_is_not_believed(tmp_path: Path) -> None:
    """A small host summary whose groups list members 0-1048575 (eight such groups in 951
    bytes took 183 s and 2.3 GB): the lists are ignored by name, the groups inferred from
    the records, the verdict in seconds."""
    import struct
    import zlib

    from frtools.formats.summary_packed import MAGIC
    from frtools.synth import synthesize

    synthesize(tmp_path, format="summary", window=16, world_size=8, tp=2, pp=1,
               fault="healthy", seed=0, workers=1)  # fmt: skip
    [path] = tmp_path.glob("*.summary")
    raw = zlib.decompress(path.read_bytes()[len(MAGIC) :])
    (n,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4 : 4 + n])
    for g in header["groups"]:
        g[2] = "0-1048575"
    head = json.dumps(header).encode()
    path.write_bytes(MAGIC + zlib.compress(struct.pack("<I", len(head)) + head + raw[4 + n :]))
    got = analyze_limited(tmp_path)
    assert got.returncode in (0, 1), got.stderr[-2000:]
    assert got.seconds < 15, got.seconds
    reason = inputs_by_name(got.json())[path.name]["reason"]
    assert "member list claims 1,048,576 is more than 8 rank record(s) can support" in reason
    assert got.json()["ranks"]["expected"] == 8
