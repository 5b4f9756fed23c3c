"""GPU check of collecting PyTorch's own Flight Recorder on torch 2.15's nccl2 engine.

    python tests/gpu/check_fr_nccl2.py            # one GPU: a world-size-1 nccl2 group
    python tests/gpu/check_fr_nccl2.py --ranks 2  # two GPUs

A job without the frtools recorder runs NCCL all-reduces on the default engine (nccl2 on
torch 2.15, recorded by c10d's FlightRecorderHook) under ``worker_main``; ``frtools dump
--torch-socket`` collects it and ``frtools analyze`` must read every rank's nccl2 ops from
the files it wrote. It proves on a GPU what CPU tests cannot: which recorder instance the
hook fills (``fr_trace_json?backend=nccl2``). Under 2 minutes; prints the lines and
``PASS``/``FAIL``, exit code 0 on pass. ``check_collected`` holds the judgement.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def check_collected(out: Path, ranks: int, ops: int) -> list[str]:
    """Problems with what was collected (empty list: good)."""
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(out), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [f"analyze gave no report (exit {proc.returncode}): {proc.stderr[-500:]}"]
    problems = []
    files = sorted(p.name for p in out.glob("rank_*") if p.suffix != ".stacks")
    if report["verdict"]["kind"] != "healthy":
        problems.append(f"verdict {report['verdict']['kind']}: {report['verdict']['headline']}")
    from frtools.analyze.readers import load_trace

    rows = load_trace(out).entries.to_pylist()
    for rank in range(ranks):
        nccl = [r for r in rows if r["rank"] == rank and r["op"] == "all_reduce"]
        if len(nccl) < ops:
            problems.append(f"rank {rank}: {len(nccl)} all_reduce records, expected {ops}")
        names = {r["profiling_name"].split(":")[0] for r in nccl}
        print(f"rank {rank}: recorders {sorted(names)}; files {files}")
    return problems


def worker(sock_dir: str, ops: int, done: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.control_plane import worker_main

    local = int(os.environ["LOCAL_RANK"])
    os.environ["TORCH_WORKER_SERVER_SOCKET"] = f"{sock_dir}/rank_{local}.sock"
    torch.cuda.set_device(local)
    with worker_main():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        x = torch.ones(1 << 20, device="cuda")
        for _ in range(ops):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        Path(done, f"rank_{local}").touch()
        deadline = time.monotonic() + 60
        while not Path(done, "collected").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ops", type=int, default=10)
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.ops, args.worker[1])
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="frtools-gpu-fr-"))
    socks, done, out = tmp / "socks", tmp / "done", tmp / "out"
    socks.mkdir()
    done.mkdir()
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE="2000")
        argv = [sys.executable, __file__, "--worker", str(socks), str(done), "--ops", str(args.ops)]
        procs.append(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True))
    problems: list[str] = []
    deadline = time.monotonic() + 120
    while len(list(done.glob("rank_*"))) < args.ranks and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    dump = subprocess.run(
        [sys.executable, "-m", "frtools", "dump", "--torch-socket", f"{socks}/*.sock", "-o",
         str(out), "--timeout", "20"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    print(dump.stdout.strip())
    (done / "collected").touch()
    for rank, p in enumerate(procs):
        try:
            _, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, stderr = p.communicate()
            problems.append(f"rank {rank}: timed out")
        if p.returncode != 0:
            problems.append(f"rank {rank}: exit {p.returncode}: {stderr.strip()[-1500:]}")
    if dump.returncode != 0:
        problems.append(f"frtools dump exit {dump.returncode}: {dump.stderr[-500:]}")
    else:
        problems += check_collected(out, args.ranks, args.ops)
    for line in problems:
        print(f"  {line}")
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
