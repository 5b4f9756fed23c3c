"""Read, copy, poke and write frtools black boxes without torch and without the native module.

The black box (``frtools.recorder._blackbox``) writes one memory-mapped file per rank; this
module is its other half: the layout below mirrors ``_native/blackbox.cpp`` and is written
down in docs/snapshot-format.md. Slots are parsed with numpy in one go (no per-slot Python),
because the analyzer reads thousands of these files.

* ``read_snapshot(path_or_bytes)`` parses a file (live or dead) into a ``Snapshot``; slots
  whose sequence counter says they were being written are dropped and counted.
* ``copy_consistent(src, dst)`` copies a live file so that the copy parses: the slots are
  copied between two reads of their sequence counters and re-copied (or marked torn) where a
  writer got in between.
* ``request_dump(path)`` / ``dump_acknowledged(path, seq)`` talk to the rank's native
  watchdog through the mapping: it answers by writing every thread's Python stack.
* ``Snapshot.ending(alive)`` and ``owner_alive(header)`` say how the writing process ended
  (version 2 records it; a box nobody closed whose process is gone was killed).
* ``pack_header``, ``file_offsets`` and ``StringTable`` are the writer's side, for files not
  written by the native black box (``frtools synth``): the layout exists once in Python.

A black box is hostile until proven otherwise (docs/security.md): the header's regions must
lie where the layout puts them, the ring, the group table and the strings are bounded by
``frtools.formats.limits`` (slots, groups, string bytes, text bytes, members), slots are read
in chunks, files are opened without following a planted link or waiting on a FIFO, and a
big sparse file is refused. A refusal is a ``SnapshotError`` naming the limit.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import socket
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from frtools.formats import limits
from frtools.formats.limits import InputRefused, open_regular
from frtools.formats.private_files import new_file
from frtools.model.ranks import (
    MAX_WORLD_SIZE,
    RankTextError,
    parse_ranks,
    valid_rank,
    valid_world_size,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_LAYOUT",
    "HEADER_OFFSETS",
    "IDENTITY_OFFSET",
    "MAGIC",
    "EXIT_KIND_NAMES",
    "FLAG_FAILED",
    "PAGE",
    "PG_DTYPE",
    "PHASE_NAMES",
    "READABLE_VERSIONS",
    "SLOT_DTYPE",
    "STATE_NAMES",
    "STRING_FULL",
    "Snapshot",
    "SnapshotError",
    "SnapshotGroup",
    "StringTable",
    "copy_consistent",
    "dump_acknowledged",
    "file_offsets",
    "owner_alive",
    "pack_header",
    "parse_splits",
    "read_header",
    "read_snapshot",
    "request_dump",
    "signal_name",
    "splits_text",
]

MAGIC = b"FRTBOX\x00\x01"
FORMAT_VERSION = 3
# versions this reader reads: 1 lacks the failure facts, 2 the start-up phases (their bytes
# there are zero)
READABLE_VERSIONS = (1, 2, 3)
HEADER_BYTES = 4096
IDENTITY_OFFSET = 512
STRING_NONE = 0
STRING_FULL = 0xFFFFFFFF
STRING_FULL_TEXT = "<string table full>"
STRING_MISSING_TEXT = "<missing string>"

# state byte of a slot -> name (0 = never written)
STATE_NAMES = ("", "scheduled", "started", "completed")
# bits of a slot's flags
FLAG_CUDA_DURATION = 1  # duration_ms came from CUDA events
FLAG_FAILED = 2  # the op failed: ``error`` says how, ``time_failed_ns`` when

# header startup_phase -> the Trace's start-up phase (frtools.model.trace.STARTUP_PHASES); each
# phase's entry time is the header's ``phase_<name>_ns``. 0: not recorded (a box older than
# version 3, or one opened at the first group by an ``enable()`` without the launcher's env)
PHASE_NAMES = ("", "started", "init", "rendezvous", "connect", "ready")

# header exit_kind -> the Trace's exit kind (frtools.model.trace.EXIT_KINDS); 0: not recorded
EXIT_KIND_NAMES = ("", "clean", "exit", "exception", "os_exit", "signal")

# The header's fixed fields in file order: (name, struct code). Little-endian at natural
# alignment with no padding, as ``struct Header`` in _native/blackbox.cpp lays them out.
HEADER_LAYOUT = (
    ("magic", "8s"),
    ("version", "I"),
    ("header_bytes", "I"),
    ("slot_bytes", "I"),
    ("capacity", "I"),
    ("pg_entry_bytes", "I"),
    ("pg_capacity", "I"),
    ("pg_offset", "Q"),
    ("slots_offset", "Q"),
    ("strings_offset", "Q"),
    ("strings_bytes", "Q"),
    ("file_bytes", "Q"),
    ("created_ns", "q"),
    ("next_record_id", "Q"),
    ("strings_used", "Q"),
    ("pg_count", "I"),
    ("string_count", "I"),
    ("heartbeat_ns", "q"),
    ("stalled", "I"),
    ("watchdog_state", "I"),
    ("stall_record_id", "q"),
    ("stall_time_ns", "q"),
    ("dump_request_seq", "Q"),
    ("dump_ack_seq", "Q"),
    ("dump_ack_time_ns", "q"),
    ("dump_ack_status", "I"),
    ("closed", "I"),
    ("strings_dropped", "I"),
    ("identity_bytes", "I"),
    ("stall_seconds", "d"),
    ("poll_ms", "I"),
    ("stack_signal", "I"),
    ("owner_pid", "q"),
    # version 2: how the process ended, failed ops
    ("exit_kind", "I"),
    ("exit_status", "i"),
    ("exit_time_ns", "q"),
    ("exit_detail", "I"),
    ("exit_stack", "I"),
    ("ops_failed", "I"),
    ("thread_error", "I"),
    ("exit_watched", "I"),
    # version 3: the start-up phases (a box opened when the process starts, before any group)
    ("startup_phase", "I"),
    ("identity_update", "I"),
    ("startup_failed", "I"),
    ("phase_started_ns", "q"),
    ("phase_init_ns", "q"),
    ("phase_rendezvous_ns", "q"),
    ("phase_connect_ns", "q"),
    ("phase_ready_ns", "q"),
)
_HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_LAYOUT))
_HEADER_FIELDS = tuple(name for name, _ in HEADER_LAYOUT)
# byte offset of each header field
HEADER_OFFSETS = {
    name: struct.calcsize("<" + "".join(code for _, code in HEADER_LAYOUT[:i]))
    for i, (name, _) in enumerate(HEADER_LAYOUT)
}
_DUMP_REQUEST_OFFSET = HEADER_OFFSETS["dump_request_seq"]
_DUMP_ACK_OFFSET = HEADER_OFFSETS["dump_ack_seq"]

SLOT_DTYPE = np.dtype(
    {
        "names": [
            "seq",
            "record_id",
            "collective_seq_id",
            "p2p_seq_id",
            "time_created_ns",
            "time_started_ns",
            "time_completed_ns",
            "duration_ms",
            "thread_id",
            "pg",
            "peer",
            "op",
            "input_sizes",
            "output_sizes",
            "input_dtypes",
            "output_dtypes",
            "stack",
            "state",
            "is_p2p",
            "flags",
            "thread_name",
            "error",
            "splits",
            "time_failed_ns",
        ],
        "formats": [
            "<u8",
            "<i8",
            "<i8",
            "<i8",
            "<i8",
            "<i8",
            "<i8",
            "<f8",
            "<u8",
            "<i4",
            "<i4",
            "<u4",
            "<u4",
            "<u4",
            "<u4",
            "<u4",
            "<u4",
            "u1",
            "u1",
            "<u2",
            "<u4",
            "<u4",
            "<u4",
            "<i8",
        ],
        "offsets": [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 76, 80, 84, 88, 92, 96, 100, 104, 105]
        + [106, 108, 112, 116, 120],
        "itemsize": 128,
    }
)

PG_DTYPE = np.dtype(
    {
        "names": [
            "name",
            "desc",
            "ranks",
            "size",
            "last_enqueued_collective",
            "last_started_collective",
            "last_completed_collective",
            "last_enqueued_p2p",
            "last_completed_p2p",
        ],
        "formats": ["<u4", "<u4", "<u4", "<u4", "<i8", "<i8", "<i8", "<i8", "<i8"],
        "offsets": [0, 4, 8, 12, 16, 24, 32, 40, 48],
        "itemsize": 64,
    }
)

# string-id columns of a slot
STRING_COLUMNS = (
    "op",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "stack",
    "thread_name",
    "error",
    "splits",  # all_to_all: "<input splits>/<output splits>" (``parse_splits``); 0 elsewhere
)


# most members a split list may name (a larger list is not the box's: its field is ignored)
MAX_SPLIT_MEMBERS = 1 << 16


def splits_text(input_splits: Any, output_splits: Any) -> str:
    """The text the ``splits`` field of an all_to_all slot interns: element counts per
    member, in group-rank order, input (sent) then output (received): ``"6,2,0/4,4,0"``."""
    return ",".join(map(str, input_splits)) + "/" + ",".join(map(str, output_splits))


def parse_splits(text: str) -> tuple[list[int], list[int]] | None:
    """``splits_text``'s inverse; None for text that is not two lists of counts (a hostile
    or truncated field is not an error of the file: the op just has no splits)."""
    if not text or text.count("/") != 1 or len(text) > 24 * MAX_SPLIT_MEMBERS:
        return None
    sent, received = text.split("/")
    try:
        ins = [int(v) for v in sent.split(",")] if sent else []
        outs = [int(v) for v in received.split(",")] if received else []
    except ValueError:
        return None
    if any(v < 0 or v >= 2**63 for v in ins + outs):
        return None
    return ins, outs


PAGE = 4096  # the slot ring starts on a page boundary
STRINGS_RESERVED = 8  # string ids below this are not strings (0: none)


def file_offsets(capacity: int, pg_capacity: int) -> tuple[int, int, int]:
    """``(pg_offset, slots_offset, strings_offset)`` of a file with these tables, as the
    native black box lays it out: header, process-group table, page-aligned slot ring,
    string area."""
    pg_offset = HEADER_BYTES
    slots_offset = pg_offset + pg_capacity * PG_DTYPE.itemsize
    slots_offset += -slots_offset % PAGE
    return pg_offset, slots_offset, slots_offset + capacity * SLOT_DTYPE.itemsize


def pack_header(**fields: Any) -> bytes:
    """The header's fixed fields as bytes, for a writer other than the native black box
    (the simulator). Fields not given are 0; the format's own (``magic``, ``version``,
    ``header_bytes``, ``slot_bytes``, ``pg_entry_bytes``) default to this format's."""
    unknown = fields.keys() - set(_HEADER_FIELDS)
    if unknown:
        raise TypeError(f"not a header field: {', '.join(sorted(unknown))}")
    values = {
        "magic": MAGIC,
        "version": FORMAT_VERSION,
        "header_bytes": HEADER_BYTES,
        "slot_bytes": SLOT_DTYPE.itemsize,
        "pg_entry_bytes": PG_DTYPE.itemsize,
        **fields,
    }
    return _HEADER.pack(*(values.get(name, 0) for name in _HEADER_FIELDS))


