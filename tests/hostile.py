"""Hostile inputs (issue #11) and a way to run frtools on them under a memory cap.

Each builder writes one file as a security review reproduced it: a few bytes or kilobytes
that cost today's readers gigabytes, hang them, or make ``frtools dump`` write a terabyte.
``run_limited`` runs a command in a child process whose address space is capped with
``RLIMIT_AS`` (and its file sizes with ``RLIMIT_FSIZE``, so a collector gone wrong cannot
fill the disk), and kills it at a deadline.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from frtools.formats.blackbox import (
    IDENTITY_OFFSET,
    PG_DTYPE,
    SLOT_DTYPE,
    StringTable,
    file_offsets,
    pack_file,
    pack_header,
)

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_dumps" / "healthy"
GIB = 1 << 30
MIB = 1 << 20
# the promise: any file of up to 10 MB is read within this much address space and time
MEMORY_CAP = GIB
TIME_CAP = 30.0


# --- running under a cap -------------------------------------------------------------------


@dataclass
class Limited:
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_limited(
    argv: list[str],
    *,
    memory: int = MEMORY_CAP,
    timeout: float = TIME_CAP,
    file_size: int = 256 * MIB,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Limited:
    """Run ``argv`` with its address space capped at ``memory`` bytes and every file it
    writes at ``file_size``; killed (``returncode`` None) after ``timeout`` seconds."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        preexec_fn=cap,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        rc = None
    return Limited(rc, out, err, time.monotonic() - start)


def analyze_limited(path: Path, *args: str, **kw: object) -> Limited:
    """``frtools analyze PATH --format json`` under the cap."""
    argv = [sys.executable, "-m", "frtools", "analyze", str(path), "--format", "json", *args]
    return run_limited(argv, **kw)  # type: ignore[arg-type]


_LOAD = """
import json, sys
{prelude}
from frtools.analyze.readers import load_trace
trace = load_trace(sys.argv[1])
print(json.dumps({{
    "inputs": [i.to_dict() for i in trace.inputs],
    "world_size": trace.world_size,
    "ranks": sorted(trace.ranks),
    "expected": len(trace.expected_ranks),
}}))
"""
# as if the native parser had not been built (no compiler at install)
NO_NATIVE = "sys.modules['frtools.analyze.readers._frpickle'] = None"


def load_limited(path: Path, *, prelude: str = "", **kw: object) -> Limited:
    """``load_trace(path)`` (the readers, the loader, the side files) in a capped child;
    its stdout is the inputs, world size and ranks as JSON."""
    code = _LOAD.format(prelude=prelude)
    return run_limited([sys.executable, "-c", code, str(path)], **kw)  # type: ignore[arg-type]


def inputs_by_name(result: dict) -> dict[str, dict]:
    return {Path(i["path"]).name: i for i in result["inputs"]}


# --- valid material ------------------------------------------------------------------------


def valid_dump(directory: Path, rank: int = 0) -> Path:
    """A real PyTorch dump (torch 2.13, Gloo) of ``rank``, from sample_dumps/healthy."""
    path = directory / f"rank_{rank}.pkl"
    path.write_bytes((SAMPLE / f"rank_{rank}.pkl").read_bytes())
    return path


def sample_dump_dict(rank: int = 0) -> dict:
    with open(SAMPLE / f"rank_{rank}.pkl", "rb") as f:
        return pickle.load(f)


