"""``frtools analyze PATH``: read dumps, diagnose, report one Verdict.

Exit codes: 0 healthy, 1 a problem found, 2 unusable input or usage error. Every failure is
one line on stderr; ``FRTOOLS_DEBUG=1`` adds the traceback of an internal error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from frtools.commands._common import (
    OneLineCommand,
    exit_at_once,
    fail,
    first_line,
    load_and_diagnose,
    progress_wanted,
    reading_options,
    run_guarded,
    write_text,
)

FORMATS = ("terminal", "json", "markdown", "github", "junit")


@click.command("analyze", cls=OneLineCommand)
@click.argument("path", type=click.Path(path_type=Path), required=False)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="terminal",
    show_default=True,
    help="Report format: terminal, json (docs/verdict.schema.json), markdown (a CI job "
    "summary), github (workflow-command annotations at the guilty rank's call site; the "
    "markdown summary is appended to $GITHUB_STEP_SUMMARY when set), junit (JUnit XML).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the report to FILE instead of stdout.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show evidence and per-group detail.")
@reading_options
@click.option(
    "--history",
    "catalog",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also record the verdict in this incident catalog (SQLite; default: "
    "$FRTOOLS_HISTORY); `frtools history` ranks the hosts that keep being guilty. A catalog "
    "that cannot take it is a warning, never another exit code.",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="auto",
    default=None,
    metavar="[ADDRESS]",
    help="Fleet analysis on a Ray cluster (default address: auto, the running one): "
    "summarize the records on every node where they lie, diagnose the summaries here. "
    "PATH is then where the records are on each node (default: each node's $FRTOOLS_DIR). "
    "Needs frtools[ray]; see docs/fleet.md.",
)
@click.option("--job", help="With --ray: the job's folder name under each node's PATH.")
@click.option(
    "--pattern",
    help="With --ray: only the record files whose name starts with this prefix (e.g. "
    "nccl_trace_rank_, as TORCH_FR_DUMP_TEMP_FILE ends) or matches this glob.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 3840),
    default=None,
    help="With --ray: the last ops per rank the nodes keep (default: 64).",
)
@click.option(
    "--summaries",
    "summaries_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="With --ray: keep the host summaries in this folder (frtools analyze reads it).",
)
@click.option(
    "--fan-in",
    type=click.IntRange(min=0),
    default=None,
    help="With --ray: host summaries a merge task on the cluster combines, level after level, "
    "until at most this many partials reach the driver (default: 16); 0: every host "
    "summary comes to the driver instead.",
)
def analyze(
    path: Path | None,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None,
    catalog: Path | None,
    ray_address: str | None,
    job: str | None,
    pattern: str | None,
    window: int | None,
    summaries_dir: Path | None,
    fan_in: int | None,
) -> None:
    """Find the hung collective and the guilty rank in the dumps under PATH.

    PATH may mix black boxes, PyTorch Flight Recorder dumps and host summaries
    (``frtools summarize``). Exit code 0: healthy; 1: a problem was found; 2: unusable
    input or usage error.
    """
    if ray_address is None:
        if path is None:
            fail("frtools analyze", "error: Missing argument 'PATH'.")
        if job or pattern or window or summaries_dir or fan_in is not None:
            fail(
                "frtools analyze",
                "error: --job, --pattern, --window, --summaries and --fan-in go with --ray",
            )
    if fan_in == 1:
        fail("frtools analyze", "error: --fan-in must be at least 2 (0: no merging)")
    fleet = (ray_address, job, window, summaries_dir, pattern, fan_in)
    run_guarded(
        "frtools", lambda: _run(path, fmt, output, verbose, workers, world_size, catalog, fleet)
    )


def _run(
    path: Path | None,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None = None,
    catalog: Path | None = None,
    fleet: tuple[Any, ...] = (None,) * 6,  # Ray: address, job, window, summaries, pattern, fan-in
) -> int:
    from frtools.commands._catalog import catalog_for, host_history, record_verdict

    started = time.monotonic()
    catalog = catalog_for(catalog)
    if fleet[0] is not None:
        trace, verdict = _run_on_ray(path, world_size, fmt, *fleet)
    else:
        assert path is not None
        trace, _, verdict = load_and_diagnose(
            "frtools",
            path,
            workers=workers,
            world_size=world_size,
            progress=progress_wanted(path, human=fmt == "terminal"),
        )

    where = path if path is not None else Path.cwd()
    if catalog is not None:  # the repeat-offender rule (docs/actions.md) reads it first
        from frtools.analyze.action import with_history

        verdict.action = with_history(verdict, host_history(catalog, verdict, trace, where))

    if fmt == "json":
        from frtools.analyze.reporters import json_report

        text = json_report.render(verdict)
    elif fmt == "markdown":
        from frtools.analyze.reporters import markdown

        text = markdown.render(verdict, verbose=verbose)
    elif fmt == "github":
        from frtools.analyze.reporters import github, markdown

        text = github.render(verdict)
        try:
            github.append_step_summary(markdown.render(verdict, verbose=verbose))
        except OSError as e:
            click.echo(f"frtools: warning: cannot append to $GITHUB_STEP_SUMMARY: {e}", err=True)
    elif fmt == "junit":
        from frtools.analyze.reporters import junit

        text = junit.render(verdict, name=str(path), time_s=time.monotonic() - started)
    else:
        from frtools.analyze.reporters import terminal

        if output is None:  # rendered as text, so that no line starts a workflow command
            from rich.console import Console

            console = Console()
            width = min(console.width, 100) if sys.stdout.isatty() else 100
            color = console.color_system is not None and not console.no_color
            text = terminal.render(verdict, verbose=verbose, width=width, color=color)
        else:
            text = terminal.render(verdict, verbose=verbose)

    if text is not None:
        write_text("frtools", text, output)
    if catalog is not None:  # after the verdict is out: a failing catalog only warns
        record_verdict(catalog, verdict, trace, where)
    if fleet[0] is None:  # (Ray's own shutdown runs at exit)
        exit_at_once(verdict.exit_code)
    return verdict.exit_code


def _run_on_ray(
    path: Path | None,
    world_size: int | None,
    fmt: str,
    address: str,
    job: str | None,
    window: int | None,
    summaries_dir: Path | None,
    pattern: str | None = None,
    fan_in: int | None = None,
) -> tuple[Any, Any]:
    """The Trace the nodes' summaries make and its verdict."""
    from frtools.analyze.ray_fleet import (
        DEFAULT_FAN_IN,
        NodeReport,
        RayUnavailable,
        analyze_on_ray,
    )
    from frtools.analyze.readers import UnusableInput
    from frtools.formats.summary_packed import DEFAULT_HOST_WINDOW

    chatty = fmt == "terminal" and sys.stderr.isatty()

    def report(r: NodeReport) -> None:
        if r.error:
            click.echo(f"frtools: node {r.node}: {r.error}", err=True)
        elif chatty:
            what = f"{len(r.ranks)} rank(s)" if r.data else r.note
            click.echo(f"  {r.node}: {what} ({r.seconds:.1f} s)", err=True)

    try:
        result = analyze_on_ray(
            address,
            job,
            root=str(path) if path is not None else None,
            window=window or DEFAULT_HOST_WINDOW,
            pattern=pattern,
            summaries_dir=summaries_dir,
            world_size=world_size,
            on_report=report,
            fan_in=DEFAULT_FAN_IN if fan_in is None else (fan_in or None),
        )
    except (RayUnavailable, UnusableInput) as e:
        fail("frtools", f"error: {first_line(e, 'Ray analysis failed')}")
    return result.trace, result.verdict