class StringTable:
    """The writer's side of the string area: a string's id is the byte offset of its
    ``u32 length`` + UTF-8 bytes, padded to 4 bytes; ids below ``STRINGS_RESERVED`` are not
    strings (0: none). ``buf`` is the area's used part; the reader decodes it with
    ``Snapshot.string``."""

    def __init__(self) -> None:
        self.buf = bytearray(STRINGS_RESERVED)
        self.ids: dict[str, int] = {"": STRING_NONE}

    def id(self, text: str) -> int:
        sid = self.ids.get(text)
        if sid is None:
            raw = text.encode()
            sid = len(self.buf)
            self.buf += struct.pack("<I", len(raw)) + raw
            self.buf += b"\0" * (-len(self.buf) % 4)
            self.ids[text] = sid
        return sid


class SnapshotError(ValueError):
    """The file is not a usable frtools snapshot; the message is a one-line reason."""


@dataclass
class SnapshotGroup:
    """One row of the process-group table; ``ranks`` are global ranks."""

    index: int
    name: str
    desc: str
    ranks: tuple[int, ...]
    last_enqueued_collective: int
    last_started_collective: int
    last_completed_collective: int
    last_enqueued_p2p: int
    last_completed_p2p: int


@dataclass
class Snapshot:
    """One rank's black box as read from a file.

    ``slots`` holds the readable slots only, sorted by ``record_id`` (a numpy structured
    array with ``SLOT_DTYPE``); string columns are ids, resolved with ``string(id)``.
    """

    header: dict[str, Any]
    identity: dict[str, Any]
    groups: list[SnapshotGroup]
    slots: np.ndarray
    strings_blob: bytes
    torn: int = 0
    notes: list[str] = field(default_factory=list)
    path: str | None = None

    @property
    def version(self) -> int:
        return int(self.header["version"])

    @property
    def capacity(self) -> int:
        return int(self.header["capacity"])

    @property
    def records_written(self) -> int:
        return int(self.header["next_record_id"])

    @property
    def wrapped(self) -> bool:
        """The ring buffer overwrote older records (their record ids are gone)."""
        first = int(self.slots["record_id"][0]) if len(self.slots) else 0
        return self.records_written > self.capacity or first > 0

    @property
    def stalled(self) -> bool:
        return bool(self.header["stalled"])

    @property
    def exit_watched(self) -> bool:
        """The recorder watched how the process ends (version 2: exit facts are recorded)."""
        return bool(self.header.get("exit_watched"))

    def ending(self, alive: bool | None) -> tuple[str | None, str | None]:
        """``(exit kind, detail)`` of the process that wrote this box, as
        ``frtools.model.trace.RankInfo.exit_kind``/``exit_detail`` take them.

        A recorded ending wins (``clean``, ``exit``, ``exception``, ``os_exit``, ``signal``).
        Otherwise the owner's liveness decides — ``alive`` as whoever looked at the process
        saw it (``frtools dump``'s manifest, or ``owner_alive``): alive -> ``running``, gone ->
        ``killed`` (a box nobody closed: SIGKILL, the OOM killer, a lost node). A version-1
        box closed by its process ended ``clean``; one left open tells nothing. ``(None, None)`` when it cannot be told.
        """
        h = self.header
        code = int(h.get("exit_kind", 0))
        kind = EXIT_KIND_NAMES[code] if 0 < code < len(EXIT_KIND_NAMES) else None
        status = int(h.get("exit_status", 0))
        if kind == "exception":
            return kind, self.string(int(h["exit_detail"])) or None
        if kind == "signal":
            return kind, signal_name(status)
        if kind in ("exit", "os_exit"):
            return kind, f"exit status {status}"
        if kind == "clean":
            return kind, None
        if alive is True:
            return "running", None
        if self.version == 1:
            # no exit facts: a box left open says nothing (a version-1 recorder did not
            # always close it on a clean exit either)
            return ("clean", None) if h["closed"] else (None, None)
        if alive is False:
            return "killed", None
        return None, None

    @property
    def startup_phase(self) -> str | None:
        """The last start-up phase the process entered (``PHASE_NAMES``: ``started`` … ``ready``);
        None where the box does not record them (version < 3, or opened at the first group)."""
        code = int(self.header.get("startup_phase", 0)) if self.version >= 3 else 0
        return PHASE_NAMES[code] if 0 < code < len(PHASE_NAMES) else None

    def phase_times(self) -> dict[str, int]:
        """Start-up phase -> when the process entered it (wall clock ns), for those it did."""
        if self.version < 3:
            return {}
        times = {name: int(self.header.get(f"phase_{name}_ns", 0)) for name in PHASE_NAMES[1:]}
        return {name: t for name, t in times.items() if t > 0}

    @property
    def exit_stack(self) -> str:
        """The traceback of the uncaught exception that ended the process, innermost frame
        first (``"file:line in func"`` lines); ``""`` when none was recorded."""
        return self.string(int(self.header.get("exit_stack", 0)))

    @property
    def thread_error(self) -> str:
        """The last uncaught exception of a thread other than the main one (``""``: none)."""
        return self.string(int(self.header.get("thread_error", 0)))

    def string(self, sid: int) -> str:
        """The interned string with id ``sid`` (``""`` for id 0); ``SnapshotError`` for one
        longer than the ``string_bytes`` limit."""
        return _decode_string(self.strings_blob, int(sid), limits.current().string_bytes)

    def strings(self, ids: Any) -> list[str]:
        """The strings of distinct ids, in order; ``SnapshotError`` when one is longer than
        ``string_bytes`` or all of them together longer than ``text_bytes`` (checked from
        their lengths, before any is decoded)."""
        ids = [int(i) for i in ids]
        texts = _decode_many(self.strings_blob, ids, limits.current().string_bytes)
        return [texts[sid] for sid in ids]

    def strings_for(self, ids: np.ndarray) -> dict[int, str]:
        """Decode each distinct id once."""
        uniq = np.unique(ids)
        return dict(zip((int(i) for i in uniq), self.strings(uniq), strict=True))


