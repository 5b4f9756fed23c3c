"""PyTorch Flight Recorder dumps: the one owner of their keys, versions and meaning.

A dump is a dict PyTorch pickles (``_dump_fr_trace``, ``_dump_nccl_trace``) or writes as
JSON (``_dump_fr_trace_json``): ``version``, ``pg_config``, ``pg_status``,
``comm_lib_version`` and ``entries``, one dict per recorded op. Which keys exist depends on
the version (``ENTRY_KEY_HISTORY``, ``TOP_LEVEL_KEY_HISTORY``; docs/dump-formats.md).

* This module: the keys by version, the grammar of the values that have one (member lists,
  P2P profiling names) and what a writer needs (``frtools synth``, ``frtools convert``):
  ``ENTRY_KEYS`` in PyTorch's order, ``pg_config_entry``, ``pg_status_entry``,
  ``p2p_profiling_name``, ``dump_dict`` and ``pickle_dump`` write what torch 2.13 writes
  (version ``WRITE_VERSION``). Plain Python: collectors and writers import it without
  numpy or pyarrow.
* ``torch_fr.normalize``: reading. ``normalize`` turns a parsed dump (plain dicts and lists,
  any version 1.x … 2.x) into the Trace's entry columns and what the top level says;
  ``native_columns`` does the same from the native pickle parser's columns, and
  ``entries_table`` makes one table of one or many files' columns.
"""

from __future__ import annotations

import ast
import json
import pickle
import re
from collections.abc import Iterable
from typing import Any

from frtools.model.ops import P2P_OPS
from frtools.model.ranks import MAX_WORLD_SIZE, MemberCache

# PyTorch's default dump file name (``TORCH_FR_DUMP_TEMP_FILE`` /
# ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, under /tmp) without the rank; ``torchfrtrace`` reads a
# common prefix followed by the rank
DUMP_FILE_PREFIX = "nccl_trace_rank_"
WRITE_VERSION = "2.10"  # what frtools writes: torch 2.13's FlightRecorder::dump
# profiling-name prefixes of the NCCL engines (ProcessGroupNCCL; torch 2.15's nccl2 through
# the c10d FlightRecorderHook): their ops run on one GPU stream per group, and their
# pg_status counters follow the watchdog (or the hook)
NCCL_ENGINES = ("nccl:", "nccl2:")
PICKLE_PROTOCOL = 2  # TorchScript's pickler, which writes PyTorch's dumps

# --- keys, by version ----------------------------------------------------------------------
#
# (version, keys added, keys removed), oldest first. "Minor when adding fields, major when
# changing existing fields" (PyTorch's rule); docs/dump-formats.md says where each row was
# verified. ``duration_ms`` is written only once a duration was measured; ``nccl_comm_state``
# (1.4 on, only when NCCL gave one) is not listed: no reader uses it.

ENTRY_KEY_HISTORY: tuple[tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]], ...] = (
    (
        (1, 0),
        (
            "pg_id",
            "seq_id",
            "profiling_name",
            "time_created_ns",
            "duration_ms",
            "input_sizes",
            "output_sizes",
            "state",
            "time_discovered_started_ns",
            "time_discovered_completed_ns",
            "retired",
            "frames",
        ),
        (),
    ),
    ((1, 4), ("record_id", "op_id"), ()),
    # one counter per group becomes two; the group's (name, desc) and dtypes appear
    (
        (2, 0),
        (
            "process_group",
            "collective_seq_id",
            "p2p_seq_id",
            "is_p2p",
            "input_dtypes",
            "output_dtypes",
        ),
        ("seq_id",),
    ),
    ((2, 2), ("timeout_ms",), ()),
    ((2, 10), ("thread_id", "thread_name"), ()),
)
TOP_LEVEL_KEY_HISTORY: tuple[tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]], ...] = (
    ((1, 0), ("version", "entries"), ()),
    # 1.4: {pg_id: [global ranks]}; 2.0 on: {name: {"name", "desc", "ranks": "[0, 1]"}}
    ((1, 4), ("pg_config",), ()),
    ((2, 3), ("pg_status",), ()),
    ((2, 7), ("nccl_version",), ()),
    ((2, 10), ("comm_lib_version",), ("nccl_version",)),
)

# the order PyTorch writes the keys in (torch 2.13; older keys where they stood)
_ENTRY_ORDER = (
    "frames",
    "record_id",
    "pg_id",
    "process_group",
    "thread_name",
    "thread_id",
    "seq_id",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "time_created_ns",
    "duration_ms",
    "input_sizes",
    "input_dtypes",
    "output_sizes",
    "output_dtypes",
    "state",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "retired",
    "timeout_ms",
    "is_p2p",
)
_TOP_LEVEL_ORDER = (
    "version",
    "pg_config",
    "nccl_version",
    "comm_lib_version",
    "pg_status",
    "entries",
)


def version_tuple(version: str) -> tuple[int, int]:
    """``"2.10"`` -> ``(2, 10)``; an unversioned (or unreadable) dump is ``(1, 0)``."""
    major, _, minor = str(version).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return (1, 0)


def _keys_at(
    history: tuple[tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]], ...],
    order: tuple[str, ...],
    version: str,
) -> tuple[str, ...]:
    at = version_tuple(version)
    keys: set[str] = set()
    for since, added, removed in history:
        if since <= at:
            keys = (keys | set(added)) - set(removed)
    return tuple(k for k in order if k in keys)


def entry_keys(version: str) -> tuple[str, ...]:
    """The keys an entry of dump ``version`` has, in PyTorch's order."""
    return _keys_at(ENTRY_KEY_HISTORY, _ENTRY_ORDER, version)


