"""A small training-like job on Gloo that hangs on purpose: the job behind ``frtools demo``
(and the tests of ``frtools dump``).

Every rank runs a few steps of "forward, all-reduce the gradients"; at ``--hang-step`` the
``--fault-rank`` misbehaves while the others go on into the next all-reduce and wait:

* ``compute`` — stuck in its own compute loop (a bug in user code);
* ``gil`` — a C call that holds the GIL forever (``sleep`` through ``ctypes.PyDLL``);
* ``kill`` — SIGKILLs itself (an OOM kill, a node failure);
* ``none`` — no fault: the job finishes.

When a rank reaches its final position it touches ``<marker-dir>/rank_<R>.ready`` so a
caller knows the hang is in place without guessing with sleeps. Run as
``python -m frtools.commands.demo_job`` with the usual RANK / WORLD_SIZE / MASTER_* variables.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import frtools.recorder as recorder


def _mark(marker_dir: str | None, rank: int) -> None:
    if marker_dir:
        Path(marker_dir).mkdir(parents=True, exist_ok=True)
        (Path(marker_dir) / f"rank_{rank}.ready").touch()


def _wait_for_peers(marker_dir: str | None, world_size: int, timeout: float = 30.0) -> None:
    """Die only once every peer is inside the next all-reduce (their markers exist): a rank
    killed while peers still finish the previous op would take them down with it."""
    if not marker_dir:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(Path(marker_dir).iterdir())) < world_size:
        time.sleep(0.05)
    time.sleep(0.5)


def forward(weight: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return torch.tanh(batch @ weight).sum(dim=0)


def compute_forever(weight: torch.Tensor) -> None:
    """The injected bug: a data-dependent loop that never ends."""
    x = torch.ones(64, 64)
    while True:
        x = torch.tanh(x @ weight[:64, :64])


def hold_gil_forever() -> None:
    """A C call made through PyDLL keeps the GIL: no Python thread of this process runs."""
    import ctypes

    ctypes.PyDLL(None).sleep(600)


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    for step in range(args.steps):
        grad = forward(weight, torch.randn(16, 64))
        if step == args.hang_step and rank == args.fault_rank and args.fault != "none":
            _mark(args.marker_dir, rank)
            if args.fault == "compute":
                compute_forever(weight)
            elif args.fault == "gil":
                hold_gil_forever()
            elif args.fault == "kill":
                _wait_for_peers(args.marker_dir, dist.get_world_size())
                os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hang_step and args.fault != "none":
            _mark(args.marker_dir, rank)
        dist.all_reduce(grad)
        weight -= 0.01 * grad.unsqueeze(0) / dist.get_world_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("compute", "gil", "kill", "none"), default="compute")
    parser.add_argument("--fault-rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hang-step", type=int, default=3)
    parser.add_argument("--marker-dir", default=None)
    parser.add_argument("--pg-timeout", type=float, default=300.0)
    parser.add_argument("--no-record", action="store_true", help="run without the recorder")
    parser.add_argument(
        "--torch-socket-dir",
        default=None,
        help="also serve PyTorch's worker-server handlers on <dir>/rank_<R>.sock "
        "(TORCH_WORKER_SERVER_SOCKET under worker_main)",
    )
    args = parser.parse_args(argv)
    if args.torch_socket_dir:
        from torch.distributed.elastic.control_plane import worker_main

        Path(args.torch_socket_dir).mkdir(parents=True, exist_ok=True)
        sock = Path(args.torch_socket_dir) / f"rank_{os.environ.get('RANK', '0')}.sock"
        os.environ["TORCH_WORKER_SERVER_SOCKET"] = str(sock)
        with worker_main():
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    if not args.no_record:
        recorder.enable()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    if not args.no_record:
        # answer `frtools dump --job-wide` from the first step on, not within 0.2 s
        recorder.start_job_wide_watcher()
    train(args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
