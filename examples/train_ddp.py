"""A small DDP training loop on CPU ranks (Gloo) — the recorder's smoke test and demo.

Run it under the recorder, 4 ranks on this machine::

    frtools run --dir /tmp/frt -- torchrun --nproc-per-node 4 examples/train_ddp.py
    frtools analyze /tmp/frt/<job id>

Faults, to see what a black box keeps when a rank goes wrong at ``--fault-step``:
``kill`` (SIGKILL itself), ``exit`` (``os._exit(3)``), ``gil`` (holds the GIL forever in C),
``hang`` (sleeps forever in Python). The other ranks then wait in the next all-reduce until
``--timeout`` seconds (the process group timeout) have passed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fault", choices=["none", "kill", "exit", "gil", "hang"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="process group timeout (s)")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(args.steps):
        if step == args.fault_step and rank == args.fault_rank:
            fault(args.fault)
        x = torch.randn(16, 32)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def fault(kind: str) -> None:
    print(f"fault: {kind} (pid {os.getpid()})", flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(3)
    elif kind == "gil":
        ctypes.PyDLL(None).sleep(600)  # a C call that keeps the GIL
    elif kind == "hang":
        time.sleep(600)


if __name__ == "__main__":
    main()
