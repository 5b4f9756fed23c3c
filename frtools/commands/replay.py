"""``frtools replay DIR -o repro.py [--ranks R] [--window N] [--scale S]``: a reproducer.

Writes one self-contained script (torch only) that replays the recorded collectives and P2P
ops of the dumps under DIR on a local Gloo job and stops each rank where it stopped
(``frtools.analyze.replay``; docs/replay.md). Thin: read, plan, write.
"""

from __future__ import annotations

from pathlib import Path

import click

from frtools.commands._common import (
    OneLineCommand,
    fail,
    first_line,
    guarded,
    reading_options,
)

PREFIX = "frtools replay"


def _scale(value: str) -> float | None:
    if value == "auto":
        return None
    try:
        scale = float(value)
    except ValueError:
        fail(PREFIX, f"error: --scale must be 'auto' or a number in (0, 1], not {value!r}")
    if not 0 < scale <= 1:
        fail(PREFIX, f"error: --scale must be in (0, 1], not {value}")
    return scale


@click.command("replay", cls=OneLineCommand)
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the script (e.g. repro.py).",
)
@click.option(
    "--ranks",
    default=None,
    help="Replay only these ranks (e.g. '1,3' or '0-3'), renumbered from 0, with the groups "
    "they are in (cut down to them).",
)
@click.option(
    "--window",
    type=click.IntRange(1, 100_000),
    default=64,
    show_default=True,
    help="Ops per process group (and per P2P pair) replayed before the fault.",
)
@click.option(
    "--scale",
    default="auto",
    show_default=True,
    help="Multiply every tensor dimension by this (rounded up); 'auto' keeps the largest "
    "tensor at about a million elements.",
)
@reading_options
@guarded(PREFIX)
def replay(
    path: Path,
    output: Path,
    ranks: str | None,
    window: int,
    scale: str,
    workers: int | None,
    world_size: int | None,
) -> int:
    """Write a script that replays the recorded collectives under PATH and hangs the same way.

    Run it with ``python repro.py --dir D`` (frtools' recorder on), then ``frtools analyze D``.
    """
    from frtools.analyze.readers import UnusableInput, load_trace
    from frtools.analyze.replay import ReplayError, plan_replay, render_script
    from frtools.model.ranks import parse_ranks

    factor = _scale(scale)
    subset = None
    if ranks is not None:
        try:
            subset = parse_ranks(ranks)
        except ValueError as e:
            fail(PREFIX, f"error: --ranks: {first_line(e)}")
    try:
        trace = load_trace(path, workers=workers, world_size=world_size)
    except UnusableInput as e:
        fail(PREFIX, f"error: {first_line(e, 'unusable input')}")
    try:
        plan = plan_replay(trace, window=window, ranks=subset, scale=factor)
    except ReplayError as e:
        fail(PREFIX, f"error: {path}: {first_line(e)}")
    text = render_script(plan, source=str(path))
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(PREFIX, f"error: cannot write {output}: {e.strerror or e}")
    ops = sum(len(v) for v in plan.ops.values())
    click.echo(
        f"{output}: {plan.world} ranks, {len(plan.groups)} groups, {ops} ops "
        f"(run: python {output} --dir DIR; then frtools analyze DIR)",
        err=True,
    )
    return 0
