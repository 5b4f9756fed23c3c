"""A small training-like torch.distributed job with one injectable fault.

Launch it like torchrun would (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
``tests/jobs.py`` does that) on the Gloo backend. Every rank creates the same process groups:

* ``tensor_parallel`` pairs ``[0, 1], [2, 3], ...``
* ``data_parallel`` groups ``[0, 2, ...], [1, 3, ...]`` (ranks with the same TP index)
* the world group (``default_pg``)

and runs ``--steps`` steps of: TP all_reduce (activations), TP all_gather, DP
reduce_scatter + DP all_reduce (gradients), world all_reduce (loss), world broadcast (LR
schedule state from rank 0).

Each rank leaves PyTorch's own Flight Recorder dump in ``OUT/rank_<R>.pkl``: at the end of a
healthy run, on a collective error, or — when the main thread has made no progress for
``--hang-seconds`` (it is blocked in a collective or in "compute") — from a watchdog thread
that writes the dump while the main thread is still blocked and then ends the process.

Faults (``--fault``, injected on rank ``--rank`` at step ``--fault-step``):

* ``skip``    rank R skips the TP all_reduce.
* ``compute`` rank R hangs in compute (``time.sleep``) before the world loss all_reduce
  (``--fault-at forward``: before the step's first TP collective, so that its TP peer waits
  for it, its DP peer too, and the other DP group waits for the TP peer: a chain of victims).
* ``exit``    rank R dies at the same places (no dump; peers block: ``die_keeping_sockets``).
* ``order``   rank R issues the world loss all_reduce before the DP gradient all_reduce,
  its peers the other way round: a cross-group deadlock between R and its DP peer.
* ``size``    rank R passes a larger buffer to the world broadcast. Gloo completes it
  silently when the receiver's buffer is larger (a smaller one aborts the process).
* ``op``      rank R calls broadcast where its peers call the world loss all_reduce.
* ``late``    rank R sleeps ``--late-ms`` before every collective; the job completes.
* ``none``    healthy.
"""

from __future__ import annotations

import os

# The Flight Recorder reads its buffer size when the first process group is created;
# set it before torch is imported so that an importer's own setting is respected.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

FAULTS = ("none", "skip", "compute", "exit", "order", "size", "op", "late")

EXIT_OK = 0
EXIT_DIED = 1  # the injected ``exit`` fault
EXIT_HUNG = 3  # the watchdog saw no progress and dumped
EXIT_ERROR = 4  # a collective raised (Gloo noticed a dead or mismatched peer)

# Shapes of a tiny transformer-ish model: batch x sequence folded into TOKENS rows.
# Each DP rank owns GRAD_SHARD gradients; the flat gradient is GRAD_SHARD x DP size.
TOKENS, HIDDEN, GRAD_SHARD = 16, 256, 2048


