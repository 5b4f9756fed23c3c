"""``frtools dump``: collect a job's flight records and stacks into one directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from frtools.analyze.reporters import escape
from frtools.analyze.reporters.escape import markup
from frtools.config import DEFAULT_DIR, DEFAULT_STORE_PREFIX, DIR, ConfigError
from frtools.formats import limits
from frtools.formats.manifest import Manifest
from frtools.formats.private_files import Unsafe, own_folder, write_new

_err = Console(stderr=True, highlight=False)


def _fail(message: str) -> None:
    _err.print(f"[red]frtools dump: {message}[/red]", soft_wrap=True)
    raise SystemExit(2)


def _own_out(out: Path) -> Path:
    """The output folder, created 0700 or checked to be ours and private (docs/security.md);
    a one-line error naming it otherwise."""
    try:
        return own_folder(out)
    except OSError as exc:
        _fail(escape.markup(exc if isinstance(exc, Unsafe) else f"{out}: {exc.strerror or exc}"))
    raise AssertionError("unreachable")


def _default_out(name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return Path(f"frtools-dump-{safe}-{time.strftime('%Y%m%d-%H%M%S')}")


def print_summary(console: Console, manifest: Manifest, out: Path) -> None:
    """The one-screen answer of a collection: who answered, who is gone, what next."""
    found, gone, silent = manifest.ranks_found, manifest.ranks_gone, manifest.ranks_no_answer
    head = (
        f"[bold]{markup(manifest.job_id)}[/bold]: {len(found)} rank file(s) collected into "
        f"{markup(out)}"
    )
    console.print(head)
    table = Table(show_edge=False, pad_edge=False, box=None)
    for col in ("rank", "host", "pid", "status", "files"):
        table.add_column(col)
    for rank in sorted(manifest.ranks):
        e = manifest.ranks[rank]
        if e.error:
            status = "[red]unreadable[/red]"
        elif e.answered:
            status = "[green]answered[/green]"
        elif e.alive is False:
            status = "[red]process gone[/red]"
        else:
            status = "[yellow]no answer[/yellow]"
        table.add_row(
            str(rank), markup(e.host or "?"), str(e.pid or "?"), status,
            markup(", ".join(e.files) or "-"),
        )  # fmt: skip
    if manifest.ranks:
        console.print(table)
    if gone:
        console.print(f"[red]process gone:[/red] ranks {', '.join(map(str, gone))}")
    if silent:
        console.print(f"[yellow]did not answer:[/yellow] ranks {', '.join(map(str, silent))}")
    for rank in sorted(manifest.ranks):
        note = manifest.ranks[rank].note
        if note and (not manifest.ranks[rank].answered or "no stacks" in note):
            console.print(f"  rank {rank}: {markup(note)}", soft_wrap=True)
    for rank in sorted(manifest.ranks):
        if manifest.ranks[rank].error:
            _err.print(
                f"[red]frtools dump: {markup(manifest.ranks[rank].error)}[/red]",
                soft_wrap=True,
            )
    for note in manifest.notes:
        console.print(f"note: {markup(note)}", soft_wrap=True)
    console.print(f"next: [bold]frtools analyze {markup(out)}[/bold]")


@click.command("dump")
@click.argument("job", required=False)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(file_okay=False),
    help="Directory to write into (default: ./frtools-dump-<job>-<time>).",
)
@click.option(
    "--timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds to wait for live ranks to answer, all ranks together.",
)
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    help=f"Where the recorder writes (default: $FRTOOLS_DIR or {DEFAULT_DIR}, this user's own).",
)
@click.option(
    "--job-wide",
    is_flag=True,
    help="Ask every rank on every host through the job's TCPStore (needs --store). Ranks write into "
    "their own FRTOOLS_DUMP_DIR; what this user can read of it is copied into -o (across hosts: "
    "the same FRTOOLS_DUMP_DIR on a shared file system, for the job and for this command).",
)
@click.option(
    "--store",
    "store_addr",
    metavar="HOST:PORT",
    help="The job's TCPStore (MASTER_ADDR:MASTER_PORT under torchrun).",
)
@click.option(
    "--prefix",
    default=None,
    help=f"Key prefix in the store (default: $FRTOOLS_STORE_PREFIX or {DEFAULT_STORE_PREFIX!r}).",
)
@click.option(
    "--torch-socket",
    "torch_sockets",
    multiple=True,
    metavar="GLOB",
    help="PyTorch FR only: worker-server unix sockets (TORCH_WORKER_SERVER_SOCKET), rank = last number in the name.",
)
@click.option(
    "--torch-store",
    "torch_store",
    metavar="HOST:PORT",
    help="PyTorch FR only: ranks' torch.distributed.debug servers, found in this store.",
)
@click.option(
    "--torch-pipe",
    "torch_pipe",
    metavar="PREFIX",
    help="PyTorch FR only (NCCL): the TORCH_NCCL_DEBUG_INFO_PIPE_FILE prefix.",
)
@click.option(
    "--torch-dump-prefix",
    default=None,
    metavar="PREFIX",
    help="With --torch-pipe: where NCCL writes dumps (default: $TORCH_NCCL_DEBUG_INFO_TEMP_FILE or /tmp/nccl_trace_rank_).",
)
@click.option(
    "--summary/--no-summary",
    default=True,
    show_default=True,
    help="Also write this host's summary (<host>.summary, docs/fleet.md) beside the records.",
)
def dump(
    job: str | None,
    output: str | None,
    timeout: float,
    root: str | None,
    job_wide: bool,
    store_addr: str | None,
    prefix: str | None,
    torch_sockets: tuple[str, ...],
    torch_store: str | None,
    torch_pipe: str | None,
    torch_dump_prefix: str | None,
    summary: bool,
) -> None:
    """Collect a job's flight records and Python stacks into one directory.

    \b
    frtools dump [JOB] -o DIR                     this host's ranks (live or dead)
    frtools dump --job-wide [JOB] --store H:P -o DIR    every rank, through the job's store
    frtools dump --torch-socket '/tmp/ws_*.sock' -o DIR   PyTorch's own recorder
    """
    console = Console(highlight=False)
    if timeout <= 0:
        _fail("--timeout must be positive")
    try:
        limits.current()  # FRTOOLS_LIMITS, read once: a bad value is a usage error
    except ConfigError as exc:
        _fail(str(exc))
    modes = sum(bool(x) for x in (job_wide, torch_sockets, torch_store, torch_pipe))
    if modes > 1:
        _fail("choose one of --job-wide, --torch-socket, --torch-store, --torch-pipe")

    if job_wide or torch_sockets or torch_store or torch_pipe:
        out = _own_out(Path(output) if output else _default_out("job"))
        manifest = _collect_remote(
            job, out, timeout, job_wide, store_addr, prefix, torch_sockets, torch_store,
            torch_pipe, torch_dump_prefix,
        )  # fmt: skip
        if manifest.mode.startswith("torch"):
            manifest.write(out)
        print_summary(console, manifest, out)
        if not manifest.ranks_found:
            raise SystemExit(2)
        return

    from frtools.collect.local import collect_job, find_jobs

    base = Path(root or DIR.read())
    jobs = find_jobs(base)
    if job is not None:
        if job not in jobs:
            known = ", ".join(jobs) or "none"
            _fail(f"no job {job!r} under {base} (jobs found: {known})")
        jobs = {job: jobs[job]}
    if not jobs:
        _fail(f"no recorder files under {base} (is the recorder on? FRTOOLS_DIR set?)")
    if len(jobs) > 1:
        console.print(f"{len(jobs)} jobs under {base}: {', '.join(jobs)}")
    out = _own_out(
        Path(output) if output else _default_out(next(iter(jobs)) if len(jobs) == 1 else "all")
    )
    for job_id, job_dir in jobs.items():
        target = out if len(jobs) == 1 else out / job_id
        try:
            manifest = collect_job(job_dir, target, timeout)
        except OSError as exc:
            why = exc if isinstance(exc, Unsafe) else f"{job_dir}: {exc.strerror or exc}"
            _err.print(f"[red]frtools dump: {markup(why)}[/red]")
            continue
        if summary and manifest.ranks_found:
            _write_host_summary(console, target)
        print_summary(console, manifest, target)


def _write_host_summary(console: Console, out: Path) -> None:
    """``<host>.summary`` beside the collected records: what a fleet analysis ships from
    this host (the analyzer prefers the full records where both are present)."""
    from frtools.analyze.readers import UnusableInput
    from frtools.analyze.summarize import summarize_path
    from frtools.formats.summary_packed import host_file_name

    try:
        result = summarize_path(out, workers=1)
        path = out / host_file_name(result.host)
        write_new(path, result.encode())
    except (UnusableInput, OSError, ValueError) as exc:
        _err.print(f"[yellow]frtools dump: no host summary: {markup(exc)}[/yellow]", soft_wrap=True)
        return
    console.print(f"host summary: {path} ({path.stat().st_size / 1024:.1f} KB)")


def _collect_remote(
    job: str | None,
    out: Path,
    timeout: float,
    job_wide: bool,
    store_addr: str | None,
    prefix: str | None,
    torch_sockets: tuple[str, ...],
    torch_store: str | None,
    torch_pipe: str | None,
    torch_dump_prefix: str | None,
) -> Manifest:
    try:
        if job_wide:
            from frtools.collect.jobwide import StoreUnavailable, dump_job_wide

            if not store_addr:
                store_addr = _store_from_env()
            if not store_addr:
                _fail("--job-wide needs --store HOST:PORT (the job's MASTER_ADDR:MASTER_PORT)")
            try:
                return dump_job_wide(store_addr, out, prefix=prefix, timeout=timeout, job_id=job)
            except StoreUnavailable as exc:
                _fail(str(exc))
        from frtools.collect import torch_fr

        if torch_sockets:
            return torch_fr.collect_sockets(torch_sockets, out, timeout)
        if torch_store:
            from frtools.collect.jobwide import StoreUnavailable

            try:
                return torch_fr.collect_debug_servers(torch_store, out, timeout)
            except StoreUnavailable as exc:
                _fail(str(exc))
        assert torch_pipe is not None
        return torch_fr.collect_pipes(torch_pipe, out, timeout, torch_dump_prefix)
    except ValueError as exc:
        _fail(str(exc))
    raise AssertionError("unreachable")


def _store_from_env() -> str | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None
