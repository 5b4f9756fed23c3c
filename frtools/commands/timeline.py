"""``frtools timeline PATH -o trace.json``: every rank's last ops as a Chrome trace-event
file, for ui.perfetto.dev or chrome://tracing (one process per rank, one track per process
group, the hang and the verdict as instant events).

Exit codes as ``frtools analyze``: 0 healthy, 1 a problem found, 2 unusable input or usage
error.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import click

from frtools.analyze.reporters import escape
from frtools.commands._common import (
    OneLineCommand,
    fail,
    load_and_diagnose,
    phase,
    progress_wanted,
    run_guarded,
)

DEFAULT_OUTPUT = "frtools-timeline.json"


@click.command("timeline", cls=OneLineCommand)
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    default=DEFAULT_OUTPUT,
    show_default=True,
    help="Where to write the JSON; '-' for stdout.",
)
@click.option(
    "--last",
    type=click.IntRange(min=0),
    default=None,
    help="Ops per rank, the newest [default: 100, fewer past 2,000 ranks to keep the file "
    "near 60 MB; 4,096 ranks: 48]. 0: every recorded op (4,096 ranks x 2,000 ops is about "
    "2.5 GB of JSON).",
)
@click.option(
    "--ranks",
    "rank_text",
    default=None,
    help="Only these ranks, e.g. '0-7,2608' [default: all].",
)
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
def timeline(
    path: Path,
    output: str,
    last: int | None,
    rank_text: str | None,
    workers: int | None,
    world_size: int | None,
) -> None:
    """Write the last ops of every rank under PATH as a Perfetto / chrome://tracing file.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    run_guarded(
        "frtools timeline",
        lambda: _run(path, output, last, rank_text, workers, world_size),
    )


def _run(
    path: Path,
    output: str,
    last: int | None,
    rank_text: str | None,
    workers: int | None,
    world_size: int | None,
) -> int:
    from frtools.model.ranks import RankTextError, parse_ranks

    ranks = None
    if rank_text is not None:
        try:
            ranks = parse_ranks(rank_text)
        except RankTextError as e:
            fail("frtools timeline", f"error: --ranks: {e}")
    progress = progress_wanted(path, human=True)
    trace, alignment, verdict = load_and_diagnose(
        "frtools timeline", path, workers=workers, world_size=world_size, progress=progress
    )
    from frtools.analyze.reporters import trace_events

    with phase("writing the timeline", progress):
        if output == "-":
            buffer = io.StringIO()
            trace_events.write(buffer, verdict, trace, alignment, last=last, ranks=ranks)
            sys.stdout.write(buffer.getvalue())
            sys.stdout.flush()
            return verdict.exit_code
        try:
            with open(output, "w", encoding="utf-8") as f:
                n = trace_events.write(f, verdict, trace, alignment, last=last, ranks=ranks)
        except OSError as e:
            fail("frtools timeline", f"error: cannot write {output}: {e.strerror or e}")
    size = Path(output).stat().st_size
    click.echo(
        escape.line(
            f"{output} ({size / 1e6:.1f} MB, {n} ops): {verdict.kind.upper()} {verdict.headline}"
        ),
        err=True,
    )
    return verdict.exit_code