def pack_file(
    size: int,
    *,
    identity: bytes,
    pgs: np.ndarray,
    ring: np.ndarray,
    strings: bytes,
    **fields: Any,
) -> bytes:
    """A whole file of ``size`` bytes from its tables, for a writer other than the native
    black box (the simulator, tests, benchmarks): the header from ``fields`` (as
    ``pack_header``), the identity, group table, slot ring and string area at the offsets
    the header names. ``size`` is the caller's: a hostile test's header may claim another."""
    head = pack_header(**fields)
    pg_offset, slots_offset = fields["pg_offset"], fields["slots_offset"]
    strings_offset = fields["strings_offset"]
    out = bytearray(size)
    out[: len(head)] = head
    out[IDENTITY_OFFSET : IDENTITY_OFFSET + len(identity)] = identity
    out[pg_offset : pg_offset + pgs.nbytes] = pgs.tobytes()
    out[slots_offset : slots_offset + ring.nbytes] = ring.tobytes()
    out[strings_offset : strings_offset + len(strings)] = strings
    return bytes(out)


def _refused(exc: InputRefused) -> SnapshotError:
    return SnapshotError(str(exc))


def _decode_many(blob: bytes, ids: Any, max_each: int) -> dict[int, str]:
    """Each distinct id decoded once; ``SnapshotError`` when one is longer than ``max_each``
    or all together longer than ``text_bytes`` (checked from their lengths first: string
    entries may overlap, so many ids can each claim most of the area)."""
    lim = limits.current()
    distinct = set(ids)
    total = sum(_string_length(blob, sid) for sid in distinct)
    if total > lim.text_bytes:
        raise _refused(
            limits.exceeded(
                f"its strings hold {limits.size_text(total)} of text", "text_bytes", lim.text_bytes
            )
        )
    return {sid: _decode_string(blob, sid, max_each) for sid in distinct}


