"""GPU check of ``dist.shrink_group`` under the recorder (NCCL, torch >= 2.15, 2+ GPUs).

    python tests/gpu/check_shrink_group.py [--ranks N]   # N ranks, one GPU each (default 2)

N ranks run under ``frtools run`` with the recorder on: a few all-reduces on the default
group; then the last rank stops taking part (it sleeps, as a rank that recovery drops), the
others call ``dist.shrink_group([N-1], shrink_flags=SHRINK_ABORT)`` and go on with all-reduces
on the shrunk default group, whose sum must be the survivors'. The black boxes must show the
survivors' all-reduces on a group of exactly the survivors, every one ``completed``.

NCCL refuses two ranks of one communicator on one GPU, so fewer than 2 GPUs is a skip (exit
77). Under 2 minutes. ``check_shrink_records`` holds the judgement and imports on CPU.
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

BEFORE, AFTER = 3, 5
SKIP = 77


def check_shrink_records(job_dir: str | os.PathLike[str], world: int) -> list[str]:
    """Problems in the records of a shrunk job (empty list: good): each survivor's
    all-reduces after the shrink sit on a group of exactly the survivors, all completed."""
    from frtools.analyze.readers.loader import load_trace

    trace = load_trace(job_dir)
    survivors = tuple(range(world - 1))
    shrunk = {n for n, g in trace.process_groups.items() if tuple(g.ranks) == survivors}
    if not shrunk:
        groups = {n: list(g.ranks) for n, g in trace.process_groups.items()}
        return [f"no process group of exactly the survivors {list(survivors)}: {groups}"]
    e = trace.entries.to_pandas()
    problems = []
    for rank in survivors:
        mine = e[(e["rank"] == rank) & (e["op"] == "all_reduce") & e["pg_name"].isin(shrunk)]
        if len(mine) < AFTER:
            problems.append(f"rank {rank}: {len(mine)} all_reduce on the shrunk group, not {AFTER}")
        elif set(mine["state"]) != {"completed"}:
            problems.append(f"rank {rank}: states on the shrunk group {set(mine['state'])}")
    return problems


def worker(ranks: int) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    x = torch.ones(1 << 16, device=device)
    for _ in range(BEFORE):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == ranks - 1:
        time.sleep(600)  # dropped: never calls shrink_group
        return
    from torch.distributed import distributed_c10d as c10d

    dist.shrink_group([ranks - 1], shrink_flags=c10d.SHRINK_ABORT)
    for _ in range(AFTER):
        y = torch.ones(4, device=device)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        assert int(y[0].item()) == ranks - 1, f"sum {y[0].item()} after the shrink"
    print(f"rank {rank}: SHRUNK to {dist.get_world_size()} rank(s)", flush=True)
    time.sleep(1.0)  # the watchdog marks the last ops completed
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.ranks)
        return 0
    import torch
    import torch.distributed as dist

    if not hasattr(dist, "shrink_group"):
        print(f"SKIP: torch {torch.__version__} has no dist.shrink_group (torch >= 2.15)")
        return SKIP
    if torch.cuda.device_count() < max(2, args.ranks):
        print(f"SKIP: needs {max(2, args.ranks)} GPUs (NCCL: one rank per GPU)")
        return SKIP
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="frtools-shrink-") as tmp:
        procs = []
        for rank in range(args.ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks))
            env.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            argv = [sys.executable, "-m", "frtools", "run", "--dir", tmp, "--job-id", "shrink"]
            argv += ["--", sys.executable, __file__, "--worker", "--ranks", str(args.ranks)]
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    start_new_session=True,
                )
            )  # fmt: skip
        try:
            for rank, p in enumerate(procs[:-1]):
                try:
                    out, err = p.communicate(timeout=90)
                except subprocess.TimeoutExpired:
                    problems.append(f"rank {rank}: timed out")
                    continue
                if p.returncode != 0 or "SHRUNK" not in out:
                    problems.append(f"rank {rank}: exit {p.returncode}: {err.strip()[-1500:]}")
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait(timeout=30)
        if not problems:
            problems += check_shrink_records(Path(tmp) / "shrink", args.ranks)
    print("survivors go on after shrink_group, recorded:", "FAIL" if problems else "ok")
    for line in problems:
        print(f"  {line}")
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
