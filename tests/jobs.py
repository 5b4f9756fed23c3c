"""Launch real multi-process torch.distributed jobs for tests.

Every rank is a plain ``python`` subprocess (lighter than torchrun: one torch import per
rank), started in its own session so that a hung rank and anything it spawned can be killed
as a group. ``run_job`` always returns with every process gone: past ``timeout`` the
survivors are SIGKILLed and reported as ``timed_out``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed by the harness after the timeout
    stdout: str
    stderr: str


@dataclass
class JobResult:
    ranks: list[RankResult] = field(default_factory=list)
    timed_out: list[int] = field(default_factory=list)

    def output(self) -> str:
        return "\n".join(
            f"--- rank {r.rank} rc={r.returncode}\n{r.stdout}\n{r.stderr}" for r in self.ranks
        )


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def rank_env(
    rank: int,
    world_size: int,
    port: int,
    extra: dict[str, str] | None = None,
    local_world_size: int | None = None,
) -> dict[str, str]:
    env = dict(os.environ)
    lws = local_world_size or world_size
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % lws),
        LOCAL_WORLD_SIZE=str(lws),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def start_ranks(
    argv: list[str],
    world_size: int,
    env: dict[str, str] | None = None,
    port: int | None = None,
    cwd: str | Path | None = None,
) -> list[subprocess.Popen]:
    """Start ``world_size`` processes of ``argv``; the caller must ``stop`` them."""
    port = port or free_port()
    procs = []
    for rank in range(world_size):
        procs.append(
            subprocess.Popen(
                argv,
                env=rank_env(rank, world_size, port, env),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_group(p)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> JobResult:
    """Wait for every rank up to ``timeout`` seconds in total, then kill the rest."""
    deadline = time.monotonic() + timeout
    result = JobResult()
    outputs: dict[int, tuple[str, str, int | None]] = {}
    for rank, p in enumerate(procs):
        remaining = max(0.1, deadline - time.monotonic())
        try:
            out, err = p.communicate(timeout=remaining)
            outputs[rank] = (out, err, p.returncode)
        except subprocess.TimeoutExpired:
            kill_group(p)
            out, err = p.communicate()
            outputs[rank] = (out, err, None)
            result.timed_out.append(rank)
    stop(procs)
    for rank in range(len(procs)):
        out, err, rc = outputs[rank]
        result.ranks.append(RankResult(rank, rc, out, err))
    return result


def run_job(
    script: str | Path,
    world_size: int = 4,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: str | Path | None = None,
) -> JobResult:
    """Run ``python script args`` as a ``world_size``-rank job on a free loopback port."""
    argv = [sys.executable, str(script), *(args or [])]
    procs = start_ranks(argv, world_size, env=env, cwd=cwd)
    try:
        return wait_ranks(procs, timeout)
    finally:
        stop(procs)
