"""``frtools top``: this host's ranks (or the whole job's, through its store), live."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator

import click
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from frtools.analyze.reporters.escape import terminal
from frtools.collect.live import JobLive, RankLive
from frtools.commands._common import (
    OneLineCommand,
    fail,
    recorder_dir_option,
    run_guarded,
    store_options,
)

PREFIX = "frtools top"


@click.command("top", cls=OneLineCommand)
@click.argument("job", required=False)
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--job-wide",
    is_flag=True,
    help="Every host's ranks through the job's TCPStore (needs --store), read only.",
)
@store_options
@recorder_dir_option
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=1.0,
    show_default=True,
    help="Seconds between two frames.",
)
def top(
    job: str | None,
    once: bool,
    job_wide: bool,
    store_addr: str | None,
    prefix: str | None,
    root: str | None,
    interval: float,
) -> None:
    """Watch the ranks of this host's jobs (or JOB): each rank's current or last op, its
    group and sequence id, its state, the seconds since it last made progress, the
    watchdog's stall flag, and the ranks that lag behind their groups (red). Reads the
    black boxes only: the job is never touched. Quit with q or Ctrl-C.
    """
    if job_wide and not store_addr:
        fail(PREFIX, "error: --job-wide needs --store HOST:PORT (MASTER_ADDR:MASTER_PORT)")
    if store_addr and not job_wide:
        fail(PREFIX, "error: --store goes with --job-wide")
    read = _reader(job, job_wide, store_addr, prefix, root)
    run_guarded(PREFIX, lambda: _once(read) if once else _watch(read, interval))


def _reader(
    job: str | None, job_wide: bool, store_addr: str | None, prefix: str | None, root: str | None
) -> Callable[[], list[JobLive]]:
    from frtools.collect.live import read_jobs

    if not job_wide:
        return lambda: read_jobs(root, job)
    from frtools.collect.jobwide import StoreUnavailable, parse_address
    from frtools.collect.live import connect, read_job_wide

    assert store_addr is not None
    try:
        parse_address(store_addr)
        store = connect(store_addr)
    except (ValueError, StoreUnavailable) as exc:
        fail(PREFIX, f"error: {exc}")

    def read() -> list[JobLive]:
        return [read_job_wide(store, store_addr, prefix=prefix, root=root)]

    return read


def _once(read: Callable[[], list[JobLive]]) -> int:
    jobs = read()
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    if not jobs:
        fail(PREFIX, "error: no recorder files on this host (is the recorder on? FRTOOLS_DIR?)")
    console.print(frame(jobs))
    return 0


def _watch(read: Callable[[], list[JobLive]], interval: float) -> int:
    from rich.live import Live

    console = Console(highlight=False)
    with _keys() as key, Live(frame(read()), console=console, auto_refresh=False) as live:
        while True:
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                if key(left) in ("q", "Q"):
                    return 0
            live.update(frame(read()), refresh=True)
    return 0  # Ctrl-C: the terminal is restored, not an error


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """A function that waits up to N s for one key press (``None``: none). The terminal is
    put in cbreak mode (no echo, no line buffering) and restored on the way out, Ctrl-C
    and errors included; without a terminal it only sleeps."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield lambda s: time.sleep(s)
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)

    def key(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        tty.setcbreak(fd)
        yield key
    except KeyboardInterrupt:
        pass
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def frame(jobs: list[JobLive], now_ns: int | None = None) -> Group:
    """One frame: per job, its state line and a table of its ranks."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    parts: list = []
    for job in jobs:
        parts.append(_headline(job, now_ns))
        if job.ranks:
            parts.append(_table(job, now_ns))
        for rank in sorted(job.ranks):  # in full, below: a path does not fit a column
            if job.ranks[rank].error:
                parts.append(Text(f"  rank {rank}: {terminal(job.ranks[rank].error)}", style="red"))
        for note in job.notes:
            parts.append(Text(f"  {terminal(note)}", style="dim"))
    return Group(*parts)


def _headline(job: JobLive, now_ns: int) -> Text:
    line = Text(f"job {terminal(job.job)}", style="bold")
    hosts = sorted({r.host for r in job.ranks.values() if r.host})
    line.append(f"  {len(job.ranks)} rank(s)")
    if hosts:
        line.append(f" on {terminal(', '.join(hosts[:4]))}{' …' if len(hosts) > 4 else ''}")
    line.append("  ")
    state = job.state
    if state == "stalled":
        since = job.stalled_since_ns
        when = time.strftime("%H:%M:%S", time.localtime(since / 1e9)) if since else "?"
        ago = f" ({(now_ns - since) / 1e9:.0f} s)" if since else ""
        line.append(f"STALLED since {when}{ago}", style="bold yellow")
    elif state == "exited":
        line.append("exited", style="bold red")
    elif state == "unknown":
        line.append("no rank seen yet", style="dim")
    else:
        line.append("running", style="bold green")
    if job.lagging:
        line.append(f"  lagging: {', '.join(map(str, job.lagging))}", style="bold red")
    return line


def _table(job: JobLive, now_ns: int) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for col in ("rank", "host", "op", "group", "seq", "state", "since", "stall", "note"):
        table.add_column(col, justify="right" if col in ("rank", "seq", "since") else "left")
    for rank in sorted(job.ranks):
        table.add_row(*_row(job.ranks[rank], now_ns), style=_style(job.ranks[rank]))
    return table


def _row(r: RankLive, now_ns: int) -> list[str]:
    if r.error:
        return [str(r.rank), "", "", "", "", "unreadable", "", "", "its box: below"]
    since = r.seconds_since_progress(now_ns)
    state = r.state or (r.startup_phase and f"start-up: {r.startup_phase}") or "no op yet"
    if r.alive is False:
        state = f"gone ({r.ending or 'ended'})"
    elif r.pending and r.state:
        state = f"in {r.state}"
    notes = [
        f"lags on group {terminal(g.name)} ({g.behind} op{'s' * (g.behind > 1)} behind)"
        for g in r.lagging[:3]
    ]
    if r.note:
        notes.append(terminal(r.note))
    return [
        str(r.rank),
        terminal(r.host or "?"),
        terminal(r.op or "-"),
        terminal(r.group if r.group is not None else "-"),
        str(r.seq) if r.seq is not None else "-",
        state,
        f"{since:.1f}s" if since is not None else "-",
        "STALLED" if r.stalled and r.alive is not False else "",
        "; ".join(notes),
    ]


def _style(r: RankLive) -> str:
    """Red: lags behind its group (look here first); yellow: waits, flagged stalled."""
    if r.error:
        return "dim"
    if r.lagging:
        return "red"
    return "yellow" if r.stalled and r.alive is not False else ""