def _string_length(blob: bytes, sid: int) -> int:
    """Bytes the string with id ``sid`` holds (0 where it reads as a placeholder)."""
    if sid < STRINGS_RESERVED or sid == STRING_FULL or sid + 4 > len(blob):
        return 0
    (n,) = struct.unpack_from("<I", blob, sid)
    return n if sid + 4 + n <= len(blob) else 0


PID_MAX = 1 << 22  # Linux's largest pid_max


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; ``signal 99`` for a number this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def owner_alive(header: dict[str, Any], identity: dict[str, Any] | None = None) -> bool | None:
    """Whether the process that created this box still runs; None when that cannot be told
    from here (written on another host, no pid, no permission to ask).

    A pid whose process started after the box was created belongs to another process (the
    pid was reused): the owner is gone. A zombie is gone.
    """
    identity = identity or {}
    host = identity.get("host")
    if host and host != socket.gethostname():
        return None
    try:
        pid = int(header.get("owner_pid") or identity.get("pid") or 0)
    except (TypeError, ValueError):
        return None
    if not 0 < pid <= PID_MAX:  # a hostile or corrupt file
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OSError, OverflowError):
        return None
    started_ns = _process_start_ns(pid)
    if started_ns is None:
        return True
    if started_ns < 0:  # zombie
        return False
    created = int(header.get("created_ns") or 0)
    # the boot time is known to the second: allow for it
    return not (created and started_ns > created + 2_000_000_000)


