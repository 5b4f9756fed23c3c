"""Python stacks of every rank, as faulthandler wrote them, parsed and grouped.

A hung job's collectives say *which* op is stuck; the stacks say *where in the user's
code* each rank is. faulthandler is the one writer that works while another thread holds
the GIL (it runs from a signal handler), so its text format is what every rank leaves next
to its black box (``rank_<R>.stacks``). A file may hold several dumps appended one after
another (one per dump request, one from a fatal signal); the analysis uses the last one.

Grouping the main threads of all ranks by identical stack turns a thousand stacks into a
handful of rows: the big group is the healthy majority waiting in a collective, the rare
groups are the outliers worth reading.

Native stacks (``rank_<R>.native``: py-spy's ``dump --native --json`` taken by ``frtools
dump``) go on below the last Python frame: a rank stuck inside NCCL, Gloo, CUDA or c10d shows
there. They are parsed as untrusted JSON (bounded), grouped the same way, and shown with the
frames of those libraries first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from frtools.formats import limits
from frtools.model.trace import Trace, is_user_frame

_THREAD_RE = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<tid>0x[0-9a-fA-F]+)"
    r"(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):\s*$"
)
_SINGLE_RE = re.compile(r"^Stack \(most recent call first\):\s*$")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.*?)\s*$')
_FATAL_RE = re.compile(r"^Fatal Python error: (?P<reason>.*)$")

_G = TypeVar("_G", "StackGroup", "NativeStackGroup")

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
    return _ordered_marked(list(by_key.values()))


def _ordered_marked(groups: list[_G]) -> list[_G]:
    """Largest group first; a group is an outlier when it is smaller than the largest and
    holds at most a quarter of the ranks (at least one)."""
    groups = sorted(groups, key=lambda g: (-g.count, g.ranks[0]))
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
    """What a report shows about stacks: the blamed ranks' stacks and the group table, for
    the Python stacks (faulthandler) and, where py-spy took them, the native ones."""

    guilty: list[RankStack]
    groups: list[StackGroup]
    ranks_with_stacks: int
    native_guilty: list[NativeRankStack] = field(default_factory=list)
    native_groups: list[NativeStackGroup] = field(default_factory=list)
    ranks_with_native: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "guilty": [s.to_dict() for s in self.guilty],
            "groups": [g.to_dict() for g in self.groups],
            "ranks_with_stacks": self.ranks_with_stacks,
        }
        if self.ranks_with_native:
            out["native"] = {
                "guilty": [s.to_dict() for s in self.native_guilty],
                "groups": [g.to_dict() for g in self.native_groups],
                "ranks_with_stacks": self.ranks_with_native,
            }
        return out


def stacks_summary(trace: Trace, guilty_ranks: Iterable[int] = ()) -> StacksSummary:
    """Stacks data for a report: each guilty rank's main-thread stack (frames innermost
    first; ``user_frames`` for the lines to show first) and all ranks' stack groups; the
    same for native stacks where the dump holds them."""
    stacks = {r: info.stacks for r, info in trace.ranks.items() if info.stacks}
    guilty = [s for r in guilty_ranks if (s := rank_stack(trace, r)) is not None]
    native = {
        r: stack
        for r, info in sorted(trace.ranks.items())
        if info.native_stacks and (stack := native_rank_stack(r, info.native_stacks, info.pid))
    }
    return StacksSummary(
        guilty=guilty,
        groups=group_stacks(stacks),
        ranks_with_stacks=len(stacks),
        native_guilty=[native[r] for r in guilty_ranks if r in native],
        native_groups=group_native_stacks(native.values()),
        ranks_with_native=len(native),
    )


# --- native stacks (py-spy) -------------------------------------------------------------------

# what a hang inside C++ is usually in: the communication library, the CUDA runtime/driver,
# c10d's process groups; matched in a native frame's symbol or library name
_MATTERS_RE = re.compile(r"nccl|gloo|cuda|c10d|processgroup", re.IGNORECASE)
# libraries whose frames say little of where a rank is (a wait, the interpreter)
_PLUMBING_RE = re.compile(r"^(libc|libpthread|libstdc\+\+|ld-linux|libpython|python)", re.I)
_ADDRESS_RE = re.compile(r"^0x[0-9a-fA-F]+$")
# bounds on what one rank's py-spy answer may cost (the file itself is capped at read time)
MAX_NATIVE_THREADS = 1024
MAX_NATIVE_FRAMES = 256
MAX_NAME_CHARS = 2000
SHORT_NAME_CHARS = 120


@dataclass(frozen=True)
class NativeFrame:
    """One frame of py-spy's merged stack: a native one (``module`` its library) or a
    Python one (``module`` None, ``filename:line``)."""

    name: str
    module: str | None
    filename: str = ""
    line: int | None = None

    @property
    def native(self) -> bool:
        return self.module is not None

    @property
    def matters(self) -> bool:
        """A native frame of NCCL, Gloo, CUDA or c10d: where a rank stuck in C++ stands."""
        return self.module is not None and bool(
            _MATTERS_RE.search(self.name) or _MATTERS_RE.search(self.module)
        )

    @property
    def short_name(self) -> str:
        """The symbol without template and argument lists, an address as ``??``."""
        return "??" if _ADDRESS_RE.match(self.name) else _short_symbol(self.name)

    def key(self) -> tuple[str, str | None, int | None]:
        return (self.short_name, self.module, None if self.native else self.line)

    def __str__(self) -> str:
        if self.native:
            return f"{self.short_name} ({self.module})"
        return f"{self.short_name} ({self.filename}:{self.line if self.line is not None else '?'})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.short_name,
            "module": self.module,
            "filename": self.filename,
            "line": self.line,
            "matters": self.matters,
        }


def _short_symbol(name: str) -> str:
    """``ns::f<T>(int) const`` -> ``ns::f``; lambdas keep their ``{lambda#1}``."""
    out: list[str] = []
    depth = 0
    for ch in name[:MAX_NAME_CHARS]:
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    text = "".join(out).replace(" const", "").strip() or name[:SHORT_NAME_CHARS]
    return text if len(text) <= SHORT_NAME_CHARS else text[: SHORT_NAME_CHARS - 1] + "…"


@dataclass
class NativeThread:
    """One Python thread of a py-spy dump, frames innermost first."""

    thread_id: str
    name: str | None
    os_thread_id: int | None
    active: bool  # on CPU when sampled (py-spy's "active"), not idle in a wait
    owns_gil: bool
    frames: list[NativeFrame] = field(default_factory=list)


def _opt_int(value: object) -> int | None:
    return limits.strict_int(value)  # the one rule for an int read from a file


def _opt_str(value: object, n: int = MAX_NAME_CHARS) -> str | None:
    return value[:n] if isinstance(value, str) else None


def parse_native(text: str | None) -> list[NativeThread]:
    """The threads of py-spy's ``dump --native --json`` answer; ``[]`` for anything that is
    not one (untrusted text: its parsing cost is bounded before it is parsed, and only so
    many threads and frames, and so many characters of a name, are kept)."""
    if not text:
        return []
    raw = text.encode("utf-8", errors="replace")
    try:
        limits.check_json(raw)
        data = json.loads(raw)
    except (limits.InputRefused, RecursionError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    threads = []
    for item in data[:MAX_NATIVE_THREADS]:
        if not isinstance(item, dict) or not isinstance(item.get("frames"), list):
            continue
        frames = []
        for f in item["frames"][:MAX_NATIVE_FRAMES]:
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                continue
            module = _opt_str(f.get("module"))
            frames.append(
                NativeFrame(
                    name=f["name"][:MAX_NAME_CHARS],
                    module=module.rsplit("/", 1)[-1] if module is not None else None,
                    filename=_opt_str(f.get("short_filename")) or _opt_str(f.get("filename")) or "",
                    line=_opt_int(f.get("line")),
                )
            )
        threads.append(
            NativeThread(
                thread_id=str(_opt_int(item.get("thread_id")) or "?"),
                name=_opt_str(item.get("thread_name"), 200),
                os_thread_id=_opt_int(item.get("os_thread_id")),
                active=item.get("active") is True,
                owns_gil=item.get("owns_gil") is True,
                frames=frames,
            )
        )
    return threads


@dataclass
class NativeRankStack:
    """The native stack that tells where one rank stands: its main thread's, unless the main
    thread is outside NCCL/Gloo/CUDA/c10d and another thread is on CPU inside them (an
    autograd thread spinning in an NCCL enqueue)."""

    rank: int
    thread: str
    frames: list[NativeFrame]
    active: bool = False
    owns_gil: bool = False

    @property
    def where(self) -> str:
        return _where(self.frames)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "thread": self.thread,
            "active": self.active,
            "owns_gil": self.owns_gil,
            "where": self.where,
            "frames": [f.to_dict() for f in self.frames],
        }


def native_rank_stack(
    rank: int, text: str | None, pid: int | None = None
) -> NativeRankStack | None:
    """The telling native stack of one rank from its ``rank_<R>.native`` text, or None."""
    threads = [t for t in parse_native(text) if t.frames]
    if not threads:
        return None
    main = next((t for t in threads if pid is not None and t.os_thread_id == pid), None)
    main = main or next((t for t in threads if t.name == "MainThread"), threads[0])
    chosen = main
    if not any(f.matters for f in main.frames):
        busy = [t for t in threads if t.active and any(f.matters for f in t.frames)]
        chosen = busy[0] if busy else main
    return NativeRankStack(
        rank=rank,
        thread=chosen.name or f"thread {chosen.thread_id}",
        frames=chosen.frames,
        active=chosen.active,
        owns_gil=chosen.owns_gil,
    )


def frames_that_matter_first(frames: Sequence[NativeFrame]) -> list[NativeFrame]:
    """NCCL/Gloo/CUDA/c10d frames (innermost first), then the others."""
    return [f for f in frames if f.matters] + [f for f in frames if not f.matters]


def _where(frames: Sequence[NativeFrame]) -> str:
    """One line for a native stack: its innermost frame that matters, else its innermost
    native frame outside libc/libstdc++/the interpreter, else its innermost frame."""
    for pick in (
        lambda f: f.matters,
        lambda f: f.native and not _PLUMBING_RE.match(f.module or "") and f.short_name != "??",
        lambda f: True,
    ):
        for f in frames:
            if pick(f):
                return str(f)
    return "?"


@dataclass
class NativeStackGroup:
    """Ranks whose telling native stacks are the same (symbols and libraries; addresses,
    which differ per process, compare equal)."""

    frames: list[NativeFrame]
    ranks: list[int]
    thread: str
    outlier: bool = False

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def top(self) -> str:
        return _where(self.frames)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "count": self.count,
            "outlier": self.outlier,
            "thread": self.thread,
            "top": self.top,
            "frames": [f.to_dict() for f in frames_that_matter_first(self.frames)],
        }


def group_native_stacks(stacks: Iterable[NativeRankStack]) -> list[NativeStackGroup]:
    """Group ranks by their telling native stack, largest group first, outliers marked as
    for the Python stacks."""
    by_key: dict[tuple, NativeStackGroup] = {}
    for stack in sorted(stacks, key=lambda s: s.rank):
        key = (stack.thread == "MainThread", tuple(f.key() for f in stack.frames))
        group = by_key.get(key)
        if group is None:
            by_key[key] = group = NativeStackGroup(
                frames=list(stack.frames), ranks=[], thread=stack.thread
            )
        group.ranks.append(stack.rank)
    return _ordered_marked(list(by_key.values()))
