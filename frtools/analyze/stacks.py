"""Python stacks of every rank, as faulthandler wrote them, parsed and grouped.

A hung job's collectives say *which* op is stuck; the stacks say *where in the user's
code* each rank is. faulthandler is the one writer that works while another thread holds
the GIL (it runs from a signal handler), so its text format is what every rank leaves next
to its black box (``rank_<R>.stacks``). A file may hold several dumps appended one after
another (one per dump request, one from a fatal signal); the analysis uses the last one.

Grouping the main threads of all ranks by identical stack turns a thousand stacks into a
handful of rows: the big group is the healthy majority waiting in a collective, the rare
groups are the outliers worth reading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from frtools.model.trace import Trace, is_user_frame

_THREAD_RE = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<tid>0x[0-9a-fA-F]+)"
    r"(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):\s*$"
)
_SINGLE_RE = re.compile(r"^Stack \(most recent call first\):\s*$")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.*?)\s*$')
_FATAL_RE = re.compile(r"^Fatal Python error: (?P<reason>.*)$")

# Bottom frames of threads that the threading module started: never the main thread.
_THREAD_BOOTSTRAP = ("_bootstrap", "_bootstrap_inner")


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int | None
    name: str

    @property
    def user(self) -> bool:
        """True for the user's own code, False for torch / frtools / stdlib machinery."""
        return is_user_frame(self.filename) and not _is_stdlib(self.filename)

    def __str__(self) -> str:
        return f"{self.filename}:{self.line if self.line is not None else '?'} in {self.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"filename": self.filename, "line": self.line, "name": self.name, "user": self.user}


@dataclass
class ThreadStack:
    """One thread's stack; ``frames`` innermost first, as faulthandler prints them."""

    thread_id: str
    frames: list[Frame] = field(default_factory=list)
    current: bool = False  # the thread that wrote the dump (a signal handler's thread)
    name: str | None = None
    truncated: bool = False

    @property
    def is_threading_worker(self) -> bool:
        if not self.frames:
            return False
        bottom = self.frames[-1]
        return bottom.name in _THREAD_BOOTSTRAP and bottom.filename.endswith("threading.py")

    def key(self) -> tuple[tuple[str, int | None, str], ...]:
        return tuple((f.filename, f.line, f.name) for f in self.frames)


@dataclass
class StackDump:
    """One faulthandler dump: every thread of one process at one moment."""

    threads: list[ThreadStack] = field(default_factory=list)
    fatal: str | None = None  # "Segmentation fault" when written by a fatal signal

    @property
    def main_thread(self) -> ThreadStack | None:
        """The thread running the script: not started by ``threading`` and with Python
        frames; faulthandler lists the newest thread first, so the main thread is the last
        such one."""
        candidates = [t for t in self.threads if t.frames and not t.is_threading_worker]
        if candidates:
            return candidates[-1]
        with_frames = [t for t in self.threads if t.frames]
        return with_frames[-1] if with_frames else None


def _is_stdlib(filename: str) -> bool:
    return "/lib/python3" in filename and "site-packages" not in filename


def parse_dumps(text: str) -> list[StackDump]:
    """Every dump in a faulthandler file, oldest first.

    A new dump starts at a ``Fatal Python error`` line, or when a thread id already seen in
    the current dump appears again (appended dumps carry no separator).
    """
    dumps: list[StackDump] = []
    current_dump: StackDump | None = None
    thread: ThreadStack | None = None
    seen: set[str] = set()
    pending_fatal: str | None = None

    for line in text.splitlines():
        fatal = _FATAL_RE.match(line)
        if fatal:
            pending_fatal = fatal.group("reason").strip()
            current_dump, thread = None, None
            continue
        m = _THREAD_RE.match(line)
        if m or _SINGLE_RE.match(line):
            tid = m.group("tid") if m else "0x0"
            if current_dump is None or tid in seen:
                current_dump = StackDump(fatal=pending_fatal)
                dumps.append(current_dump)
                seen, pending_fatal = set(), None
            seen.add(tid)
            thread = ThreadStack(
                thread_id=tid,
                current=bool(m and m.group("current") == "Current thread"),
                name=m.group("name") if m else None,
            )
            current_dump.threads.append(thread)
            continue
        if thread is None:
            continue
        fm = _FRAME_RE.match(line)
        if fm:
            ln = fm.group("line")
            thread.frames.append(
                Frame(fm.group("file"), int(ln) if ln.isdigit() else None, fm.group("name"))
            )
        elif line.strip() == "<truncated rest of calls>":
            thread.truncated = True
    return [d for d in dumps if d.threads]