def _process_start_ns(pid: int) -> int | None:
    """Wall-clock start of ``pid`` from /proc (-1: a zombie; None: unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return -1
        ticks = int(fields[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return int((btime + ticks / os.sysconf("SC_CLK_TCK")) * 1e9)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _decode_string(blob: bytes, sid: int, max_bytes: int | None = None) -> str:
    if sid == STRING_NONE:
        return ""
    if sid == STRING_FULL:
        return STRING_FULL_TEXT
    if sid < STRINGS_RESERVED or sid + 4 > len(blob):
        return STRING_MISSING_TEXT
    (n,) = struct.unpack_from("<I", blob, sid)
    end = sid + 4 + n
    if end > len(blob):
        return STRING_MISSING_TEXT
    if max_bytes is not None and n > max_bytes:
        raise _refused(
            limits.exceeded(
                f"string {sid} is {limits.size_text(n)} long", "string_bytes", max_bytes
            )
        )
    return blob[sid + 4 : end].decode("utf-8", errors="replace")


def _parse_header(buf: bytes | memoryview, size: int) -> dict[str, Any]:
    if size < _HEADER.size or bytes(buf[:8]) != MAGIC:
        # the recorder creates the file, sizes it, then writes the header: a reader may come
        # between (zeros where the header goes)
        if size >= 8 and (bytes(buf[:6]) == MAGIC[:6] or not any(buf[: min(size, 64)])):
            raise SnapshotError("frtools snapshot header is incomplete (file being created?)")
        raise SnapshotError("not an frtools snapshot (bad magic)")
    header = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(buf, 0), strict=True))
    if header["version"] not in READABLE_VERSIONS:
        raise SnapshotError(
            f"unsupported frtools snapshot version {header['version']} "
            f"(this frtools reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if header["slot_bytes"] != SLOT_DTYPE.itemsize or header["pg_entry_bytes"] != PG_DTYPE.itemsize:
        raise SnapshotError(
            f"frtools snapshot has slots of {header['slot_bytes']} bytes, expected "
            f"{SLOT_DTYPE.itemsize}"
        )
    if header["header_bytes"] != HEADER_BYTES or header["capacity"] == 0:
        raise SnapshotError("corrupt frtools snapshot header")
    if not 0 < header["pg_capacity"] <= _MAX_PG_CAPACITY:
        raise SnapshotError(
            f"corrupt frtools snapshot header: process-group table of {header['pg_capacity']} rows"
        )
    expected = file_offsets(header["capacity"], header["pg_capacity"])
    got = (header["pg_offset"], header["slots_offset"], header["strings_offset"])
    if got != expected:
        # a black box is laid out by file_offsets; offsets elsewhere (past a sparse hole,
        # overlapping) are no writer's
        raise SnapshotError(
            "corrupt frtools snapshot header: regions not where the layout puts them"
        )
    return header


# the native black box's largest process-group table (its pg_capacity bound)
_MAX_PG_CAPACITY = 1 << 20


def _check_limits(header: dict[str, Any]) -> None:
    """Refuse a header whose ring, group table or string area exceeds the limits."""
    lim = limits.current()
    if header["capacity"] > lim.snapshot_slots:
        raise _refused(
            limits.exceeded(
                f"black box of {header['capacity']:,} slots",
                "snapshot_slots",
                lim.snapshot_slots,
                unit="slots",
            )
        )
    if min(header["pg_count"], header["pg_capacity"]) > lim.snapshot_groups:
        raise _refused(
            limits.exceeded(
                f"black box of {header['pg_count']:,} process groups",
                "snapshot_groups",
                lim.snapshot_groups,
                unit="groups",
            )
        )
    used = min(header["strings_used"], header["strings_bytes"])
    if used > lim.text_bytes:
        raise _refused(
            limits.exceeded(
                f"string area of {limits.size_text(used)}", "text_bytes", lim.text_bytes
            )
        )


def _parse_identity(buf: bytes | memoryview, header: dict[str, Any]) -> tuple[dict, str | None]:
    n = header["identity_bytes"]
    raw = bytes(buf[IDENTITY_OFFSET : IDENTITY_OFFSET + min(n, HEADER_BYTES - IDENTITY_OFFSET)])
    if not raw:
        return {}, None
    try:
        identity = json.loads(raw)
    except ValueError:
        return {}, "identity in the header is not valid JSON"
    if not isinstance(identity, dict):
        return {}, "identity in the header is not a JSON object"
    return _checked_identity(identity)


def _updated_identity(
    identity: dict[str, Any], blob: bytes, header: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The identity as the recorder restated it at the first process group (version 3: a box
    opened at process start learns its backend and device then), merged over the header's.
    An update that is no JSON object, or names another rank, is ignored with a note."""
    try:
        update = json.loads(
            _decode_string(blob, int(header["identity_update"]), limits.current().string_bytes)
        )
    except (ValueError, SnapshotError):
        return identity, "the identity update in the string table is not valid JSON; ignored"
    if not isinstance(update, dict):
        return identity, "the identity update is not a JSON object; ignored"
    if identity.get("rank") is not None and update.get("rank") != identity.get("rank"):
        return identity, "the identity update names another rank; ignored"
    return _checked_identity({**identity, **update})


