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
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="when a collective fails (a peer died), wait this long before exiting, as a "
        "rank stuck in NCCL would",
    )
    parser.add_argument(
        "--extras", action="store_true", help="also a subgroup all-reduce and a P2P ring"
    )
    parser.add_argument(
        "--torch-fr-dump",
        default=None,
        help="at the end, write PyTorch's own Flight Recorder dump to DIR/torch_rank_<R>.pkl "
        "(run with TORCH_FR_BUFFER_SIZE=2000)",
    )
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
        try:
            loss.backward()
        except RuntimeError as exc:
            print(f"rank {rank} step {step}: collective failed: {exc}", flush=True)
            time.sleep(args.linger)
            raise
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    if args.extras:
        world = dist.get_world_size()
        evens = dist.new_group(list(range(0, world, 2)), group_desc="evens")
        odds = dist.new_group(list(range(1, world, 2)), group_desc="odds")
        mine = evens if rank % 2 == 0 else odds
        dist.all_reduce(torch.ones(5), group=mine)
        ring = [
            dist.P2POp(dist.isend, torch.full((3,), float(rank)), (rank + 1) % world),
            dist.P2POp(dist.irecv, torch.empty(3), (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ring):
            work.wait()
    dist.barrier()
    if args.torch_fr_dump:
        from torch._C._distributed_c10d import _dump_fr_trace

        os.makedirs(args.torch_fr_dump, exist_ok=True)
        with open(os.path.join(args.torch_fr_dump, f"torch_rank_{rank}.pkl"), "wb") as f:
            f.write(_dump_fr_trace(includeCollectives=True))
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
