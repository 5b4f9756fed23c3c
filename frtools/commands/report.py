"""``frtools report PATH -o report.html``: the verdict and the records around it as one
self-contained HTML file (no network request; readable offline, e.g. as a CI artifact).

Exit codes as ``frtools analyze``: 0 healthy, 1 a problem found, 2 unusable input or usage
error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from frtools.analyze.reporters import escape
from frtools.commands._common import (
    OneLineCommand,
    load_and_diagnose,
    phase,
    progress_wanted,
    run_guarded,
    write_text,
)

DEFAULT_OUTPUT = "frtools-report.html"


@click.command("report", cls=OneLineCommand)
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    default=DEFAULT_OUTPUT,
    show_default=True,
    help="Where to write the HTML file; '-' for stdout.",
)
@click.option(
    "--last",
    type=click.IntRange(min=1, max=10_000),
    default=None,
    help="Ops per rank in the timeline [default: 48 for the guilty rank and the members of "
    "its group, fewer for the others at scale, to keep the file small].",
)
@click.option("--title", default=None, help="The page's title [default: frtools: KIND].")
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
    help="The job's number of ranks, when the dumps cannot say it (Gloo).",
)
def report(
    path: Path,
    output: str,
    last: int | None,
    title: str | None,
    workers: int | None,
    world_size: int | None,
) -> None:
    """Write an HTML report of the dumps under PATH: the verdict first, a process group x
    rank progress map, the last ops of every rank around the hang, stacks, and the inputs.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    run_guarded("frtools report", lambda: _run(path, output, last, title, workers, world_size))


def _run(
    path: Path,
    output: str,
    last: int | None,
    title: str | None,
    workers: int | None,
    world_size: int | None,
) -> int:
    to_stdout = output == "-"
    progress = progress_wanted(path, human=True)
    trace, alignment, verdict = load_and_diagnose(
        "frtools report", path, workers=workers, world_size=world_size, progress=progress
    )
    from frtools.analyze.reporters import html

    with phase("writing the report", progress):
        text = html.render(verdict, trace, alignment, last=last, title=title, source=str(path))
    write_text("frtools report", text, None if to_stdout else Path(output))
    if not to_stdout:
        size = len(text.encode("utf-8"))
        click.echo(
            escape.line(f"{output} ({_size(size)}): {verdict.kind.upper()} {verdict.headline}"),
            err=True,
        )
    sys.stdout.flush()
    return verdict.exit_code


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{max(1, round(n / 1e3))} kB"
