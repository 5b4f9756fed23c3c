"""GPU check of one-sided windows (nccl2, torch >= 2.15): put / signal / wait_signal reach the
black box, and a wait_signal whose signal never comes is left incomplete.

    python tests/gpu/check_windows_nccl2.py            # 2 ranks, one GPU each (2 GPUs)
    python tests/gpu/check_windows_nccl2.py --same-gpu # 2 processes on GPU 0 (if NCCL allows)

Two jobs of 2 ranks run under ``frtools run``:

* ``ok``: rank 0 puts a tensor into rank 1's window and signals it, 3 times; rank 1 waits for
  each signal; then a barrier. Every window op must be ``completed``.
* ``hang``: as ``ok``, then rank 0 waits for a signal from rank 1 that rank 1 never sends (it
  sleeps); after the stall is flagged ``frtools analyze`` runs on the live job and its verdict
  is printed (the rule that names rank 1 belongs to the diagnosis), and the records must show
  rank 0's ``window_wait_signal`` for peer 1 incomplete and no ``window_signal`` 1 -> 0.

Under 2 minutes. Prints one line per check and ``PASS``/``FAIL``; exit code 0 on pass.
``check_window_records`` holds the judgement and is exercised on CPU by
tests/test_recorder_hooks.py with a fake window class.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIGNALS = 3


def check_window_records(job_dir: str | os.PathLike[str], hang: bool) -> list[str]:
    """Problems in a 2-rank window job's records (empty list: good)."""
    from frtools.analyze.readers.loader import load_trace

    e = load_trace(job_dir).entries.to_pandas()
    w = e[e["op"].str.startswith("window_")].sort_values(["rank", "record_id"])
    problems = []

    def ops(rank: int, op: str, peer: int):
        return w[(w["rank"] == rank) & (w["op"] == op) & (w["peer"] == peer)]

    expect = {
        (0, "window_put", 1): SIGNALS,
        (0, "window_signal", 1): SIGNALS,
        (1, "window_wait_signal", 0): SIGNALS,
        (0, "window_wait_signal", 1): 1 if hang else 0,
        (1, "window_signal", 0): 0,
    }
    for (rank, op, peer), n in expect.items():
        got = ops(rank, op, peer)
        if len(got) != n:
            problems.append(f"rank {rank}: {len(got)} {op} to/from {peer}, expected {n}")
            continue
        if list(got["p2p_seq_id"]) != list(range(1, n + 1)):
            problems.append(f"rank {rank}: {op} indexes {list(got['p2p_seq_id'])}")
        if not got["pg_name"].str.contains("/window").all():
            problems.append(f"rank {rank}: {op} not on a window's row: {set(got['pg_name'])}")
    for rank, op, peer in [(0, "window_put", 1), (0, "window_signal", 1)]:
        got = ops(rank, op, peer)
        if len(got) and set(got["state"]) != {"completed"}:
            problems.append(f"rank {rank}: {op} states {set(got['state'])}")
    waits = ops(1, "window_wait_signal", 0)
    if len(waits) and set(waits["state"]) != {"completed"}:
        problems.append(f"rank 1: window_wait_signal states {set(waits['state'])}")
    if hang:
        stuck = ops(0, "window_wait_signal", 1)
        if len(stuck) and stuck.iloc[-1]["state"] == "completed":
            problems.append("rank 0: the wait for rank 1's signal completed; it was never sent")
    return problems


def worker(same_gpu: bool, hang: bool) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    print(f"rank {rank}: backend {dist.get_backend()}, windows {dist._supports_window()}")
    buf = torch.zeros(1024, device=device)
    win = dist._new_window(buf)
    src = torch.full((256,), float(rank + 1), device=device)
    for i in range(SIGNALS):
        if rank == 0:
            win.put(src, 1, i * 256, False)
            win.signal(1, False)
        else:
            win.wait_signal(0, False)
    torch.cuda.synchronize()
    dist.barrier()
    if hang:
        if rank == 0:
            work = win.wait_signal(1, True)  # rank 1 never signals
            work.wait()
        else:
            time.sleep(600)
    dist.destroy_process_group()


def run_job(out: Path, job: str, same_gpu: bool, hang: bool) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FRTOOLS_STALL_SECONDS="3")
        argv = [sys.executable, "-m", "frtools", "run", "--dir", str(out), "--job-id", job, "--"]
        argv += [sys.executable, __file__, "--worker", "hang" if hang else "ok"]
        if same_gpu:
            argv.append("--same-gpu")
        procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--same-gpu", action="store_true")
    parser.add_argument("--worker", choices=["ok", "hang"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.same_gpu, args.worker == "hang")
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="frtools-windows-") as tmp:
        out = Path(tmp)
        procs = run_job(out, "ok", args.same_gpu, hang=False)
        codes = [p.wait(timeout=90) for p in procs]
        problems = [f"ok job exit codes {codes}"] if codes != [0, 0] else []
        problems += check_window_records(out / "ok", hang=False)
        print("window ops recorded and completed:", "FAIL" if problems else "ok")
        for p in problems:
            print("  ", p)
        failed |= bool(problems)

        procs = run_job(out, "hang", args.same_gpu, hang=True)
        try:
            time.sleep(20)  # the stall (3 s) is flagged on both ranks by then
            verdict = subprocess.run(
                [sys.executable, "-m", "frtools", "analyze", str(out / "hang")],
                capture_output=True,
                text=True,
                timeout=60,
            )
            print(f"frtools analyze on the hung job (exit {verdict.returncode}):")
            print(verdict.stdout.rstrip())
            problems = check_window_records(out / "hang", hang=True)
        finally:
            stop(procs)
        print("a wait_signal never signalled stays incomplete:", "FAIL" if problems else "ok")
        for p in problems:
            print("  ", p)
        failed |= bool(problems)
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