def last_dump(text: str | None) -> StackDump | None:
    """The newest dump in a stacks file, or None when it holds none."""
    if not text:
        return None
    dumps = parse_dumps(text)
    return dumps[-1] if dumps else None


def main_thread_stack(text: str | None) -> ThreadStack | None:
    dump = last_dump(text)
    return dump.main_thread if dump else None


def main_thread_call_site(text: str | None) -> str | None:
    """Where the main thread stands in the user's code (``file:line in func``), from the
    newest dump in a stacks file; None without a parsable main thread. Skips the watcher
    and other ``threading`` threads and stdlib / torch frames."""
    stack = main_thread_stack(text)
    if stack is None or not stack.frames:
        return None
    return str(_innermost_user(stack.frames) or stack.frames[0])


@dataclass
class StackGroup:
    """Ranks whose main threads stand in the same place (same frames, same lines)."""

    frames: list[Frame]
    ranks: list[int]
    outlier: bool = False

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def top(self) -> str:
        """Where this group stands, in one line: the innermost user frame, else the
        innermost frame."""
        return str(_innermost_user(self.frames) or (self.frames[0] if self.frames else "?"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "count": self.count,
            "outlier": self.outlier,
            "top": self.top,
            "frames": [f.to_dict() for f in self.frames],
        }


def _innermost_user(frames: Sequence[Frame]) -> Frame | None:
    for f in frames:
        if f.user:
            return f
    return None


def group_stacks(stacks_by_rank: Mapping[int, str | None]) -> list[StackGroup]:
    """Group ranks by their main thread's stack, largest group first.

    A group is an outlier when it is smaller than the largest group and holds at most a
    quarter of the ranks (at least one): in a hang, that is where the guilty rank stands.
    Ranks without a parsable stack are left out.
    """
    by_key: dict[tuple, StackGroup] = {}
    for rank in sorted(stacks_by_rank):
        stack = main_thread_stack(stacks_by_rank[rank])
        if stack is None:
            continue
        key = stack.key()
        group = by_key.get(key)
        if group is None:
            by_key[key] = group = StackGroup(frames=list(stack.frames), ranks=[])
        group.ranks.append(rank)
    groups = sorted(by_key.values(), key=lambda g: (-g.count, g.ranks[0]))
    if len(groups) > 1:
        total = sum(g.count for g in groups)
        largest = groups[0].count
        limit = max(1, total // 4)
        for g in groups:
            g.outlier = g.count < largest and g.count <= limit
    return groups


def user_frames_first(frames: Sequence[Frame]) -> list[Frame]:
    """The user's frames (innermost first), then the library frames: a report shows where
    in *their* code a rank stands before the torch internals under it."""
    return [f for f in frames if f.user] + [f for f in frames if not f.user]


@dataclass
class RankStack:
    rank: int
    thread_id: str
    frames: list[Frame]
    fatal: str | None = None

    @property
    def user_frames(self) -> list[Frame]:
        return [f for f in self.frames if f.user]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "thread_id": self.thread_id,
            "fatal": self.fatal,
            "frames": [f.to_dict() for f in self.frames],
            "user_frames": [f.to_dict() for f in self.user_frames],
        }


def rank_stack(trace: Trace, rank: int) -> RankStack | None:
    """The main-thread stack of one rank from its attached stacks text, or None."""
    info = trace.ranks.get(rank)
    dump = last_dump(info.stacks if info else None)
    if dump is None or dump.main_thread is None:
        return None
    main = dump.main_thread
    return RankStack(
        rank=rank, thread_id=main.thread_id, frames=list(main.frames), fatal=dump.fatal
    )


@dataclass
class StacksSummary:
    """What a report shows about stacks: the blamed ranks' stacks and the group table."""

    guilty: list[RankStack]
    groups: list[StackGroup]
    ranks_with_stacks: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "guilty": [s.to_dict() for s in self.guilty],
            "groups": [g.to_dict() for g in self.groups],
            "ranks_with_stacks": self.ranks_with_stacks,
        }


def stacks_summary(trace: Trace, guilty_ranks: Iterable[int] = ()) -> StacksSummary:
    """Stacks data for a report: each guilty rank's main-thread stack (frames innermost
    first; ``user_frames`` for the lines to show first) and all ranks' stack groups."""
    stacks = {r: info.stacks for r, info in trace.ranks.items() if info.stacks}
    guilty = [s for r in guilty_ranks if (s := rank_stack(trace, r)) is not None]
    return StacksSummary(guilty=guilty, groups=group_stacks(stacks), ranks_with_stacks=len(stacks))
