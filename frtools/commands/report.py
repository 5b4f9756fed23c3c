"""``frtools report PATH -o report.html``: the verdict and the records around it as one
self-contained HTML file (no network request; readable offline, e.g. as a CI artifact).

Exit codes as ``frtools analyze``: 0 healthy, 1 a problem found, 2 unusable input or usage
error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from frtools.commands._common import (
    diagnosed,
    file_command,
    guarded,
    reading_options,
    say_written,
    write_text,
)

DEFAULT_OUTPUT = "frtools-report.html"


@file_command("report", DEFAULT_OUTPUT, "HTML file")
@click.option(
    "--last",
    type=click.IntRange(min=1, max=10_000),
    default=None,
    help="Ops per rank in the timeline [default: 48 for the guilty rank and the members of "
    "its group, fewer for the others at scale, to keep the file small].",
)
@click.option("--title", default=None, help="The page's title [default: frtools: KIND].")
@reading_options
@guarded("frtools report")
def report(
    path: Path,
    output: str,
    last: int | None,
    title: str | None,
    workers: int | None,
    world_size: int | None,
) -> int:
    """Write an HTML report of the dumps under PATH: the verdict first, a process group x
    rank progress map, the last ops of every rank around the hang, stacks, and the inputs.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    from frtools.analyze.reporters import html

    to_stdout = output == "-"
    with diagnosed(
        "frtools report", path, workers=workers, world_size=world_size, writing="writing the report"
    ) as (trace, alignment, verdict):
        text = html.render(verdict, trace, alignment, last=last, title=title, source=str(path))
    write_text("frtools report", text, None if to_stdout else Path(output))
    if not to_stdout:
        say_written(output, _size(len(text.encode("utf-8"))), verdict)
    sys.stdout.flush()
    return verdict.exit_code


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{max(1, round(n / 1e3))} kB"
