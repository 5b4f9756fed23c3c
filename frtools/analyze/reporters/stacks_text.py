"""Stacks as plain text lines, shared by the terminal and markdown reports."""

from __future__ import annotations

from frtools.analyze.stacks import StacksSummary, user_frames_first
from frtools.model.ranks import format_ranks


def stack_lines(summary: StacksSummary, max_frames: int = 8) -> list[str]:
    """Each guilty rank's main-thread stack (the user's frames first, then at most a few
    library frames), then one line per stack group."""
    out: list[str] = []
    for stack in summary.guilty:
        title = f"rank {stack.rank} main thread"
        out.append(f"{title} ({stack.fatal}):" if stack.fatal else f"{title}:")
        ordered = user_frames_first(stack.frames)
        for frame in ordered[:max_frames]:
            out.append(f"  {frame}" if frame.user else f"  ({frame})")
        if len(ordered) > max_frames:
            out.append(f"  ... {len(ordered) - max_frames} more frame(s)")
    if len(summary.groups) > 1 or (summary.groups and summary.guilty):
        out.append(f"stacks of {summary.ranks_with_stacks} rank(s), grouped:")
        for g in summary.groups:
            mark = "  <- outlier" if g.outlier else ""
            out.append(f"  {g.count:>4} rank(s) {format_ranks(g.ranks):<12} {g.top}{mark}")
    return out
