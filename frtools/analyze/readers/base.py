"""What every reader shares: the ``Reader`` protocol and the capabilities a reader
declares, the ``RankDump`` it returns, the error it raises for an unusable file, and the
rank/host that a dump's file name tells.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from frtools.formats import limits
from frtools.formats.limits import GZIP_MAGIC, InputRefused, open_regular
from frtools.model.ranks import MAX_WORLD_SIZE
from frtools.model.trace import ProcessGroup, RankInfo

HEAD_BYTES = 4096


class DumpError(Exception):
    """A file that is a dump (or claims to be) but cannot be used; the message is the
    reason, one line, shown to the user next to the file name."""


class Reader(Protocol):
    """A reader module, as the loader uses it (``registry.READERS``).

    ``sniff(path, head)``: whether the file is of this format (``head`` is its first bytes,
    already gunzipped when the file is gzip'd). ``read(path)``: its ``RankDump``, or
    ``DumpError`` with a one-line reason when the file is a dump of this format but cannot
    be used. Optional: ``read_all(path) -> list[RankDump]`` (a file of several ranks) and
    ``read_many(paths)`` (many files at once; a file's ranks may come as a ``RankBlock``),
    and the capability flags of ``Capabilities``
    as upper-case module constants (``LISTS_ALL_GROUPS = True``); the loader asks them
    through ``registry.capabilities``, never a format's name."""

    FORMAT: str

    def sniff(self, path: Path, head: bytes) -> bool: ...

    def read(self, path: Path) -> RankDump: ...


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a reader's format can tell, beyond the entries every format has."""

    # its group table names every group its ops are on (a black box, a summary): who
    # recorded on a group no file lists need not be looked for in its entries
    lists_all_groups: bool = False
    # every record states the job's world size (a black box's header)
    states_world_size: bool = False
    # its record says how the process ended, where it did (a black box's exit record): a
    # record that says nothing was not ended by the process itself
    records_ending: bool = False
    # one file may hold several ranks (``read_all``: a host summary)
    several_ranks: bool = False
    # many files are read in one call (``read_many``: packed host summaries, black boxes,
    # PyTorch pickles)
    batches: bool = False

    @classmethod
    def of(cls, reader: object) -> Capabilities:
        """A reader module's declared flags; what it leaves out it cannot do."""
        return cls(
            lists_all_groups=bool(getattr(reader, "LISTS_ALL_GROUPS", False)),
            states_world_size=bool(getattr(reader, "STATES_WORLD_SIZE", False)),
            records_ending=bool(getattr(reader, "RECORDS_ENDING", False)),
            several_ranks=callable(getattr(reader, "read_all", None)),
            batches=callable(getattr(reader, "read_many", None)),
        )


@dataclass
class RankDump:
    """One rank's record as read from one file.

    ``process_groups`` holds what this file knows of each group; a group whose membership
    the file does not really know has ``ranks=()``. ``unmapped_peer_groups`` names groups
    whose P2P ``peer`` values are still group-local (the file did not know the members);
    the loader maps them once membership from all files is merged.
    """

    rank_info: RankInfo
    entries: pa.Table
    process_groups: dict[str, ProcessGroup] = field(default_factory=dict)
    unmapped_peer_groups: set[str] = field(default_factory=set)
    bad_entries: int = 0
    notes: list[str] = field(default_factory=list)
    max_time_created_ns: int | None = None
    # True when the default group's membership was written as "all ranks"
    default_pg_all: bool = False


class RankBlock(Protocol):
    """The ranks of one file not yet made into ``RankDump`` objects (a ``read_many`` may
    return one per file): a worker process hands this over, and the parent makes the
    dumps as the worker's chunk arrives. ``rows``: each rank's row count in the batch's
    table, in order."""

    format: str
    rows: list[int]

    @property
    def ranks(self) -> list[int]: ...

    def dumps(self) -> list[RankDump]: ...


def read_head(path: Path, n: int = HEAD_BYTES) -> bytes:
    """First ``n`` bytes of the file's content; a gzip'd file is gunzipped on the fly
    (partial decompression, so a truncated archive still sniffs). ``InputRefused`` for a
    file that is not a regular one (a FIFO is never waited on)."""
    fd, _ = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(n)
        if not raw.startswith(GZIP_MAGIC):
            return raw
        raw += f.read(256 * 1024)
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        return d.decompress(raw, n)
    except zlib.error:
        return b""


def read_bytes(path: Path) -> bytes:
    """The whole content, gunzipped when the file is gzip'd; at most ``dump_bytes``, and a
    gzip'd file at most ``gunzip_ratio`` times its size (``frtools.formats.limits``)."""
    return read_content(path)[0]


def read_content(path: Path) -> tuple[bytes, int]:
    """``read_bytes`` and the file's size as stored (what the per-file limits scale with)."""
    lim = limits.current()
    try:
        data = limits.read_regular(path, lim.dump_bytes, limit_name="dump_bytes")
    except InputRefused as e:
        raise DumpError(str(e)) from None
    except OSError as e:
        raise DumpError(f"cannot read: {e.strerror or e}") from e
    stored = len(data)
    if data.startswith(GZIP_MAGIC):
        try:
            data = limits.gunzip(data, lim)
        except InputRefused as e:
            raise DumpError(str(e)) from None
        except EOFError as e:
            raise DumpError("truncated gzip file (compressed stream ended early)") from e
        except (OSError, zlib.error) as e:
            raise DumpError(f"corrupt gzip file: {e}") from e
    if not data:
        raise DumpError("empty file")
    return data, stored


# --- rank and host from the file name ----------------------------------------------------

_SUFFIXES = (".gz", ".gzip", ".pkl", ".pickle", ".json", ".bin", ".dump", ".fr")
# words that name the dump kind, never the host
_KIND_WORDS = {
    "nccl",
    "trace",
    "comm",
    "lib",
    "fr",
    "flight",
    "recorder",
    "dump",
    "frtools",
    "torch",
    "gloo",
    "snapshot",
    "debug",
    "info",
    "tmp",
}
_RANK_WORD = re.compile(r"(?:^|[_\-.])rank[_\-.]?(\d+)(?=$|[_\-.])", re.IGNORECASE)
_RANK_GLUED = re.compile(r"rank[_\-.]?(\d+)$", re.IGNORECASE)
_DUMP_WORD = re.compile(r"(?:^|[_\-.])dump[_\-.]?(\d+)$", re.IGNORECASE)
_TRAILING = re.compile(r"(?:^|[_\-.])(\d+)$")
_RANK_DIGITS = len(str(MAX_WORLD_SIZE))


def _rank(digits: str) -> int | None:
    """A rank a file name may carry: below ``MAX_WORLD_SIZE`` (a longer number is none)."""
    if len(digits.lstrip("0")) > _RANK_DIGITS:
        return None
    rank = int(digits)
    return rank if rank < MAX_WORLD_SIZE else None


def strip_suffixes(name: str) -> str:
    """``host-a_rank_5.pkl.gz`` -> ``host-a_rank_5``."""
    changed = True
    while changed:
        changed = False
        for suffix in _SUFFIXES:
            if name.lower().endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                changed = True
    return name


def _host_from_prefix(prefix: str) -> str | None:
    """The host in the part of a file name before its rank: its words (split at ``_``, ``-``
    and ``.``) without the dump-kind words at either end, cut where a kept word ends and
    keeping the host's own separators: ``gpu-node-a.trace_`` -> ``gpu-node-a``,
    ``ip-10-0-3-7.ec2.internal_nccl_trace_`` -> ``ip-10-0-3-7.ec2.internal``. A guess: a
    record's own host wins over it."""
    words = list(re.finditer(r"[^_\-.]+", prefix))
    while words and words[-1].group().lower() in _KIND_WORDS:
        words.pop()
    while words and words[0].group().lower() in _KIND_WORDS:
        words.pop(0)
    if not words:
        return None
    return prefix[words[0].start() : words[-1].end()] or None


def rank_from_filename(name: str) -> tuple[int | None, str | None]:
    """The global rank and host a dump's file name carries, ``(None, None)`` when none.

    Understands ``rank_3``, ``rank3``, ``rank-3``, ``nccl_trace_rank_7``,
    ``comm_lib_trace_rank_0``, ``fr_trace_rank_2``, ``_dump_12``, ``host-a_rank_5``,
    ``node01-rank-5`` and a plain trailing number (``trace_4``), with any of the suffixes
    ``.pkl``, ``.json``, ``.gz`` or none. A number at or beyond ``MAX_WORLD_SIZE`` is no rank.
    """
    stem = strip_suffixes(Path(name).name)
    matches = list(_RANK_WORD.finditer(stem))
    m = matches[-1] if matches else None
    if m is None:
        m = _RANK_GLUED.search(stem)
    if m is None:
        m = _DUMP_WORD.search(stem)
    if m is None:
        m = _TRAILING.search(stem)
        if m is None:
            return None, None
        host = None
        prefix = stem[: m.start()]
        if prefix:
            host = _host_from_prefix(prefix)
        return _rank(m.group(1)), host
    prefix = stem[: m.start()]
    host = _host_from_prefix(prefix) if prefix else None
    return _rank(m.group(1)), host