def snapshot(
    *,
    identity: dict | None = None,
    groups: list[tuple[str, str, str]] = (),  # type: ignore[assignment]
    entries: list[dict] = (),  # type: ignore[assignment]
    capacity: int = 64,
    pg_capacity: int = 16,
    strings: StringTable | None = None,
    strings_bytes: int | None = None,
    **header: int,
) -> bytes:
    """The bytes of a black box: ``groups`` as (name, desc, rank text), ``entries`` as
    slot fields (string fields given as text), laid out as the native black box does;
    ``header`` overrides header fields (``file_bytes=1 << 40``)."""
    table = strings or StringTable()
    ident = json.dumps(identity or {"rank": 0, "world_size": 1, "backend": "gloo"}).encode()
    pgs = np.zeros(len(groups), dtype=PG_DTYPE)
    for i, (name, desc, ranks) in enumerate(groups):
        pgs[i]["name"], pgs[i]["desc"] = table.id(name), table.id(desc)
        pgs[i]["ranks"] = table.id(ranks)
    ring = np.zeros(capacity, dtype=SLOT_DTYPE)
    for rid, entry in enumerate(entries):
        slot = ring[rid % capacity]
        slot["seq"], slot["record_id"], slot["state"] = 2, rid, entry.get("state", 3)
        slot["pg"], slot["peer"], slot["duration_ms"] = entry.get("pg", 0), -1, np.nan
        slot["collective_seq_id"] = entry.get("seq", rid + 1)
        slot["time_created_ns"] = 1_700_000_000_000_000_000 + rid
        for key in ("op", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes"):
            slot[key] = table.id(entry.get(key, ""))
        slot["stack"] = table.id(entry.get("stack", ""))
        ring[rid % capacity] = slot
    pg_offset, slots_offset, strings_offset = file_offsets(capacity, pg_capacity)
    area = strings_bytes if strings_bytes is not None else len(table.buf) + 64
    fields = dict(
        capacity=capacity,
        pg_capacity=pg_capacity,
        pg_offset=pg_offset,
        slots_offset=slots_offset,
        strings_offset=strings_offset,
        strings_bytes=area,
        file_bytes=strings_offset + area,
        next_record_id=len(entries),
        strings_used=len(table.buf),
        pg_count=len(groups),
        identity_bytes=len(ident),
    )
    fields.update(header)
    size = strings_offset + max(area, len(table.buf))
    return pack_file(size, identity=ident, pgs=pgs, ring=ring, strings=bytes(table.buf), **fields)


def valid_snapshot(rank: int = 0, world: int = 1) -> bytes:
    return snapshot(
        identity={"rank": rank, "world_size": world, "backend": "gloo"},
        groups=[("0", "default_pg", f"0-{world - 1}" if world > 1 else "0")],
        entries=[{"op": "gloo:all_reduce", "stack": "/job/train.py:7 in step"}],
    )


# --- the review's cases: analyzer ---------------------------------------------------------


def memo_bomb() -> bytes:
    """9 bytes: an empty list memoized at index 2**27 (CPython's unpickler sizes its memo
    array from the index: 2**28 pointers, 2 GB)."""
    data = b"\x80\x02]r" + struct.pack("<I", 1 << 27) + b"."
    assert len(data) == 9
    return data


def shared_sizes_pickle() -> bytes:
    """~60 KB: one entry whose ``input_sizes`` refers to one 15,000-int list 15,000 times
    through the memo; rendered as text it is 15,000 x 15,000 numbers (gigabytes)."""
    dump = sample_dump_dict(0)
    big = [0] * 15_000
    entry = dict(dump["entries"][0], input_sizes=[big] * 15_000)
    dump["entries"] = [entry]
    return pickle.dumps(dump, protocol=2)


def gzip_bomb(path: Path, size: int = GIB) -> Path:
    """About 1 MB of gzip holding ``size`` bytes of zeros: one gzip member of 16 MiB of
    zeros, repeated (a gzip file may hold many; compressing 1 GiB once took 5 s of CPU)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    member = comp.compress(bytes(16 * MIB)) + comp.flush()
    with open(path, "wb") as f:
        f.write(member * (size // (16 * MIB)))
    return path


def sparse_snapshot(path: Path, slots: int = 1 << 23) -> Path:
    """A black box claiming ``slots`` slots (2**23: 1 GiB of ring), all holes on disk."""
    pg_offset, slots_offset, strings_offset = file_offsets(slots, 16)
    ident = json.dumps({"rank": 0, "world_size": 1, "backend": "gloo"}).encode()
    head = pack_header(
        capacity=slots,
        pg_capacity=16,
        pg_offset=pg_offset,
        slots_offset=slots_offset,
        strings_offset=strings_offset,
        strings_bytes=4096,
        file_bytes=strings_offset + 4096,
        strings_used=8,
        identity_bytes=len(ident),
    )
    with open(path, "wb") as f:
        f.write(head)
        f.seek(IDENTITY_OFFSET)
        f.write(ident)
        f.truncate(strings_offset + 4096)
    return path


def long_strings_snapshot(n: int = 1024, length: int = MIB) -> bytes:
    """A gzip'd black box of a few KB whose ``n`` slots each name a different string id
    whose entry claims ``length`` bytes (the entries overlap inside one zero-filled area):
    decoded, ``n`` MiB of text."""
    area = length + 8 + 4 * n + 64
    table = StringTable()
    buf = bytearray(area)
    ids = []
    for k in range(n):
        sid = 8 + 4 * k
        struct.pack_into("<I", buf, sid, length)
        ids.append(sid)
    table.buf = buf
    data = bytearray(snapshot(capacity=n, strings=table, strings_bytes=area))
    _, slots_offset, _ = file_offsets(n, 16)
    ring = np.frombuffer(data, dtype=SLOT_DTYPE, count=n, offset=slots_offset).copy()
    ring["seq"], ring["record_id"], ring["state"] = 2, np.arange(n), 3
    ring["op"] = ids
    ring["stack"] = ids
    ring["peer"], ring["duration_ms"] = -1, np.nan
    data[slots_offset : slots_offset + ring.nbytes] = ring.tobytes()
    return gzip.compress(bytes(data), 9)


def huge_group_pickle() -> bytes:
    """A dump whose default group lists ranks "[0, 4000000000]" (set(range(...)) once)."""
    dump = sample_dump_dict(0)
    for cfg in dump["pg_config"].values():
        cfg["ranks"] = "[0, 4000000000]"
    dump["pg_config"]["0"] = {"name": "0", "desc": "default_pg", "ranks": "[0, 4000000000]"}
    return pickle.dumps(dump, protocol=2)


def rank_inside_pickle(rank: int = 2_000_000_000) -> bytes:
    dump = sample_dump_dict(0)
    dump["rank"] = rank
    return pickle.dumps(dump, protocol=2)


def manifest(world_size: int) -> str:
    return json.dumps(
        {"kind": "frtools-dump-manifest", "manifest_version": 1, "mode": "local",
         "world_size": world_size, "ranks": {}, "ranks_gone": [], "ranks_no_answer": []}
    )  # fmt: skip


# --- what held up and must keep holding ----------------------------------------------------


def code_pickles() -> dict[str, bytes]:
    """Pickles that would run code: GLOBAL + REDUCE, INST, STACK_GLOBAL."""
    return {
        "global_reduce.pkl": b"cos\nsystem\n(S'touch /tmp/frtools-pwned'\ntR.",
        "inst.pkl": b"(S'touch /tmp/frtools-pwned'\nios\nsystem\n.",
        "stack_global.pkl": b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x05true \x85R.",
    }


def deep_pickle(depth: int = 100_000) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def slots_2_32_snapshot() -> bytes:
    """A header claiming 2**32 - 1 slots (the file is only its header)."""
    pg_offset, slots_offset, strings_offset = file_offsets(0xFFFFFFFF, 16)
    return pack_header(
        capacity=0xFFFFFFFF,
        pg_capacity=16,
        pg_offset=pg_offset,
        slots_offset=slots_offset,
        strings_offset=strings_offset,
    ) + bytes(4096)


# --- the second review's cases (issue #20) ---------------------------------------------------

# a group description that would steer a terminal, a CI log and a markdown summary
STEERING = (
    "x\n::add-mask::hunter2\n::set-output name=x::y\x1b]0;pwned\x07\x1b[2J[red]red[/red]"
    "\n# injected heading <!-- hide the rest"
)


def steering_dumps(directory: Path) -> Path:
    """sample_dumps/missing (rank 1 never issued all_reduce #3) with every entry's group
    described as ``STEERING``."""
    directory.mkdir(parents=True, exist_ok=True)
    for src in sorted((REPO / "sample_dumps" / "missing").glob("rank_*.pkl")):
        with open(src, "rb") as f:
            dump = pickle.load(f)
        for entry in dump["entries"]:
            entry["process_group"] = (entry["process_group"][0], STEERING)
        (directory / src.name).write_bytes(pickle.dumps(dump, protocol=2))
    return directory


def surrogate_dump(rank: int = 0) -> dict:
    """A real dump whose op name, a frame and a group description hold lone surrogates."""
    dump = sample_dump_dict(rank)
    entry = dump["entries"][0]
    entry["profiling_name"] = "gloo:all_reduce\ud800"
    entry["frames"][0]["name"] = "step\udcff"
    entry["process_group"] = (entry["process_group"][0], "default_pg\ud800")
    return dump