def _checked_identity(identity: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    # numbers another process wrote: a rank or world size beyond the largest world is no
    # rank (the file is refused) or no world size (ignored)
    rank = _opt_int(identity.get("rank"))
    if identity.get("rank") is not None and (rank is None or not valid_rank(rank)):
        raise SnapshotError(
            f"rank {str(identity.get('rank'))[:24]} in the header identity is not a rank "
            f"(0 … {MAX_WORLD_SIZE - 1})"
        )
    world = identity.get("world_size")
    if world is not None and not valid_world_size(_opt_int(world)):
        del identity["world_size"]
        return identity, (
            f"world_size {str(world)[:24]} in the header identity is beyond the limit of "
            f"{MAX_WORLD_SIZE} ranks; ignored"
        )
    return identity, None


def _opt_int(value: object) -> int | None:
    return limits.strict_int(value)  # the one rule for an int read from a file


# A slot as raw bytes: numpy copies, concatenates and selects a structured array field by
# field, ten times slower than bytes (a 2,000-slot ring: 135 µs a copy, against 11 µs)
_RAW_SLOT = np.dtype((np.void, SLOT_DTYPE.itemsize))


def _as_bytes(slots: np.ndarray) -> np.ndarray:
    return slots.view(_RAW_SLOT)


def _valid_in(raw: np.ndarray, capacity: int, first: int) -> tuple[np.ndarray, int]:
    """The complete and consistent slots of ``raw`` (slots ``first`` … of the ring) and the
    number of torn ones."""
    seq = raw["seq"]
    written = seq != 0
    state = raw["state"]
    rid = raw["record_id"]
    index = np.arange(first, first + len(raw), dtype=np.int64)
    ok = (
        written
        & ((seq & 1) == 0)
        & (state >= 1)
        & (state <= 3)
        & (rid >= 0)
        & (rid % capacity == index)
    )
    torn = int(np.count_nonzero(written & ~ok))
    return (raw if ok.all() else _as_bytes(raw)[ok].view(SLOT_DTYPE)), torn


def _in_order(slots: np.ndarray) -> np.ndarray:
    rid = slots["record_id"]
    if len(rid) > 1:
        # a ring is oldest-first from the slot after the newest: one rotation, no sort
        start = int(np.argmin(rid))
        if start:
            ring = _as_bytes(slots)
            slots = np.concatenate([ring[start:], ring[:start]]).view(SLOT_DTYPE)
            rid = slots["record_id"]
        if not (rid[1:] > rid[:-1]).all():
            slots = _as_bytes(slots)[np.argsort(rid, kind="stable")].view(SLOT_DTYPE)
    return slots


# slots copied and checked at a time (8 MB): a big ring costs one chunk of memory, plus the
# slots that hold records
SLOT_CHUNK = 1 << 16


def _read_slots(buf: bytes | memoryview, offset: int, capacity: int) -> tuple[np.ndarray, int]:
    """The readable slots of the ring, oldest first, and the number of torn ones, read
    ``SLOT_CHUNK`` slots at a time with the seqlock check (a live file)."""
    kept: list[np.ndarray] = []
    torn = 0
    for first in range(0, capacity, SLOT_CHUNK):
        count = min(SLOT_CHUNK, capacity - first)
        live = np.frombuffer(
            buf, dtype=SLOT_DTYPE, count=count, offset=offset + first * SLOT_DTYPE.itemsize
        )
        # seqlock read: a slot whose counter moved while it was copied is torn (a live file)
        before = live["seq"].copy()
        raw = _as_bytes(live).copy().view(SLOT_DTYPE)
        moved = before != live["seq"]
        del live
        if moved.any():
            raw["seq"][moved] |= 1
        good, bad = _valid_in(raw, capacity, first)
        torn += bad
        if len(good):
            kept.append(good if len(good) < len(raw) else raw)
    if len(kept) > 1:
        slots = np.concatenate([_as_bytes(k) for k in kept]).view(SLOT_DTYPE)
    else:
        slots = kept[0] if kept else np.empty(0, SLOT_DTYPE)
    return _in_order(slots), torn


def _parse(buf: bytes | memoryview, size: int, path: str | None) -> Snapshot:
    header = _parse_header(buf, size)
    _check_limits(header)
    lim = limits.current()
    notes: list[str] = []
    identity, why = _parse_identity(buf, header)
    if why:
        notes.append(why)
    capacity = header["capacity"]
    slots_end = header["slots_offset"] + capacity * SLOT_DTYPE.itemsize
    if size < slots_end:
        raise SnapshotError(
            f"truncated frtools snapshot: {size} bytes, the slots end at byte {slots_end}"
        )
    slots, torn = _read_slots(buf, header["slots_offset"], capacity)
    if torn:
        notes.append(f"dropped {torn} torn slot(s) (being written when the file was read)")

    strings_used = min(header["strings_used"], header["strings_bytes"])
    s0 = header["strings_offset"]
    strings_blob = bytes(buf[s0 : min(s0 + strings_used, size)])
    if len(strings_blob) < strings_used:
        notes.append("string table truncated: some names show as <missing string>")
    if header["strings_dropped"]:
        notes.append(f"string table was full: {header['strings_dropped']} string(s) not stored")
    if header["version"] >= 3 and header["identity_update"]:
        identity, why = _updated_identity(identity, strings_blob, header)
        if why:
            notes.append(why)

    pg_count = min(header["pg_count"], header["pg_capacity"])
    pg_end = header["pg_offset"] + pg_count * PG_DTYPE.itemsize
    if size < pg_end:
        raise SnapshotError("truncated frtools snapshot: process-group table cut off")
    pg_rows = np.frombuffer(buf, dtype=PG_DTYPE, count=pg_count, offset=header["pg_offset"])
    rows = pg_rows.tolist()
    names = _decode_many(
        strings_blob, [r[0] for r in rows] + [r[1] for r in rows], lim.string_bytes
    )
    rank_texts = _decode_many(strings_blob, [r[2] for r in rows], _MAX_MEMBER_TEXT)
    groups = []
    members = 0
    for i, row in enumerate(rows):
        name_id, desc_id, ranks_id, _size, lec, lsc, lcc, lep, lcp = row
        try:
            ranks = parse_ranks(rank_texts[ranks_id])
        except RankTextError:
            ranks = ()
        members += len(ranks)
        if members > lim.members_per_file:
            raise _refused(
                limits.exceeded(
                    f"its process groups list more than {lim.members_per_file:,} members",
                    "members_per_file",
                    lim.members_per_file,
                    unit="ranks",
                )
            )
        groups.append(
            SnapshotGroup(
                index=i,
                name=names[name_id],
                desc=names[desc_id],
                ranks=ranks,
                last_enqueued_collective=lec,
                last_started_collective=lsc,
                last_completed_collective=lcc,
                last_enqueued_p2p=lep,
                last_completed_p2p=lcp,
            )
        )
    return Snapshot(
        header=header,
        identity=identity,
        groups=groups,
        slots=slots,
        strings_blob=strings_blob,
        torn=torn,
        notes=notes,
        path=path,
    )


# the longest member-rank text a group may have: every rank of the largest world, one by one
_MAX_MEMBER_TEXT = MAX_WORLD_SIZE * (len(str(MAX_WORLD_SIZE)) + 1)


def read_snapshot(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> Snapshot:
    """Parse a black-box file (a path, live or not, or its bytes).

    Raises ``SnapshotError`` for a file that is not a usable snapshot or is refused (not a
    regular file, sparse, beyond a limit) and ``OSError`` when it cannot be read. A slot
    being written at that moment is dropped and counted in ``torn``.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        buf = bytes(source)
        return _parse(buf, len(buf), None)
    path = os.fspath(source)
    try:
        fd, st = open_regular(path)
    except InputRefused as exc:
        raise _refused(exc) from None
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        if size == 0:
            raise SnapshotError("empty file")
        head = f.read(2)
        f.seek(0)
        if head == limits.GZIP_MAGIC:
            try:
                data = limits.read_regular(
                    path, limits.current().dump_bytes, limit_name="dump_bytes"
                )
                buf = limits.gunzip(data)
            except InputRefused as exc:
                raise _refused(exc) from None
            except (EOFError, zlib.error) as exc:
                raise SnapshotError(f"corrupt gzip file: {exc}") from None
            return _parse(buf, len(buf), path)
        try:
            limits.check_sparse(st)
        except InputRefused as exc:
            raise _refused(exc) from None
        mm = _map_regions(f.fileno(), size)
    try:
        return _parse(mm, min(size, len(mm)), path)
    finally:
        # a view still alive somewhere: let the GC unmap it
        with contextlib.suppress(BufferError):
            mm.close()


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header fields and identity of a black-box file: cheap (one page), for polling
    the stall flag, the heartbeat and dump acknowledgements. A link, a FIFO or a device
    named like a black box is refused (``SnapshotError``), never followed or waited on."""
    try:
        fd, _ = open_regular(path, follow_symlinks=False)
    except InputRefused as exc:
        raise _refused(exc) from None
    with os.fdopen(fd, "rb") as f:
        buf = f.read(HEADER_BYTES)
    header = _parse_header(buf, len(buf))
    header["identity"], _ = _parse_identity(buf, header)
    return header


def copy_consistent(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> int:
    """Copy a live black-box file so that the copy parses; returns the number of slots that
    stayed torn (marked so in the copy: the reader drops them).

    The slot array is copied between two reads of every slot's sequence counter; a slot whose
    counter moved or was odd is copied again on its own (a few tries) and marked torn if a
    writer keeps holding it. The process-group and string tables are copied after the slots:
    both only grow, and a slot only refers to entries written before it, so every reference in
    the copied slots resolves.

    The source is hostile until proven otherwise: a link, a FIFO or a device is refused, the
    header's regions must be where the layout puts them and within the limits (what the
    analyzer would read), and the copy holds the regions read, no more: never the size the
    header claims (``file_bytes``).
    """
    src = os.fspath(src)
    try:
        fd, st = open_regular(src, follow_symlinks=False)
    except InputRefused as exc:
        raise _refused(exc) from None
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        if size < HEADER_BYTES:
            raise SnapshotError("not an frtools snapshot (too short)")
        mm = _map_regions(f.fileno(), size)
    try:
        size = min(size, len(mm))
        header = _parse_header(mm, size)
        _check_limits(header)
        slot_bytes = SLOT_DTYPE.itemsize
        off = header["slots_offset"]
        cap = header["capacity"]
        end = off + cap * slot_bytes
        if size < end:
            raise SnapshotError(f"truncated frtools snapshot: {size} bytes, slots end at {end}")
        live_seq = np.ndarray((cap,), dtype="<u8", buffer=mm, offset=off, strides=(slot_bytes,))
        before = live_seq.copy()
        slots = bytearray(mm[off:end])
        after = live_seq.copy()
        copied = np.frombuffer(slots, dtype=SLOT_DTYPE)
        copied_seq = copied["seq"]
        bad = np.flatnonzero((before != after) | (copied_seq != before) | ((before & 1) == 1))
        torn = 0
        for i in bad.tolist():
            lo = off + i * slot_bytes
            for _ in range(100):
                s0 = int(live_seq[i])
                one = mm[lo : lo + slot_bytes]
                s1 = int(live_seq[i])
                if s0 == s1 and s0 % 2 == 0 and struct.unpack_from("<Q", one, 0)[0] == s0:
                    slots[i * slot_bytes : (i + 1) * slot_bytes] = one
                    break
            else:
                struct.pack_into("<Q", slots, i * slot_bytes, int(copied_seq[i]) | 1)
                torn += 1
        del live_seq, copied, copied_seq
        head = bytes(mm[:HEADER_BYTES])
        header = _parse_header(head, len(head))
        _check_limits(header)
        pg_count = min(header["pg_count"], header["pg_capacity"])
        pg_off = header["pg_offset"]
        pgs = mm[pg_off : min(pg_off + pg_count * PG_DTYPE.itemsize, size)]
        s_off = header["strings_offset"]
        strings = mm[
            s_off : min(s_off + min(header["strings_used"], header["strings_bytes"]), size)
        ]
    finally:
        with contextlib.suppress(BufferError):
            mm.close()
    with new_file(dst) as out:  # a new 0600 file under a name mkstemp chose, renamed over dst
        out.write(head)
        out.seek(pg_off)
        out.write(pgs)
        out.seek(off)
        out.write(slots)
        out.seek(s_off)
        out.write(strings)
    return torn


def _map_regions(fd: int, size: int) -> mmap.mmap:
    """A read-only mapping of the file up to the end of the regions its header describes
    (never the whole of a huge file: only what a reader may touch is mapped)."""
    head = os.pread(fd, HEADER_BYTES, 0)
    length = size
    try:
        header = _parse_header(head, len(head))
    except SnapshotError:
        length = min(size, HEADER_BYTES)
    else:
        _check_limits(header)
        used = min(header["strings_used"], header["strings_bytes"])
        length = min(size, header["strings_offset"] + used)
    return mmap.mmap(fd, max(length, 1), access=mmap.ACCESS_READ)


def _map_header_rw(path: str | os.PathLike[str]) -> mmap.mmap:
    try:
        fd, st = open_regular(path, follow_symlinks=False, write=True)
    except InputRefused as exc:
        raise _refused(exc) from None
    try:
        if st.st_size < HEADER_BYTES:
            raise SnapshotError("not an frtools snapshot (too short)")
        mm = mmap.mmap(fd, HEADER_BYTES, access=mmap.ACCESS_WRITE)
    finally:
        os.close(fd)
    try:
        _parse_header(mm, HEADER_BYTES)
    except SnapshotError:
        mm.close()
        raise
    return mm


def request_dump(path: str | os.PathLike[str]) -> int:
    """Ask the rank that owns this live file to write its Python stacks; returns the request
    sequence number to pass to ``dump_acknowledged``.

    The rank's native watchdog sees ``dump_request_seq > dump_ack_seq`` within one poll,
    raises the stack signal in its own process (faulthandler writes every thread's stack,
    GIL or not), then acknowledges.
    """
    mm = _map_header_rw(path)
    try:
        (seq,) = struct.unpack_from("<Q", mm, _DUMP_REQUEST_OFFSET)
        (ack,) = struct.unpack_from("<Q", mm, _DUMP_ACK_OFFSET)
        seq = max(seq, ack) + 1
        struct.pack_into("<Q", mm, _DUMP_REQUEST_OFFSET, seq)
        return seq
    finally:
        mm.close()


def dump_acknowledged(path: str | os.PathLike[str], seq: int) -> bool:
    """True once the rank's watchdog has answered dump request ``seq``."""
    header = read_header(path)
    return int(header["dump_ack_seq"]) >= seq
