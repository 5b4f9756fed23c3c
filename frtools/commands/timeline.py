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

from frtools.commands._common import (
    diagnosed,
    fail,
    file_command,
    guarded,
    reading_options,
    say_written,
)

DEFAULT_OUTPUT = "frtools-timeline.json"


@file_command("timeline", DEFAULT_OUTPUT, "JSON")
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
@reading_options
@guarded("frtools timeline")
def timeline(
    path: Path,
    output: str,
    last: int | None,
    rank_text: str | None,
    workers: int | None,
    world_size: int | None,
) -> int:
    """Write the last ops of every rank under PATH as a Perfetto / chrome://tracing file.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    from frtools.model.ranks import RankTextError, parse_ranks

    ranks = None
    if rank_text is not None:
        try:
            ranks = parse_ranks(rank_text)
        except RankTextError as e:
            fail("frtools timeline", f"error: --ranks: {e}")
    from frtools.analyze.reporters import trace_events

    with diagnosed(
        "frtools timeline",
        path,
        workers=workers,
        world_size=world_size,
        writing="writing the timeline",
    ) as (trace, alignment, verdict):
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
    say_written(output, f"{Path(output).stat().st_size / 1e6:.1f} MB, {n} ops", verdict)
    return verdict.exit_code
