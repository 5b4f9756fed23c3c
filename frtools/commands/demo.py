"""``frtools demo``: hang a small local job on purpose, then find the guilty rank.

The whole loop a user runs on a real job, in under a minute on a laptop: a 4-rank Gloo job
with the recorder on (``frtools.commands.demo_job``) gets one rank stuck; the recorder's watchdog
notices the stall and every rank writes its snapshot; ``frtools dump`` collects the black
boxes and stacks; ``frtools analyze`` names the rank and the line. Every process the demo
starts runs in its own session and is killed on the way out, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console

JOB_ID = "frtools-demo"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    world: int, fault: str, fault_rank: int, stall: float, work: Path
) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            FRTOOLS_DIR=str(work / "recorder"),
            FRTOOLS_JOB_ID=JOB_ID,
            FRTOOLS_STALL_SECONDS=f"{stall:g}",
        )
        env.pop("FRTOOLS_DUMP_DIR", None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "frtools.commands.demo_job",
                    "--fault",
                    fault,
                    "--fault-rank",
                    str(fault_rank),
                    "--marker-dir",
                    str(work / "markers"),
                ],  # fmt: skip
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"rank_{rank}.log", "w"),  # noqa: SIM115 - closed by exit
                start_new_session=True,
            )
        )
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _wait(predicate, timeout: float, procs: list[subprocess.Popen]) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if any(p.poll() not in (None, -signal.SIGKILL) and p.returncode != 0 for p in procs):
            return predicate()
        time.sleep(0.1)
    return predicate()


@click.command("demo")
@click.option("--ranks", type=click.IntRange(2, 8), default=4, show_default=True)
@click.option(
    "--fault",
    type=click.Choice(["compute", "gil", "kill"]),
    default="compute",
    show_default=True,
    help="How the faulty rank goes wrong.",
)
@click.option("--fault-rank", type=int, default=2, show_default=True)
@click.option(
    "--stall-seconds",
    type=float,
    default=3.0,
    show_default=True,
    help="FRTOOLS_STALL_SECONDS for the job.",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the job's files in this directory.",
)
def demo(ranks: int, fault: str, fault_rank: int, stall_seconds: float, keep: str | None) -> None:
    """Hang a small local job on purpose and diagnose it (exit code of `frtools analyze`)."""
    console = Console(highlight=False)
    if not 0 <= fault_rank < ranks:
        Console(stderr=True).print(
            f"[red]frtools demo: --fault-rank must be in 0..{ranks - 1}[/red]"
        )
        raise SystemExit(2)
    tmp = None
    if keep:
        work = Path(keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="frtools-demo-")
        work = Path(tmp.name)
    procs: list[subprocess.Popen] = []
    code = 2

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        code = _demo(console, work, ranks, fault, fault_rank, stall_seconds, procs)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping the demo job[/yellow]")
        code = 130
    finally:
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)
        if tmp is not None:
            tmp.cleanup()
    raise SystemExit(code)


_FAULTS = {
    "compute": "gets stuck in its own compute loop",
    "gil": "blocks in a C call that holds the GIL",
    "kill": "is SIGKILLed",
}


def _demo(
    console: Console,
    work: Path,
    ranks: int,
    fault: str,
    fault_rank: int,
    stall: float,
    procs: list[subprocess.Popen],
) -> int:
    from frtools.collect.local import collect_job
    from frtools.commands.dump import print_summary

    t0 = time.monotonic()
    console.print(
        f"[bold]1.[/bold] starting a {ranks}-rank Gloo job with the recorder on; "
        f"rank {fault_rank} {_FAULTS[fault]} at step 3"
    )
    procs.extend(_start(ranks, fault, fault_rank, stall, work))
    markers = work / "markers"
    ready = _wait(lambda: markers.is_dir() and len(list(markers.iterdir())) >= ranks, 90, procs)
    if not ready:
        console.print("[red]frtools demo: the job did not reach the hang; its logs:[/red]")
        for rank in range(ranks):
            log = (work / f"rank_{rank}.log").read_text(errors="replace").strip()
            if log:
                console.print(f"--- rank {rank}\n{log[-1500:]}", markup=False)
        return 2
    console.print(f"   the job is hung ({time.monotonic() - t0:.1f} s)")

    job_dir = work / "recorder" / JOB_ID
    dumps = job_dir / "dumps"
    if fault != "kill" or ranks > 1:
        console.print(
            f"[bold]2.[/bold] waiting for the recorder's watchdog (FRTOOLS_STALL_SECONDS={stall:g})"
        )
        t1 = time.monotonic()
        if _wait(lambda: (dumps / "manifest.json").exists(), stall + 15, procs):
            console.print(
                f"   stall detected after {time.monotonic() - t1:.1f} s; every rank wrote its "
                f"snapshot and stacks to {dumps}"
            )
        else:
            console.print("   [yellow]no stall reported; collecting anyway[/yellow]")

    out = work / "dump"
    console.print(f"[bold]3.[/bold] frtools dump -o {out}")
    manifest = collect_job(job_dir, out, timeout=5.0)
    print_summary(console, manifest, out)

    console.print(f"[bold]4.[/bold] frtools analyze {out}")
    code = _analyze(console, out)
    console.print(f"demo finished in {time.monotonic() - t0:.1f} s; job stopped")
    return code


def _analyze(console: Console, out: Path) -> int:
    """What ``frtools analyze`` prints (the loader applies the dump's manifest and stacks),
    plus where the guilty rank's main thread stands when the report does not show it."""
    from frtools.analyze.diagnose import diagnose
    from frtools.analyze.readers import UnusableInput, load_trace
    from frtools.analyze.reporters import terminal
    from frtools.analyze.reporters.stacks_text import stack_lines
    from frtools.analyze.stacks import stacks_summary

    try:
        trace = load_trace(out)
    except UnusableInput as exc:
        console.print(f"[red]frtools demo: {exc}[/red]")
        return 2
    verdict = diagnose(trace)
    text = terminal.render(verdict, width=100, color=False)
    console.print(terminal.renderable(verdict))
    summary = stacks_summary(trace, verdict.guilty_ranks)
    shown = summary.guilty and str(summary.guilty[0].frames[0]) in text
    if summary.guilty and not shown:
        console.print("[bold]Python stacks[/bold] (from rank_<R>.stacks)")
        for line in stack_lines(summary):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return verdict.exit_code
