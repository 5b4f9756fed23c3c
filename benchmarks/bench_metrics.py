"""What one Prometheus scrape of ``frtools metrics`` costs (issue 21: < 50 ms at 8 ranks × 64
groups, median).

Writes one host's black boxes (default 8 ranks, each in 64 process groups, a full ring of
``FRTOOLS_BUFFER_SIZE`` = 2000 slots; rank 3 stalled in an all_reduce the others never
issued) through the format's own writer pieces (``frtools.formats.blackbox``), starts
``frtools metrics`` on them as a child process and scrapes ``/metrics`` over HTTP as
Prometheus does (OpenMetrics), ``--scrapes`` times. Every scrape reads every box afresh.
Prints one table: the median and 90th percentile wall time per scrape, the exporter's mean
CPU time per scrape (user + system, from /proc: on a loaded machine the wall time also counts
waiting for a core), series and bytes.

    python benchmarks/bench_metrics.py                      # 8 ranks × 64 groups
    python benchmarks/bench_metrics.py --ranks 8,16 --groups 64,256 --scrapes 50
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from frtools.formats.blackbox import (
    PG_DTYPE,
    SLOT_DTYPE,
    StringTable,
    file_offsets,
    pack_file,
)
from frtools.formats.manifest import rank_file_name

T0 = 1_800_000_000_000_000_000
OPS = ("gloo:all_reduce", "gloo:all_gather", "gloo:reduce_scatter", "gloo:broadcast")


def box(rank: int, world: int, groups: int, capacity: int, stalled: int) -> bytes:
    """A rank's box: ``groups`` groups (the world, then sub-groups of 2), ``capacity`` ops
    spread over them, the stalled rank's last op unfinished."""
    table = StringTable()
    pgs = np.zeros(groups, dtype=PG_DTYPE)
    for g in range(groups):
        members = f"0-{world - 1}" if g == 0 else f"{rank},{(rank + g) % world}"
        pgs[g]["name"], pgs[g]["desc"] = table.id(str(g)), table.id("default_pg" if not g else "")
        pgs[g]["ranks"] = table.id(members)
    ring = np.zeros(capacity, dtype=SLOT_DTYPE)
    rid = np.arange(capacity)
    ring["seq"], ring["record_id"], ring["pg"], ring["peer"] = 2, rid, rid % groups, -1
    ring["collective_seq_id"] = rid // groups + 1
    ring["time_created_ns"] = T0 + rid * 1_000_000
    ring["time_completed_ns"] = ring["time_created_ns"] + 500_000
    ring["state"], ring["duration_ms"] = 3, np.nan
    ring["op"] = [table.id(OPS[i % len(OPS)]) for i in range(capacity)]
    ring["stack"] = table.id("/job/train.py:42 in step")
    if rank == stalled:
        ring["state"][-1], ring["time_completed_ns"][-1] = 1, 0
    seqs = np.bincount(ring["pg"], minlength=groups)
    pgs["last_enqueued_collective"] = seqs + (rank == stalled) * (np.arange(groups) == 0)
    pgs["last_completed_collective"] = seqs
    ident = json.dumps(
        {"rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(),
         "job_id": "bench", "backend": "gloo"}
    ).encode()  # fmt: skip
    pg_off, slots_off, strings_off = file_offsets(capacity, groups)
    area = len(table.buf) + 64
    return pack_file(
        strings_off + area, identity=ident, pgs=pgs, ring=ring, strings=bytes(table.buf),
        capacity=capacity, pg_capacity=groups, pg_offset=pg_off, slots_offset=slots_off,
        strings_offset=strings_off, strings_bytes=area, file_bytes=strings_off + area,
        next_record_id=capacity, strings_used=len(table.buf), pg_count=groups,
        identity_bytes=len(ident), created_ns=T0, owner_pid=os.getpid(),
        stalled=int(rank == stalled), stall_record_id=capacity - 1 if rank == stalled else -1,
        stall_time_ns=T0 + capacity * 1_000_000 if rank == stalled else 0,
    )  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc): what a scrape costs the exporter, robust
    on a loaded machine where wall time includes waiting for a core."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks: int, groups: int, capacity: int, scrapes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "bench"
        job.mkdir()
        for r in range(ranks):
            (job / rank_file_name(r)).write_bytes(box(r, ranks, groups, capacity, stalled=3))
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "frtools", "metrics", "--dir", tmp, "--port", str(port)],
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}/metrics"
        request = urllib.request.Request(
            url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(request, timeout=10).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            times, body = [], b""
            cpu0 = cpu_seconds(proc.pid)
            for _ in range(scrapes):
                t0 = time.perf_counter()
                with urllib.request.urlopen(request, timeout=10) as response:
                    body = response.read()
                times.append(time.perf_counter() - t0)
            cpu = (cpu_seconds(proc.pid) - cpu0) / scrapes
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    times.sort()
    return {
        "cpu_ms": cpu * 1e3,
        "ranks": ranks,
        "groups": groups,
        "slots": capacity,
        "series": series,
        "bytes": len(body),
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8", help="comma-separated rank counts")
    ap.add_argument("--groups", default="64", help="comma-separated group counts per rank")
    ap.add_argument("--slots", type=int, default=2000, help="ring slots per rank")
    ap.add_argument("--scrapes", type=int, default=30)
    args = ap.parse_args()
    rows = [
        measure(int(r), int(g), args.slots, args.scrapes)
        for r in args.ranks.split(",")
        for g in args.groups.split(",")
    ]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| ranks | groups/rank | slots/rank | series | bytes | median ms | p90 ms | CPU ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(
            f"| {x['ranks']} | {x['groups']} | {x['slots']} | {x['series']} | {x['bytes']:,} "
            f"| {x['median_ms']:.1f} | {x['p90_ms']:.1f} | {x['cpu_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