class Progress:
    """The main thread's heartbeat; the watchdog dumps when it stops beating."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def beat(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def idle_seconds(self) -> float:
        with self._lock:
            return time.monotonic() - self._last


def write_dump(out: Path, rank: int, stacks: bool = False) -> Path:
    """Write this rank's Flight Recorder dump atomically: a process killed mid-write leaves
    only a ``.tmp`` file, never a half dump under the final name.

    With ``stacks``, also every thread's Python stack (faulthandler text) to
    ``rank_<R>.stacks``, the side file ``frtools analyze`` reads for where a rank is stuck."""
    data = torch._C._distributed_c10d._dump_fr_trace()
    final = out / f"rank_{rank}.pkl"
    tmp = out / f".rank_{rank}.pkl.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, final)
    if stacks:
        tmp = out / f".rank_{rank}.stacks.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, out / f"rank_{rank}.stacks")
    return final


_dump_lock = threading.Lock()
_finished = threading.Event()  # the healthy end has dumped; the watchdog must not dump again
_write_stacks = False  # --stacks


def dump_and_exit(out: Path, rank: int, code: int, why: str) -> None:
    """Dump once (the watchdog and the main thread may race) and end the process now.

    ``os._exit`` because a rank blocked in a collective can not unwind normally."""
    with _dump_lock:
        if _finished.is_set():  # the healthy end dumped while we waited for the lock
            os._exit(EXIT_OK)
        try:
            path = write_dump(out, rank, _write_stacks)
            print(f"rank {rank}: {why}; flight recorder dump in {path}", file=sys.stderr)
        except Exception as exc:  # the dump is best effort; never hide the exit
            print(f"rank {rank}: {why}; dump failed: {exc}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)


def start_watchdog(progress: Progress, out: Path, rank: int, hang_seconds: float) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.1)
            if progress.idle_seconds() > hang_seconds:
                if _finished.is_set():
                    os._exit(EXIT_OK)
                dump_and_exit(out, rank, EXIT_HUNG, f"no progress for {hang_seconds:g}s")

    threading.Thread(target=watch, name="fr-watchdog", daemon=True).start()


def build_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create every group on every rank, in the same order (``new_group`` is collective)."""
    tp_group = dp_group = None
    for first in range(0, world, 2):
        ranks = [first, first + 1]
        group = dist.new_group(ranks, group_desc="tensor_parallel")
        if rank in ranks:
            tp_group = group
    for tp_index in range(2):
        ranks = list(range(tp_index, world, 2))
        group = dist.new_group(ranks, group_desc="data_parallel")
        if rank in ranks:
            dp_group = group
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--rank", type=int, default=1, help="the faulty rank")
    parser.add_argument("--out", type=Path, required=True, help="dump directory")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--hang-seconds", type=float, default=6.0)
    parser.add_argument("--late-ms", type=float, default=80.0)
    parser.add_argument(
        "--fault-at",
        choices=("loss", "forward"),
        default="loss",
        help="where compute/exit strike: before the world loss all_reduce, or before the "
        "step's first (tensor-parallel) collective",
    )
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="also write every thread's Python stack to OUT/rank_<R>.stacks with the dump",
    )
    args = parser.parse_args(argv)
    global _write_stacks
    _write_stacks = args.stacks

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if world < 4 or world % 2:
        parser.error("WORLD_SIZE must be even and at least 4 (TP pairs x DP groups)")
    args.out.mkdir(parents=True, exist_ok=True)
    faulty = rank == args.rank

    # The collective timeout must not fire before the watchdog has dumped.
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(60.0, 10 * args.hang_seconds)))
    tp_group, dp_group = build_groups(rank, world)
    dp_size = dist.get_world_size(dp_group)

    progress = Progress()
    start_watchdog(progress, args.out, rank, args.hang_seconds)

    @contextlib.contextmanager
    def collective() -> Iterator[None]:
        """Heartbeat around one collective. A context manager, not a wrapper function, so
        that the recorded call site is the training loop's line, not a helper's."""
        if args.fault == "late" and faulty:
            time.sleep(args.late_ms / 1000)
        progress.beat()
        yield
        progress.beat()

    def stall(fault: str) -> None:
        """The ``compute`` and ``exit`` faults: stop issuing collectives here."""
        if fault == "compute":
            progress.beat()
            time.sleep(1000 * args.hang_seconds)  # "stuck in compute"
        if fault == "exit":
            print(f"rank {rank}: exiting mid-training (injected)", file=sys.stderr)
            die_keeping_sockets(linger_s=max(60.0, 10 * args.hang_seconds))  # the pg timeout

    torch.manual_seed(rank)
    weights = torch.randn(GRAD_SHARD * dp_size)
    try:
        for step in range(1, args.steps + 1):
            fault_now = faulty and step == args.fault_step
            fault = args.fault if fault_now else "none"

            # forward: tensor-parallel matmul partial sums, then gather the sharded output
            if args.fault_at == "forward":
                stall(fault)
            activations = torch.randn(TOKENS, HIDDEN)
            if fault != "skip":
                with collective():
                    dist.all_reduce(activations, group=tp_group)
            shard = torch.randn(TOKENS, HIDDEN // 2)
            gathered = [torch.empty_like(shard) for _ in range(2)]
            with collective():
                dist.all_gather(gathered, shard, group=tp_group)

            # backward: data-parallel gradient sync
            grads = torch.randn(GRAD_SHARD * dp_size)
            grad_shard = torch.empty(GRAD_SHARD)
            with collective():
                reduce_scatter(grad_shard, grads, group=dp_group)
            loss = torch.tensor([float(step)])
            if fault == "order":  # the loss before the gradients: peers do it the other way
                with collective():
                    dist.all_reduce(loss)
            with collective():
                dist.all_reduce(grads, group=dp_group)

            # the loss for logging
            if args.fault_at == "loss":
                stall(fault)
            if fault == "op":
                with collective():
                    dist.broadcast(loss, src=0)
            elif fault != "order":
                with collective():
                    dist.all_reduce(loss)

            # optimizer: the LR schedule state from rank 0
            schedule = torch.zeros(16 if fault == "size" else 8)
            with collective():
                dist.broadcast(schedule, src=0)
            weights -= 0.01 * grads
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        dump_and_exit(args.out, rank, EXIT_ERROR, f"collective failed: {first_line[:200]}")
    # Gloo marks a work completed from a callback that may run just after wait() returned;
    # give it a moment so a healthy run's last op does not read as still pending.
    time.sleep(0.2)
    with _dump_lock:
        path = write_dump(args.out, rank, _write_stacks)
        _finished.set()
    print(f"rank {rank}: finished; flight recorder dump in {path}", file=sys.stderr)
    # Leave together: a rank that exits early resets its peers' connections. The barrier
    # comes after the dump, so it is not in it.
    progress.beat()
    with contextlib.suppress(Exception):
        dist.barrier()
    sys.stderr.flush()
    os._exit(EXIT_OK)


def die_keeping_sockets(linger_s: float) -> None:
    """The ``exit`` fault: end this rank's process (status 1, no dump) the way a dead GPU
    rank looks to its NCCL peers, who are not told: they block in their next collective
    with it until a timeout, and their dumps show that collective pending.

    A plain ``os._exit`` is not that on Gloo: the kernel closes the rank's TCP connections,
    Gloo fails the survivors' pending op at once, and sometimes marks it completed/retired
    on every survivor (pg_status too), so the dumps show no pending op at all and a dead
    rank is indistinguishable from one that left after the job (a flaky verdict). So a
    forked child inherits every socket (Gloo pairs, the TCPStore) and idles, reading
    nothing, while this process exits: the survivors block deterministically until their
    watchdogs dump. The child gives its stdio up (so that a launcher reading this rank's
    pipes sees them close with the rank) and ends after ``linger_s`` (the collective
    timeout, when the survivors' Gloo would give up anyway), or earlier when the
    launcher kills the job's process groups (``tests/jobs.py`` does). Never returns.

    (Defined after ``main`` and importing locally: line numbers above stay put, the
    committed ``sample_dumps/missing-stacks`` stacks name ``faulty_job.py:212``.)"""
    import warnings

    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # 3.12+: fork() of a multi-threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: only this thread exists; touch no lock, no torch
        try:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            time.sleep(linger_s)
        finally:
            os._exit(0)
    os._exit(EXIT_DIED)


if __name__ == "__main__":
    sys.exit(main())
