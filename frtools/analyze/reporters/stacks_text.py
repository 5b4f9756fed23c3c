"""Stacks as plain text lines (Python, then native), shared by the terminal and markdown
reports."""

from __future__ import annotations

from frtools.analyze.stacks import StacksSummary, frames_that_matter_first, user_frames_first
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
    return out + native_stack_lines(summary, max_frames)


def native_stack_lines(summary: StacksSummary, max_frames: int = 8) -> list[str]:
    """Each guilty rank's native stack (NCCL/Gloo/CUDA/c10d frames first), then one line per
    group of ranks with the same native stack: where it stands in C++."""
    out: list[str] = []
    for stack in summary.native_guilty:
        state = ", on CPU" if stack.active else ""
        state += ", holds the GIL" if stack.owns_gil else ""
        out.append(f"rank {stack.rank} native stack ({stack.thread}{state}):")
        ordered = frames_that_matter_first(stack.frames)
        for frame in ordered[:max_frames]:
            out.append(f"  {frame}" if frame.matters else f"  ({frame})")
        if len(ordered) > max_frames:
            out.append(f"  ... {len(ordered) - max_frames} more frame(s)")
    if summary.native_groups:
        out.append(f"native stacks of {summary.ranks_with_native} rank(s) (py-spy), grouped:")
        for g in summary.native_groups:
            mark = "  <- outlier" if g.outlier else ""
            thread = "" if g.thread == "MainThread" else f" [{g.thread}]"
            out.append(f"  {g.count:>4} rank(s) {format_ranks(g.ranks):<12} {g.top}{thread}{mark}")
    return out