def top_level_keys(version: str) -> tuple[str, ...]:
    """The top-level keys of a dump of ``version``, in PyTorch's order."""
    return _keys_at(TOP_LEVEL_KEY_HISTORY, _TOP_LEVEL_ORDER, version)


ENTRY_KEYS = entry_keys(WRITE_VERSION)
# every entry key the readers use, any version (the native parser has the same list)
READ_KEYS = tuple(
    k for k in _ENTRY_ORDER if k != "op_id" and any(k in a for _, a, _ in ENTRY_KEY_HISTORY)
)
STATUS_KEYS = ("last_enqueued_collective", "last_started_collective", "last_completed_collective")

# --- values that have a format of their own ----------------------------------------------

# (a group-local rank has at most as many digits as the largest world's)
_SEND = re.compile(r"^\s*(-?\d{1,12})\s*->\s*(-?\d{1,12})\s*$")
_RECV = re.compile(r"^\s*(-?\d{1,12})\s*<-\s*(-?\d{1,12})\s*$")


def p2p_profiling_name(name: str, me: int, peer: int) -> str:
    """PyTorch spells P2P ops with group-local ranks: ``nccl:send 0->1``, ``nccl:recv 1<-0``
    (``name`` is the op as ``backend:op``; other ops are left as they are)."""
    op = name.rpartition(":")[2]
    if op == "send":
        return f"{name} {me}->{peer}"
    if op == "recv":
        return f"{name} {me}<-{peer}"
    return name


def parse_profiling_name(profiling_name: str) -> tuple[str, int | None]:
    """``nccl:send 0->1`` -> ``("send", 1)``; ``nccl:recv 1<-0`` -> ``("recv", 0)``: the op and
    the group-local peer."""
    name = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    op, _, meta = name.partition(" ")
    if meta and op in P2P_OPS:
        m = (_SEND if op == "send" else _RECV).match(meta)
        if m:
            return op, int(m.group(2))
    return op, None


def member_list_text(ranks: Iterable[int]) -> str:
    """``pg_config``'s ``ranks`` value: the global ranks as ``str(list)``, ``"[0, 1, 2]"``."""
    return "[" + ", ".join(map(str, ranks)) + "]"


# longest member-list text of MAX_WORLD_SIZE ranks ("1048575, " per rank)
_MAX_MEMBER_TEXT = MAX_WORLD_SIZE * (len(str(MAX_WORLD_SIZE)) + 2) + 2


def parse_member_list(value: Any) -> tuple[int, ...] | str | None:
    """A group's members as ``pg_config`` gives them: ``"[0, 1, 2]"`` (2.0 on) or a list
    (1.4) -> ``(0, 1, 2)``; ``"all"`` stays ``"all"``; anything else -> ``None``.

    Parsed as JSON or a Python literal, never evaluated; a list of more than
    ``MAX_WORLD_SIZE`` ranks, or a rank outside ``0 … MAX_WORLD_SIZE-1``, is refused
    (``None``) before it is built.
    """
    if isinstance(value, str):
        # every rank's dump repeats the same member lists (1,024 ranks each for the
        # default group of a 1,024-rank job): parse each distinct text once
        return _parse_member_text(value)
    return _parse_members(value)


_MEMBER_TEXTS = MemberCache()


def _parse_member_text(value: str) -> tuple[int, ...] | str | None:
    if len(value) > _MAX_MEMBER_TEXT:
        return None
    return _MEMBER_TEXTS.get(value, lambda: _parse_members(value))


def _parse_members(value: Any) -> tuple[int, ...] | str | None:
    if isinstance(value, (list, tuple)):
        seq = value
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() == "all":
            return "all"
        try:
            seq = json.loads(text)
        except ValueError:
            try:
                seq = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
    else:
        return None
    if not isinstance(seq, (list, tuple)) or len(seq) > MAX_WORLD_SIZE:
        return None
    try:
        ranks = tuple(sorted({int(r) for r in seq}))
    except (TypeError, ValueError):
        return None
    if ranks and (ranks[0] < 0 or ranks[-1] >= MAX_WORLD_SIZE):
        return None
    return ranks


# --- writing -------------------------------------------------------------------------------


def pg_config_entry(name: str, desc: str, ranks_text: str) -> dict[str, str]:
    """One group of ``pg_config`` (2.0 on); ``ranks_text`` from ``member_list_text``."""
    return {"name": name, "desc": desc, "ranks": ranks_text}


def pg_status_entry(enqueued: int, started: int, completed: int) -> dict[str, int]:
    """One group of ``pg_status``: its last enqueued / started / completed collective."""
    return dict(zip(STATUS_KEYS, (enqueued, started, completed), strict=True))


def dump_dict(
    pg_config: dict[str, Any],
    pg_status: dict[str, Any],
    entries: list[dict[str, Any]],
    comm_lib_version: str = "",
) -> dict[str, Any]:
    """A whole dump of version ``WRITE_VERSION``, top-level keys in PyTorch's order. Entries
    have ``ENTRY_KEYS`` in that order, ``duration_ms`` only where one was measured."""
    return {
        "version": WRITE_VERSION,
        "pg_config": pg_config,
        "comm_lib_version": comm_lib_version,
        "pg_status": pg_status,
        "entries": entries,
    }


def pickle_dump(dump: dict[str, Any]) -> bytes:
    """The bytes of a dump file, pickled as PyTorch pickles it."""
    return pickle.dumps(dump, protocol=PICKLE_PROTOCOL)
