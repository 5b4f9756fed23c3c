"""GPU check of the recorder: NCCL ops reach ``completed`` with a GPU duration from CUDA events.

    python tests/gpu/check_recorder_gpu.py            # one GPU: a world-size-1 NCCL group
    python tests/gpu/check_recorder_gpu.py --ranks 2  # two GPUs: two processes

Under 2 minutes. Prints one line per check and ``PASS``/``FAIL``; exit code 0 on pass.
``check_snapshot`` holds the judgement and is exercised on CPU by
tests/test_recorder_capture.py with the black box's fake CUDA events.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def check_snapshot(path: str | os.PathLike[str], expect_ops: int) -> list[str]:
    """Problems found in one rank's black box after NCCL all-reduces (empty list: good)."""
    from frtools.formats.blackbox import STATE_NAMES, read_snapshot

    snap = read_snapshot(path)
    problems = []
    ops = [snap.string(int(o)) for o in snap.slots["op"]]
    reduces = [i for i, name in enumerate(ops) if name.endswith(":all_reduce")]
    if len(reduces) < expect_ops:
        problems.append(f"{path}: {len(reduces)} all_reduce records, expected {expect_ops}")
    for i in reduces:
        slot = snap.slots[i]
        state = STATE_NAMES[int(slot["state"])]
        rid = int(slot["record_id"])
        if state != "completed":
            problems.append(f"{path}: record {rid} ({ops[i]}) is {state!r}, not completed")
        elif not float(slot["duration_ms"]) > 0:
            problems.append(f"{path}: record {rid} completed without a GPU duration")
        elif int(slot["time_completed_ns"]) < int(slot["time_created_ns"]):
            problems.append(f"{path}: record {rid} completed before it was created")
    device = str(snap.identity.get("device", ""))
    if not device.startswith("cuda"):
        problems.append(f"{path}: identity device is {device!r}, expected cuda:N")
    return problems


def worker(out_dir: str, ops: int) -> None:
    import torch
    import torch.distributed as dist

    import frtools.recorder

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    assert frtools.recorder.enable(dir=out_dir, job_id="gpu", stall_seconds=30)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    x = torch.ones(16 << 20, device="cuda")  # 64 MiB: a measurable kernel
    for _ in range(ops):
        dist.all_reduce(x)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    time.sleep(1.0)  # the watchdog polls events every 50 ms
    print(frtools.recorder.output_path(), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ops", type=int, default=20)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.ops)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="frtools-gpu-")
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", out, "--ops", str(args.ops)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    problems = []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            problems.append(f"rank {rank}: timed out")
        if p.returncode != 0:
            problems.append(f"rank {rank}: exit {p.returncode}: {stderr.strip()[-2000:]}")
        if "recording disabled" in stderr:
            problems.append(f"rank {rank}: {stderr.strip()}")
    for rank in range(args.ranks):
        path = Path(out) / "gpu" / f"rank_{rank}.frt"
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        found = check_snapshot(path, args.ops + 1)
        problems += found
        print(f"rank {rank}: {path}: {'ok' if not found else f'{len(found)} problem(s)'}")
    for line in problems:
        print(f"  {line}")
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
