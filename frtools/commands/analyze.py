"""``frtools analyze PATH``: read dumps, diagnose, report one Verdict.

Exit codes: 0 healthy, 1 a problem found, 2 unusable input or usage error. Every failure is
one line on stderr; ``FRTOOLS_DEBUG=1`` adds the traceback of an internal error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from frtools.commands._common import (
    OneLineCommand,
    load_and_diagnose,
    progress_wanted,
    run_guarded,
    write_text,
)

FORMATS = ("terminal", "json", "markdown", "github", "junit")


@click.command("analyze", cls=OneLineCommand)
@click.argument("path", type=click.Path(path_type=Path))
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
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes reading dump files (default: automatic).",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="The job's number of ranks, when the dumps cannot say it (Gloo): a rank that left "
    "no dump is then seen even if it is the highest.",
)
@click.option(
    "--history",
    "catalog",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also record the verdict in this incident catalog (SQLite; default: "
    "$FRTOOLS_HISTORY); `frtools history` ranks the hosts that keep being guilty. A catalog "
    "that cannot take it is a warning, never another exit code.",
)
def analyze(
    path: Path,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None,
    catalog: Path | None,
) -> None:
    """Find the hung collective and the guilty rank in the dumps under PATH.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    run_guarded("frtools", lambda: _run(path, fmt, output, verbose, workers, world_size, catalog))


def _run(
    path: Path,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None = None,
    catalog: Path | None = None,
) -> int:
    from frtools.commands.history import catalog_for, record_verdict

    started = time.monotonic()
    catalog = catalog_for(catalog)
    trace, _, verdict = load_and_diagnose(
        "frtools",
        path,
        workers=workers,
        world_size=world_size,
        progress=progress_wanted(path, human=fmt == "terminal"),
    )

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

        if output is None:
            from rich.console import Console

            Console(width=min(Console().width, 100) if sys.stdout.isatty() else 100).print(
                terminal.renderable(verdict, verbose)
            )
            text = None
        else:
            text = terminal.render(verdict, verbose=verbose)

    if text is not None:
        write_text("frtools", text, output)
    if catalog is not None:  # after the verdict is out: a failing catalog only warns
        record_verdict(catalog, verdict, trace, path)
    return verdict.exit_code
