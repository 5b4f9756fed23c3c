"""The rank summary: the part of one rank's black box a verdict needs, small enough to send.

A black box holds thousands of ops; a diagnosis needs a few hundred: who the rank is, each
process group's frontier (last issued / started / completed sequence ids), the ops that did
not complete, the last ``window`` ops, the Python stacks and the failure facts. A summary is
that, as one compact JSON document (docs/summary-format.md is the contract):

* ``summarize(snapshot)`` computes it from a black box (``formats.blackbox.read_snapshot``);
* ``encode`` / ``decode`` write and read it; ``decode`` treats its input as hostile (every
  field type-checked, every size bounded, one ``SummaryError`` line when refused);
* a *host summary* is a list of rank summaries in one document (``encode_host``), so that a
  per-host step can ship one file for all the ranks it collected.

Used by ``frtools.recovery`` (ranks publish theirs through the job's store when a hang is
flagged), and read by the analyzer (``analyze/readers/summary.py``): ``frtools analyze`` of a
folder of summaries gives the same verdict as of the black boxes they came from.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from frtools.formats.blackbox import STATE_NAMES, Snapshot
from frtools.formats.limits import strict_int
from frtools.model.ranks import MAX_WORLD_SIZE, RankTextError, format_ranks, parse_ranks

__all__ = [
    "DEFAULT_WINDOW",
    "ENTRY_COLUMNS",
    "ENTRY_FIELDS",
    "FORMAT",
    "HOST_KIND",
    "IDENTITY_KEYS",
    "MAX_NOTES",
    "MAX_NOTE_CHARS",
    "MAX_PENDING",
    "MAX_STACKS_CHARS",
    "RANK_KIND",
    "SUFFIX",
    "VERSION",
    "RankSummary",
    "SummaryEntry",
    "SummaryError",
    "SummaryGroup",
    "check_window",
    "checked_int",
    "completed_ops",
    "decode",
    "encode",
    "encode_host",
    "endings",
    "file_name",
    "kept_positions",
    "last_stacks",
    "looks_like_summary",
    "optional_bool",
    "optional_int",
    "optional_str",
    "rank_fields",
    "rank_header",
    "refuse_constant",
    "renumbered",
    "summarize",
    "want",
]

FORMAT = "frtools-summary"
VERSION = 1
RANK_KIND = "rank"
HOST_KIND = "host"
SUFFIX = ".summary.json"

# What a summary keeps by default: the last DEFAULT_WINDOW ops (PyTorch's analyzer and
# frtools' order rule look at a few hundred), every op that did not complete, up to
# MAX_PENDING, and the top STACK_FRAMES frames of each op's call stack.
DEFAULT_WINDOW = 256
MAX_PENDING = 256
STACK_FRAMES = 16

# Bounds a reader enforces (a summary is hostile input until proven otherwise).
MAX_ENTRIES = 4096  # per rank
MAX_STRINGS = 8192  # per rank
MAX_STRING_CHARS = 16384  # one string: a call stack of STACK_FRAMES frames fits easily
MAX_STACKS_CHARS = 65536  # the faulthandler text of all threads, its tail
MAX_GROUPS = 4096  # process groups per rank
MAX_IDENTITY_CHARS = 512  # one identity value
MAX_ERROR_CHARS = 512  # a failed op's error: its first line, cut here
MAX_NOTES = 32
MAX_NOTE_CHARS = 1024
MAX_RANK_BYTES = 4 << 20  # one rank's document
MAX_HOST_RANKS = 1024  # rank summaries in a host summary
MAX_DOCUMENT_BYTES = 256 << 20  # a host summary
_INT64 = (-(1 << 63), (1 << 63) - 1)

IDENTITY_KEYS = (
    "job_id",
    "host",
    "pid",
    "local_rank",
    "device",
    "device_id",
    "torch_version",
    "backend",
    "comm_lib_version",
    "launch_rank",
)
_STATES = frozenset(STATE_NAMES[1:])
_HEAD = re.compile(rb'^\s*\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')


class SummaryError(ValueError):
    """Not a usable summary; the message is a one-line reason."""


@dataclass
class SummaryGroup:
    """A process group as this rank knows it: global member ranks and its frontier."""

    name: str
    desc: str
    ranks: tuple[int, ...]
    last_enqueued_collective: int = -1
    last_started_collective: int = -1
    last_completed_collective: int = -1
    last_enqueued_p2p: int = -1
    last_completed_p2p: int = -1
    # P2P peers of this group's entries are group-local ranks (the record did not know the
    # members, as in Gloo's dumps): the analyzer maps them once membership is known
    local_peers: bool = False


def _column(json_kind: str, packed: str, **default: Any) -> Any:
    """An entry field and how each encoding stores it: ``json_kind`` in a JSON summary's
    rows (``s`` an index into ``strings``, 0 is "": none; ``i`` integer; ``n`` integer or
    null; ``f`` number or null; ``b`` 0/1), ``packed`` the packed host summary's column codec
    (``formats.summary_packed.COLUMNS`` explains them)."""
    return field(metadata={"json": json_kind, "packed": packed}, **default)


@dataclass
class SummaryEntry:
    """One recorded op (the black box's slot, strings resolved).

    The one list of an entry's fields: the JSON rows (``ENTRY_COLUMNS``), the packed columns
    and the readers derive theirs from it, in this order."""

    record_id: int = _column("i", "d8")
    group: int = _column("i", "i2")  # index into the rank's "groups"; -1: unknown
    collective_seq_id: int = _column("i", "d8")
    p2p_seq_id: int = _column("i", "d8")
    is_p2p: bool = _column("b", "u1")
    op: str = _column("s", "s4")  # the profiling name as recorded: "gloo:all_reduce"
    peer: int | None = _column("n", "i4?")  # P2P peer, a global rank
    input_sizes: str = _column("s", "s4")
    output_sizes: str = _column("s", "s4")
    input_dtypes: str = _column("s", "s4")
    output_dtypes: str = _column("s", "s4")
    state: str = _column("s", "u1")  # "scheduled", "started", "completed"
    time_created_ns: int = _column("i", "d8")
    time_started_ns: int | None = _column("n", "r8?:time_created_ns", default=None)
    time_completed_ns: int | None = _column("n", "r8?:time_created_ns", default=None)
    duration_ms: float | None = _column("f", "f8?", default=None)
    thread_id: str = _column("s", "s4", default="")
    thread_name: str = _column("s", "s4", default="")
    stack: str = _column("s", "s4", default="")  # "file:line in func" lines, innermost first
    # how the op failed, as the backend said ("": did not fail / unknown)
    error: str = _column("s", "s4", default="")
    # optional (a reader that lacks them keeps the defaults): what a PyTorch FR dump says
    # and a black box derives — retired (PyTorch's watchdog let go of the op: completed even
    # where Gloo's state stays "scheduled"; 0/1, None: unknown), the op's timeout, the call
    # site as its reader picked it (else it is derived from the stack), all_to_all split
    # sizes as the black box keeps them (formats.blackbox.splits_text: "3,6/6,3")
    retired: int | None = _column("n", "i1?", default=None)
    timeout_ms: int | None = _column("n", "i8?", default=None)
    call_site: str = _column("s", "s4", default="")
    splits: str = _column("s", "s4", default="")


# The entry's fields and how a JSON summary's rows store each, in the order a row lists
# them (derived from SummaryEntry: one field list).
ENTRY_COLUMNS: tuple[tuple[str, str], ...] = tuple(
    (f.name, f.metadata["json"]) for f in fields(SummaryEntry)
)
ENTRY_FIELDS: tuple[str, ...] = tuple(name for name, _ in ENTRY_COLUMNS)


@dataclass
class RankSummary:
    """What a verdict needs of one rank (see the module docstring).

    ``rank`` is the global rank the summary speaks for. ``wrapped``: older ops exist that the
    summary does not hold (the ring wrapped, or they are outside the window). ``stalled``:
    the rank knows it is blocked (its watchdog flagged a stall, or a collective failed on
    it); None when no watchdog ran. ``heartbeat_ns``: the rank was last seen alive (its
    watchdog's beat); ``taken_ns``: when the summary was computed.
    """

    rank: int
    world_size: int | None
    identity: dict[str, Any]
    groups: list[SummaryGroup]
    entries: list[SummaryEntry]
    taken_ns: int
    heartbeat_ns: int | None = None
    stalled: bool | None = None
    alive: bool | None = None
    wrapped: bool = False
    records_written: int = 0
    omitted: int = 0  # ops of the record the summary left out
    exit_kind: str | None = None
    exit_detail: str | None = None
    stacks: str | None = None
    notes: list[str] = field(default_factory=list)
    # when the record was taken, where that differs from the heartbeat (a PyTorch FR dump's
    # time); None: the heartbeat is the record's time
    dump_time_ns: int | None = None
    # how far its start-up got (frtools.model.trace.STARTUP_PHASES); None: not recorded
    startup_phase: str | None = None

    def pending(self) -> list[SummaryEntry]:
        """The ops that did not complete, oldest first."""
        return [e for e in self.entries if e.state != "completed"]


# -- which ops a summary keeps ---------------------------------------------------------------


def completed_ops(
    state_completed: np.ndarray,
    *,
    retired: np.ndarray | None = None,
    is_p2p: np.ndarray | None = None,
    collective_seq_id: np.ndarray | None = None,
    last_completed: np.ndarray | None = None,
) -> np.ndarray:
    """Which ops completed as far as a record says, the one rule every summary writer asks
    (per op, numpy arrays of one length): the state says so; PyTorch's ``retired`` does; or,
    for a collective of a record whose states never move (Gloo's), its group's
    ``last_completed_collective`` (``last_completed``; -1: none) is at or past its
    ``collective_seq_id``. A record without ``retired`` or frontiers passes None."""
    done = np.asarray(state_completed, dtype=bool)
    if retired is not None:
        done = done | np.asarray(retired, dtype=bool)
    if last_completed is not None and collective_seq_id is not None and is_p2p is not None:
        seq = np.asarray(collective_seq_id, dtype=np.int64)
        by_frontier = (seq > 0) & (seq <= np.asarray(last_completed, dtype=np.int64))
        done = done | (~np.asarray(is_p2p, dtype=bool) & by_frontier)
    return done


def kept_positions(
    n: int, window: int, completed: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Which of a rank's ``n`` ops (positions 0..n-1, oldest first) its summary keeps, in
    record order: the older ones that did not complete, up to ``MAX_PENDING``, then the last
    ``window``. ``completed(older)`` says which of the older positions completed
    (``completed_ops``), asked only when there are older ones.

    >>> kept_positions(5, 2, lambda older: older != 1).tolist()  # op 1 never completed
    [1, 3, 4]
    """
    first_recent = max(0, n - window)
    older = np.arange(first_recent, dtype=np.int64)
    if len(older):
        older = older[~np.asarray(completed(older), dtype=bool)][:MAX_PENDING]
    return np.concatenate([older, np.arange(first_recent, n, dtype=np.int64)])


def check_window(window: int) -> None:
    """A window a summary can keep beside its pending ops within ``MAX_ENTRIES``."""
    if not 0 < window <= MAX_ENTRIES - MAX_PENDING:
        raise ValueError(f"window must be 1..{MAX_ENTRIES - MAX_PENDING}")


# -- from a black box ----------------------------------------------------------------------


def _stack_head(text: str, frames: int = STACK_FRAMES) -> str:
    lines = text.split("\n")
    return "\n".join(lines[:frames])[:MAX_STRING_CHARS]


def last_stacks(text: str | None) -> str | None:
    """A stacks text (faulthandler's, appended dump after dump) bounded to its last
    ``MAX_STACKS_CHARS``, cut at a line start: the newest dump is what a reader uses.
    None when there is none."""
    if not text or not text.strip():
        return None
    if len(text) <= MAX_STACKS_CHARS:
        return text
    tail = text[-MAX_STACKS_CHARS:]
    return tail[tail.find("\n") + 1 :]


def summarize(
    snapshot: Snapshot,
    *,
    window: int = DEFAULT_WINDOW,
    since_record_id: int = 0,
    stacks: str | None = None,
    taken_ns: int | None = None,
) -> RankSummary:
    """The summary of a black box: its last ``window`` ops from ``since_record_id`` on, the
    older ones from there that did not complete (up to ``MAX_PENDING``), its groups'
    frontiers, its identity and watchdog facts; ``stacks``: the rank's faulthandler text."""
    check_window(window)
    ident = snapshot.identity
    header = snapshot.header
    slots = snapshot.slots
    rid = slots["record_id"]
    current = slots[rid >= since_record_id] if since_record_id > 0 else slots
    frontier = np.array(
        [int(g.last_completed_collective) for g in snapshot.groups] + [-1], dtype=np.int64
    )

    def completed(older: np.ndarray) -> np.ndarray:
        rows = current[older]
        pg = rows["pg"].astype(np.int64)
        return completed_ops(
            rows["state"] == STATE_NAMES.index("completed"),
            is_p2p=rows["is_p2p"],
            collective_seq_id=rows["collective_seq_id"],
            last_completed=frontier[np.where((pg >= 0) & (pg < len(frontier) - 1), pg, -1)],
        )

    kept = current[kept_positions(len(current), window, completed)]
    omitted = int(snapshot.records_written) - len(kept)
    strings: dict[int, str] = {}

    def text(sid: Any) -> str:
        sid = int(sid)
        value = strings.get(sid)
        if value is None:
            value = strings[sid] = snapshot.string(sid)[:MAX_STRING_CHARS]
        return value

    stack_texts: dict[int, str] = {}
    entries = []
    for s in kept.tolist() if len(kept) else ():
        row = dict(zip(kept.dtype.names, s, strict=True))
        stack_id = int(row["stack"])
        stack = stack_texts.get(stack_id)
        if stack is None:
            stack = stack_texts[stack_id] = _stack_head(text(stack_id))
        duration = float(row["duration_ms"])
        entries.append(
            SummaryEntry(
                record_id=int(row["record_id"]),
                group=int(row["pg"]) if 0 <= int(row["pg"]) < len(snapshot.groups) else -1,
                collective_seq_id=int(row["collective_seq_id"]),
                p2p_seq_id=int(row["p2p_seq_id"]),
                is_p2p=bool(row["is_p2p"]),
                op=text(row["op"]),
                peer=int(row["peer"]) if int(row["peer"]) >= 0 else None,
                input_sizes=text(row["input_sizes"]),
                output_sizes=text(row["output_sizes"]),
                input_dtypes=text(row["input_dtypes"]),
                output_dtypes=text(row["output_dtypes"]),
                state=STATE_NAMES[int(row["state"])],
                time_created_ns=int(row["time_created_ns"]),
                time_started_ns=int(row["time_started_ns"]) or None,
                time_completed_ns=int(row["time_completed_ns"]) or None,
                duration_ms=None if math.isnan(duration) else duration,
                thread_id=str(int(row["thread_id"])),
                thread_name=text(row["thread_name"]),
                stack=stack,
                error=_error_line(text(row["error"])) if "error" in row else "",
            )
        )
    groups = [
        SummaryGroup(
            name=g.name,
            desc=g.desc,
            ranks=tuple(g.ranks),
            last_enqueued_collective=int(g.last_enqueued_collective),
            last_started_collective=int(g.last_started_collective),
            last_completed_collective=int(g.last_completed_collective),
            last_enqueued_p2p=int(g.last_enqueued_p2p),
            last_completed_p2p=int(g.last_completed_p2p),
        )
        for g in snapshot.groups[:MAX_GROUPS]
    ]
    rank = _int_or_none(ident.get("rank"))
    if rank is None:
        raise SummaryError("the black box names no rank (its identity has none)")
    watchdog_ran = int(header["watchdog_state"]) != 0
    heartbeat = int(header["heartbeat_ns"])
    # an ending the process recorded (format 2); liveness is the caller's to say (``alive``)
    exit_kind, exit_detail = snapshot.ending(None)
    return RankSummary(
        rank=rank,
        world_size=_int_or_none(ident.get("world_size")),
        identity=_clean_identity(ident),
        groups=groups,
        entries=entries,
        taken_ns=time.time_ns() if taken_ns is None else taken_ns,
        heartbeat_ns=heartbeat if heartbeat > 0 else None,
        stalled=bool(header["stalled"]) if watchdog_ran else None,
        wrapped=bool(snapshot.wrapped or omitted > 0),
        records_written=int(snapshot.records_written),
        omitted=max(0, omitted),
        exit_kind=exit_kind,
        exit_detail=exit_detail[:MAX_STRING_CHARS] if exit_detail else None,
        stacks=last_stacks(stacks),
        notes=list(snapshot.notes)[:MAX_NOTES],
        startup_phase=snapshot.startup_phase,
    )


def _error_line(text: str) -> str:
    """A failed op's error as the summary keeps it: the first line, at most MAX_ERROR_CHARS."""
    return text.split("\n", 1)[0][:MAX_ERROR_CHARS]


def _int_or_none(value: Any) -> int | None:
    return strict_int(value)  # the one rule for an int read from a file


def _clean_identity(ident: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lo, hi = _INT64
    for key in IDENTITY_KEYS:
        value = ident.get(key)
        kind = type(value)  # not isinstance: a bool is not an int here
        if kind is str:
            out[key] = value[:MAX_IDENTITY_CHARS]
        elif kind is int and lo <= value <= hi:
            out[key] = value
    return out


# -- writing -------------------------------------------------------------------------------


def _document(summary: RankSummary) -> dict[str, Any]:
    table: dict[str, int] = {"": 0}
    strings: list[str] = [""]

    def sid(value: str) -> int:
        i = table.get(value)
        if i is None:
            i = table[value] = len(strings)
            strings.append(value)
        return i

    rows = []
    for e in summary.entries:
        row = []
        for name, kind in ENTRY_COLUMNS:
            value = getattr(e, name)
            if kind == "s":
                row.append(sid(value or ""))
            elif kind == "b":
                row.append(1 if value else 0)
            else:
                row.append(value)
        rows.append(row)
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": RANK_KIND,
        **rank_header(summary),
        "groups": [
            {
                "name": g.name,
                "desc": g.desc,
                "ranks": format_ranks(g.ranks, strides=True) if g.ranks else "",
                "frontier": [
                    g.last_enqueued_collective,
                    g.last_started_collective,
                    g.last_completed_collective,
                    g.last_enqueued_p2p,
                    g.last_completed_p2p,
                ],
                **({"local_peers": True} if g.local_peers else {}),
            }
            for g in summary.groups
        ],
        "columns": list(ENTRY_FIELDS),
        "strings": strings,
        "entries": rows,
    }


def rank_header(summary: RankSummary) -> dict[str, Any]:
    """A rank's identity, failure facts and scalars as both encodings write them (the JSON
    rank summary, the packed host summary's rank item): what ``rank_fields`` reads back."""
    return {
        "rank": summary.rank,
        "world_size": summary.world_size,
        "identity": summary.identity,
        "taken_ns": summary.taken_ns,
        "heartbeat_ns": summary.heartbeat_ns,
        "stalled": summary.stalled,
        "alive": summary.alive,
        "wrapped": summary.wrapped,
        "records_written": summary.records_written,
        "omitted": summary.omitted,
        "exit": {"kind": summary.exit_kind, "detail": summary.exit_detail},
        "startup_phase": summary.startup_phase,
        "stacks": summary.stacks,
        "notes": summary.notes,
        **({"dump_time_ns": summary.dump_time_ns} if summary.dump_time_ns is not None else {}),
    }


def encode(summary: RankSummary) -> bytes:
    """One rank summary as compact JSON (UTF-8)."""
    return json.dumps(_document(summary), separators=(",", ":"), allow_nan=False).encode()


def encode_host(summaries: Sequence[RankSummary], host: str | None = None) -> bytes:
    """A host summary: several rank summaries (one host's ranks) in one document."""
    if len(summaries) > MAX_HOST_RANKS:
        raise ValueError(f"a host summary holds at most {MAX_HOST_RANKS} ranks")
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "kind": HOST_KIND,
        "host": host,
        "ranks": [_document(s) for s in summaries],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def file_name(rank: int) -> str:
    """``rank_<R>.summary.json``: the analyzer takes the rank from the content, people from
    the name."""
    return f"rank_{rank}{SUFFIX}"


# -- reading -------------------------------------------------------------------------------


def looks_like_summary(head: bytes) -> bool:
    """Whether the first bytes of a file are a summary's (the writer puts "format" first)."""
    return bool(_HEAD.match(head))


def decode(data: bytes | str) -> list[RankSummary]:
    """The rank summaries in a document (one for a rank summary, several for a host
    summary). Raises ``SummaryError`` for anything that is not a valid, bounded summary."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise SummaryError(f"summary of {len(raw)} bytes exceeds {MAX_DOCUMENT_BYTES}")
    try:
        doc = json.loads(raw, parse_constant=refuse_constant)
    except RecursionError:
        raise SummaryError("summary nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SummaryError(f"summary is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SummaryError('not an frtools summary (no "format": "frtools-summary")')
    version = doc.get("version")
    if version != VERSION:
        raise SummaryError(
            f"unsupported summary version {version!r} (this frtools reads {VERSION})"
        )
    kind = doc.get("kind")
    if kind == RANK_KIND:
        if len(raw) > MAX_RANK_BYTES:
            raise SummaryError(f"rank summary of {len(raw)} bytes exceeds {MAX_RANK_BYTES}")
        return [_rank(doc)]
    if kind == HOST_KIND:
        ranks = doc.get("ranks")
        if not isinstance(ranks, list):
            raise SummaryError("host summary without a list of ranks")
        if len(ranks) > MAX_HOST_RANKS:
            raise SummaryError(f"host summary of {len(ranks)} ranks exceeds {MAX_HOST_RANKS}")
        out = []
        for i, item in enumerate(ranks):
            if not isinstance(item, dict) or item.get("kind") != RANK_KIND:
                raise SummaryError(f"host summary item {i} is not a rank summary")
            out.append(_rank(item))
        return out
    raise SummaryError(f"unknown summary kind {kind!r} (rank or host)")


def refuse_constant(name: str) -> Any:
    """``json.loads``' ``parse_constant``: NaN and Infinity are no summary's values."""
    raise ValueError(f"{name} is not allowed")


# The checks both encodings' readers (this module and ``summary_packed``) refuse hostile
# values with: each raises ``SummaryError`` with ``what`` in its one line.


def want(cond: bool, what: str) -> None:
    if not cond:
        raise SummaryError(what)


def checked_int(value: Any, what: str, lo: int = _INT64[0], hi: int = _INT64[1]) -> int:
    want(isinstance(value, int) and not isinstance(value, bool), f"{what} is not an integer")
    want(lo <= value <= hi, f"{what} {value} is out of range")
    return value


def optional_int(value: Any, what: str, lo: int = _INT64[0], hi: int = _INT64[1]) -> int | None:
    return None if value is None else checked_int(value, what, lo, hi)


def optional_bool(value: Any, what: str) -> bool | None:
    want(value is None or isinstance(value, bool), f"{what} is not true, false or null")
    return value


def optional_str(value: Any, what: str, limit: int) -> str | None:
    if value is None:
        return None
    want(isinstance(value, str), f"{what} is not a string")
    want(len(value) <= limit, f"{what} is longer than {limit} characters")
    return value


# rank_fields' integer fields: (key, default when absent, lower bound, nullable)
_RANK_INTS = (
    ("taken_ns", None, 0, False),
    ("heartbeat_ns", None, 0, True),
    ("dump_time_ns", None, 0, True),
    ("records_written", 0, 0, False),
    ("omitted", 0, 0, False),
)


def rank_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """A rank's identity, failure facts and scalars, checked: the fields the JSON rank
    summary and the packed host summary's rank header share (each adds its groups and ops).

    A fleet's central step checks 131,072 of these: a header that passes the plain checks
    of ``_plain_rank_fields`` is taken at once; any other is checked field by field, which
    names what is wrong."""
    return _plain_rank_fields(doc) or _checked_rank_fields(doc)


# identity values and the ends a plain header's fields lie in (``_plain_rank_fields``)
_IDENTITY_SET = frozenset(IDENTITY_KEYS)
_WORLD_TOP = MAX_WORLD_SIZE
_ENDINGS: list[frozenset[str]] = []  # EXIT_KINDS and STARTUP_PHASES, once imported


def endings() -> tuple[frozenset[str], frozenset[str]]:
    """The exit kinds and start-up phases a rank may state (``model.trace``'s, imported
    on first use: it needs pyarrow, which a training process's path does not)."""
    if not _ENDINGS:
        from frtools.model.trace import EXIT_KINDS, STARTUP_PHASES

        _ENDINGS.extend((frozenset(EXIT_KINDS), frozenset(STARTUP_PHASES)))
    return _ENDINGS[0], _ENDINGS[1]


def _plain_rank_fields(doc: dict[str, Any]) -> dict[str, Any] | None:
    """``rank_fields`` of a header with nothing unusual in it (what every writer of this
    project writes), without building an error text per check; None for any other header,
    which ``_checked_rank_fields`` then refuses or reads."""
    exit_kinds, phases = endings()
    get = doc.get
    rank, world = get("rank"), get("world_size")
    if type(rank) is not int or not 0 <= rank < _WORLD_TOP:
        return None
    if world is not None and (type(world) is not int or not rank < world <= _WORLD_TOP):
        return None
    ident = get("identity") or {}
    if type(ident) is not dict or not _IDENTITY_SET.issuperset(ident):
        return None
    lo, hi = _INT64
    for value in ident.values():
        kind = type(value)
        if not (
            (kind is str and len(value) <= MAX_IDENTITY_CHARS)
            or (kind is int and lo <= value <= hi)
        ):
            return None
    exit_ = get("exit") or {}
    if type(exit_) is not dict:
        return None
    exit_kind, detail = exit_.get("kind"), exit_.get("detail")
    if exit_kind is not None and (type(exit_kind) is not str or exit_kind not in exit_kinds):
        return None
    if detail is not None and (type(detail) is not str or len(detail) > MAX_STRING_CHARS):
        return None
    if get("notes"):  # a rank with notes is rare: read field by field
        return None
    out: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "identity": {k: ident[k] for k in IDENTITY_KEYS if k in ident},
    }
    for key, default, low, nullable in _RANK_INTS:
        value = get(key, default)
        if type(value) is int:
            if not low <= value <= hi:
                return None
        elif value is not None or not nullable:
            return None
        out[key] = value
    for key in ("stalled", "alive", "wrapped"):
        value = get(key)
        if value is not None and type(value) is not bool:
            return None
        out[key] = value
    out["wrapped"] = bool(out["wrapped"])
    stacks, phase = get("stacks"), get("startup_phase")
    if stacks is not None and (type(stacks) is not str or len(stacks) > MAX_STACKS_CHARS):
        return None
    if phase is not None and (type(phase) is not str or phase not in phases):
        return None
    out["exit_kind"] = exit_kind
    out["exit_detail"] = detail
    out["stacks"] = stacks
    out["notes"] = []
    out["startup_phase"] = phase
    return out


def _checked_rank_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """``rank_fields`` field by field: what refuses a header, with the reason."""
    from frtools.model.trace import EXIT_KINDS, STARTUP_PHASES  # pyarrow: not in a training
    # process's path

    get = doc.get
    rank = checked_int(get("rank"), "rank", 0, MAX_WORLD_SIZE - 1)
    world = optional_int(get("world_size"), "world_size", 1, MAX_WORLD_SIZE)
    want(world is None or rank < world, f"rank {rank} is not below world_size {world}")
    ident_raw = get("identity") or {}
    want(type(ident_raw) is dict, "identity is not an object")
    exit_raw = get("exit") or {}
    want(type(exit_raw) is dict, "exit is not an object")
    exit_kind = optional_str(exit_raw.get("kind"), "exit.kind", 32)
    want(exit_kind is None or exit_kind in EXIT_KINDS, f"unknown exit kind {exit_kind!r}")
    notes = get("notes") or []
    want(type(notes) is list and len(notes) <= MAX_NOTES, "notes is not a short list")
    out: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "identity": _clean_identity(ident_raw),
    }
    hi = _INT64[1]
    for key, default, lo, nullable in _RANK_INTS:
        value = get(key, default)
        if type(value) is not int or not lo <= value <= hi:
            value = (optional_int if nullable else checked_int)(value, key, lo)
        out[key] = value
    for key in ("stalled", "alive", "wrapped"):
        value = get(key)
        want(value is None or type(value) is bool, f"{key} is not true, false or null")
        out[key] = value
    out["wrapped"] = bool(out["wrapped"])
    out["exit_kind"] = exit_kind
    out["exit_detail"] = optional_str(exit_raw.get("detail"), "exit.detail", MAX_STRING_CHARS)
    out["stacks"] = optional_str(get("stacks"), "stacks", MAX_STACKS_CHARS)
    out["notes"] = [optional_str(n, "a note", MAX_NOTE_CHARS) or "" for n in notes] if notes else []
    phase = get("startup_phase")
    want(phase is None or phase in STARTUP_PHASES, f"unknown start-up phase {str(phase)[:32]!r}")
    out["startup_phase"] = phase
    return out


def _rank(doc: dict[str, Any]) -> RankSummary:
    fields = rank_fields(doc)
    strings = doc.get("strings")
    want(isinstance(strings, list) and len(strings) >= 1, "strings is not a list")
    want(len(strings) <= MAX_STRINGS, f"more than {MAX_STRINGS} strings")
    for s in strings:
        want(isinstance(s, str) and len(s) <= MAX_STRING_CHARS, "a string is too long or not one")
    want(strings[0] == "", "strings[0] must be the empty string")
    groups = _groups(doc.get("groups"))
    return RankSummary(**fields, groups=groups, entries=_entries(doc, strings, len(groups)))


def _groups(raw: Any) -> list[SummaryGroup]:
    want(isinstance(raw, list), "groups is not a list")
    want(len(raw) <= MAX_GROUPS, f"more than {MAX_GROUPS} groups")
    out = []
    for i, g in enumerate(raw):
        want(isinstance(g, dict), f"group {i} is not an object")
        name = optional_str(g.get("name"), f"group {i} name", MAX_IDENTITY_CHARS) or ""
        desc = optional_str(g.get("desc"), f"group {i} desc", MAX_IDENTITY_CHARS) or ""
        text = optional_str(g.get("ranks"), f"group {i} ranks", MAX_STRING_CHARS) or ""
        try:
            ranks = parse_ranks(text)
        except RankTextError as e:
            raise SummaryError(f"group {i} ranks: {e}") from None
        frontier = g.get("frontier")
        want(isinstance(frontier, list) and len(frontier) == 5, f"group {i} frontier")
        f = [checked_int(v, f"group {i} frontier", -1) for v in frontier]
        local = optional_bool(g.get("local_peers"), f"group {i} local_peers")
        out.append(SummaryGroup(name, desc, ranks, *f, local_peers=bool(local)))
    return out


def _entries(doc: dict[str, Any], strings: list[str], n_groups: int) -> list[SummaryEntry]:
    columns = doc.get("columns")
    want(isinstance(columns, list) and all(isinstance(c, str) for c in columns), "columns")
    where = {name: i for i, name in enumerate(columns)}
    missing = [
        name for name in ("record_id", "op", "state", "time_created_ns") if name not in where
    ]
    want(not missing, f"columns lack {', '.join(missing)}")
    rows = doc.get("entries")
    want(isinstance(rows, list), "entries is not a list")
    want(len(rows) <= MAX_ENTRIES, f"more than {MAX_ENTRIES} entries")
    n_strings = len(strings)
    out = []
    for k, row in enumerate(rows):
        want(isinstance(row, list) and len(row) == len(columns), f"entry {k} has the wrong shape")
        values: dict[str, Any] = {}
        for name, kind in ENTRY_COLUMNS:
            i = where.get(name)
            value = None if i is None else row[i]
            what = f"entry {k} {name}"
            if kind == "s":
                idx = checked_int(0 if value is None else value, what, 0, n_strings - 1)
                values[name] = strings[idx]
            elif kind == "b":
                values[name] = bool(checked_int(0 if value is None else value, what, 0, 1))
            elif kind == "i":
                values[name] = checked_int(0 if value is None else value, what)
            elif kind == "n":
                values[name] = optional_int(value, what)
            else:
                want(
                    value is None
                    or (isinstance(value, (int, float)) and not isinstance(value, bool)),
                    f"{what} is not a number",
                )
                values[name] = None if value is None else float(value)
        want(values["state"] in _STATES, f"entry {k} state {values['state']!r} is unknown")
        want(values["retired"] in (None, 0, 1), f"entry {k} retired is not 0, 1 or null")
        want(-1 <= values["group"] < max(n_groups, 1) or n_groups == 0, f"entry {k} group")
        if values["group"] >= n_groups:
            values["group"] = -1
        out.append(SummaryEntry(**values))
    return out


def renumbered(
    summary: RankSummary, rank: int, world_size: int, groups: Iterable[tuple[int, ...]]
) -> RankSummary:
    """The same summary speaking for ``rank`` of ``world_size``, with new member lists for
    its groups (in order): for a job whose ranks were renumbered (a group rebuilt without
    some members). The caller maps P2P peers itself (they depend on each op's group)."""
    new_groups = [replace(g, ranks=tuple(r)) for g, r in zip(summary.groups, groups, strict=True)]
    return replace(summary, rank=rank, world_size=world_size, groups=new_groups)
