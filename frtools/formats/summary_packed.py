"""The packed host summary: one host's rank summaries, columnar and compressed.

A fleet analysis ships one file per host and reads 16,384 of them on one machine, so the
file is small (a few KB per rank) and decodes without a Python object per op:

* every string of every rank (ops, shapes, dtypes, stacks, thread names) is interned once
  per host, and every process group is listed once per host (a host's ranks share their
  data-parallel and default groups);
* the ops of all the host's ranks are stored as columns, one after the other: integers that
  grow (record ids, sequence ids, creation times) as differences, start and completion times
  relative to the creation time, each column's bytes shuffled by significance (the high
  bytes of small numbers are zeros and compress to nothing);
* a JSON header (identity, frontiers, stacks, failure facts per rank) and the column bytes
  are compressed together: zlib for a host's file, zstd for a merged partial.

``encode_packed`` writes it from ``RankSummary`` objects, ``decode_packed`` reads it into
numpy columns (``PackedHost``; what the analyzer's reader turns into Arrow directly),
``to_summaries`` into ``RankSummary`` objects. The reader treats the file as hostile: the
decompressed size is bounded before it is produced, every field is type-checked, every
index range-checked; one ``SummaryError`` line when refused. docs/summary-format.md is the
contract.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any

import numpy as np

from frtools.formats.summary import (
    ENTRY_FIELDS,
    FORMAT,
    IDENTITY_KEYS,
    MAX_DOCUMENT_BYTES,
    MAX_ENTRIES,
    MAX_GROUPS,
    MAX_HOST_RANKS,
    MAX_IDENTITY_CHARS,
    MAX_NOTE_CHARS,
    MAX_NOTES,
    MAX_STACKS_CHARS,
    MAX_STRING_CHARS,
    MAX_STRINGS,
    VERSION,
    RankSummary,
    SummaryEntry,
    SummaryError,
    SummaryGroup,
    checked_int,
    endings,
    optional_bool,
    optional_int,
    optional_str,
    rank_fields,
    rank_header,
    refuse_constant,
    want,
)
from frtools.model.ranks import MAX_WORLD_SIZE, RankTextError, format_ranks, parse_ranks

__all__ = [
    "COLUMNS",
    "DEFAULT_HOST_WINDOW",
    "MAGIC",
    "NUMBER_COLUMNS",
    "PACKED_KIND",
    "PACKED_SUFFIX",
    "PARTIAL_VERSION",
    "STATE_CODES",
    "STRING_COLUMNS",
    "PackedHost",
    "PackedRank",
    "decode_packed",
    "decode_packed_many",
    "encode_packed",
    "host_file_name",
    "looks_packed",
    "merge_packed",
    "to_summaries",
]

MAGIC = b"FRTSUMPK"  # zlib( document ): what a host writes
# A partial's document is hundreds of MB: zstd (level 1) compresses it ten times faster and
# reads it three times faster than zlib (32,768 ranks, 256 MB: 0.09 s / 0.16 s against
# 0.93 s / 0.46 s), so merges write ``ZSTD_MAGIC · u64 document size · zstd frame``.
ZSTD_MAGIC = b"FRTSUMPZ"
_ZSTD_SIZE = struct.Struct("<Q")
# At most 128 KiB come out of every 4 bytes of a zstd frame (a block holds <= 128 KiB and
# takes >= 4 bytes: an RLE block), so a stated size beyond this is refused before any
# buffer is allocated for it.
_ZSTD_MAX_RATIO = (128 << 10) // 4
# The last ops per rank a host summary keeps by default (every op that did not complete is
# kept besides, up to MAX_PENDING): what the verdict needs at 131,072 ranks without the
# central step holding more than ~8 M ops (docs/fleet.md: how it was chosen).
DEFAULT_HOST_WINDOW = 64
PACKED_KIND = "host-packed"
PACKED_SUFFIX = ".summary"
STATE_CODES = ("scheduled", "started", "completed")
# strings a host may intern (its ranks' together) and ops it may hold
MAX_HOST_STRINGS = 4 * MAX_STRINGS
MAX_HOST_ENTRIES = MAX_HOST_RANKS * MAX_ENTRIES
MAX_HEADER_BYTES = 64 << 20
# A partial (``merge_packed``): many hosts' ranks in one file. Its bounds scale with what
# its header declares (ranks, hosts), under these ceilings; its inflated size is never more
# than its header and the columns the header describes. Version 3 (written since 6 Dec 2026)
# lists its ranks as columns (``rank_table``), version 2 as one object per rank (``ranks``):
# at 32,768 ranks a partial's header is half the bytes and is read in half the time.
PARTIAL_VERSION = 3
PARTIAL_VERSIONS = (2, 3)
MAX_PARTIAL_RANKS = MAX_WORLD_SIZE
MAX_PARTIAL_HEADER_BYTES = 1 << 30
MAX_PARTIAL_BYTES = 4 << 30
# how a partial's header starts (what lets its file be larger than a host's), per version
_PARTIAL_PREFIXES = {v: b'{"format":"frtools-summary","version":%d,' % v for v in PARTIAL_VERSIONS}
PARTIAL_PREFIX = _PARTIAL_PREFIXES[PARTIAL_VERSION]
_INT64_MAX = (1 << 63) - 1
_ALL_LISTS, _SIX, _ALL_INTS = {list}, {6}, {int}

# Column codecs: d8 int64 stored as differences to the previous row; r8:<col> int64 stored
# relative to another column of the same row; i1/i2/i4/i8 plain signed, u1 unsigned, s4 an
# index into the host's strings (uint32), f8 a float64. A trailing "?" marks a nullable
# column: a validity bitmap (numpy packbits, big bit order) precedes its values. The
# columns are the entry's fields, in SummaryEntry's order, each with the codec its field
# names (``formats.summary``: one field list for both encodings).
COLUMNS: tuple[tuple[str, str], ...] = tuple(
    (f.name, f.metadata["packed"]) for f in fields(SummaryEntry)
)
_NUMPY = {"d8": "<i8", "r8": "<i8", "i1": "<i1", "i2": "<i2", "i4": "<i4", "i8": "<i8",
          "u1": "<u1", "s4": "<u4", "f8": "<f8"}  # fmt: skip
# the columns that index the host's strings, and those that hold numbers
STRING_COLUMNS = tuple(name for name, codec in COLUMNS if codec == "s4")
NUMBER_COLUMNS = tuple(name for name, codec in COLUMNS if codec != "s4")
_STATE_CODE = {name: code for code, name in enumerate(STATE_CODES)}
_ENTRY_VALUES = operator.attrgetter(*ENTRY_FIELDS)
# a rank's fields the header carries under RankSummary's names (PackedRank has each)
_RANK_SCALARS = tuple(f.name for f in fields(RankSummary) if f.name not in ("groups", "entries"))
_ITEMSIZE = {codec: np.dtype(t).itemsize for codec, t in _NUMPY.items()}


def _codec(spec: str) -> tuple[str, bool, str | None]:
    """``"r8?:time_created_ns"`` -> ("r8", nullable, base column)."""
    head, _, base = spec.partition(":")
    return head.rstrip("?"), head.endswith("?"), base or None


@dataclass
class PackedRank:
    """One rank's part of the header (its ops are rows of the host's columns)."""

    rank: int
    world_size: int | None
    identity: dict[str, Any]
    groups: list[tuple[int, tuple[int, int, int, int, int]]]  # (host group, frontier)
    n_entries: int
    taken_ns: int
    heartbeat_ns: int | None = None
    dump_time_ns: int | None = None
    stalled: bool | None = None
    alive: bool | None = None
    wrapped: bool = False
    records_written: int = 0
    omitted: int = 0
    exit_kind: str | None = None
    exit_detail: str | None = None
    stacks: str | None = None
    notes: list[str] = field(default_factory=list)
    startup_phase: str | None = None  # frtools.model.trace.STARTUP_PHASES; None: not recorded


@dataclass
class PackedHost:
    """A decoded packed host summary: metadata per rank, ops as numpy columns (all ranks'
    rows, rank after rank; ``offsets[i]`` is rank ``i``'s first row)."""

    host: str | None
    window: int | None
    strings: list[str]
    groups: list[tuple[str, str, str, tuple[int, ...], bool]]  # name, desc, text, ranks, local
    # the ranks as columns, checked (version 3's ``rank_table``, whatever the file's version):
    # a reader maps them without an object per rank
    rank_table: dict[str, Any]
    offsets: np.ndarray
    columns: dict[str, np.ndarray]
    valid: dict[str, np.ndarray]  # nullable columns: True where a value is present
    # the hosts whose ranks the file holds, sorted (a partial's; one host's file: its own)
    hosts: list[str] = field(default_factory=list)
    _ranks: list[PackedRank] | None = field(default=None, repr=False, compare=False)

    @property
    def ranks(self) -> list[PackedRank]:
        """One ``PackedRank`` per rank (made when first asked: merging and summaries)."""
        if self._ranks is None:
            self._ranks = _packed_ranks(self.rank_table)
        return self._ranks

    @property
    def n_entries(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0


def host_file_name(host: str) -> str:
    """``<host>.summary``: safe characters only (a host name is not trusted as a path)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in host)[:200] or "host"
    return f"{safe.lstrip('.') or 'host'}{PACKED_SUFFIX}"


def looks_packed(head: bytes) -> bool:
    return head[: len(MAGIC)] in (MAGIC, ZSTD_MAGIC)


def _zstd(level: int | None = None) -> Any:
    """pyarrow's zstd codec: what the analyzer and a merge load anyway (a host's
    ``frtools summarize`` writes zlib and never loads it)."""
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=level)


# -- writing -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _members_text(ranks: tuple[int, ...]) -> str:
    """A member list's text, by its content (equal lists decoded from each rank's box)."""
    return format_ranks(ranks, strides=True)


# id(member tuple) -> (the tuple, its text); the tuple is held, so its id is not reused
_TEXTS: dict[int, tuple[tuple[int, ...], str]] = {}
_TEXTS_MAX_MEMBERS = 1 << 22
_texts_members = 0


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """Member lists repeat on every rank of a host and across hosts (a data-parallel group
    of 131,072 ranks on each of a million-rank job's hosts): each distinct list is written
    once per process. A list object met again is found by identity (the content cache hashes
    and compares the whole list: ~20 ms a host there); at most ``_TEXTS_MAX_MEMBERS``
    members are held that way."""
    global _texts_members
    got = _TEXTS.get(id(ranks))
    if got is not None and got[0] is ranks:
        return got[1]
    text = _members_text(ranks)
    if _texts_members + len(ranks) > _TEXTS_MAX_MEMBERS:
        _TEXTS.clear()
        _texts_members = 0
    if len(ranks) <= _TEXTS_MAX_MEMBERS:
        _TEXTS[id(ranks)] = (ranks, text)
        _texts_members += len(ranks)
    return text


def _shuffle(a: np.ndarray) -> bytes:
    """The bytes of ``a`` grouped by significance: all first bytes, then all second bytes…"""
    w = a.dtype.itemsize
    if w == 1 or not len(a):
        return a.tobytes()
    return np.ascontiguousarray(a).view(np.uint8).reshape(len(a), w).T.tobytes()


def encode_packed(
    summaries: Sequence[RankSummary],
    host: str | None = None,
    *,
    window: int | None = None,
    level: int = 6,
) -> bytes:
    """One host's rank summaries as a packed host summary (``<host>.summary``)."""
    if len(summaries) > MAX_HOST_RANKS:
        raise ValueError(f"a host summary holds at most {MAX_HOST_RANKS} ranks")
    strings: dict[str, int] = {"": 0}
    groups: dict[tuple[str, str, str, bool], int] = {}

    def sid(value: str | None) -> int:
        value = value or ""
        i = strings.get(value)
        if i is None:
            i = strings[value] = len(strings)
        return i

    ranks_doc = []
    values_of: list[tuple[Any, ...]] = []  # per entry, its fields in ENTRY_FIELDS order
    for s in summaries:
        mine = []
        for g in s.groups:
            text = _ranks_text(tuple(g.ranks)) if g.ranks else ""  # a tuple stays itself
            key = (g.name, g.desc, text, g.local_peers)
            hg = groups.setdefault(key, len(groups))
            mine.append(
                [hg, g.last_enqueued_collective, g.last_started_collective,
                 g.last_completed_collective, g.last_enqueued_p2p, g.last_completed_p2p]
            )  # fmt: skip
        ranks_doc.append({**rank_header(s), "groups": mine, "entries": len(s.entries)})
        values_of.extend(map(_ENTRY_VALUES, s.entries))
    by_field = zip(*values_of, strict=True) if values_of else ([] for _ in ENTRY_FIELDS)
    rows: dict[str, list[Any]] = dict(zip(ENTRY_FIELDS, map(list, by_field), strict=True))
    for name in STRING_COLUMNS:
        rows[name] = [sid(v) for v in rows[name]]
    rows["state"] = [_STATE_CODE[v] for v in rows["state"]]
    values: dict[str, np.ndarray] = {}
    valid: dict[str, np.ndarray] = {}
    for name, spec in COLUMNS:
        codec, nullable, _base = _codec(spec)
        raw = rows[name]
        dtype = np.dtype(_NUMPY[codec])
        if nullable:
            ok = valid[name] = np.array(
                [v is not None and not (isinstance(v, float) and math.isnan(v)) for v in raw],
                dtype=bool,
            )
            raw = [v if k else 0 for v, k in zip(raw, ok, strict=True)]
        values[name] = np.array(raw, dtype=dtype) if raw else np.zeros(0, dtype=dtype)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "kind": PACKED_KIND,
        "host": host,
        "window": window,
        "strings": list(strings),
        "groups": [list(k) for k in groups],
        "columns": [list(c) for c in COLUMNS],
        "ranks": ranks_doc,
    }
    return _pack(header, values, valid, level)


def _pack(
    header: dict[str, Any],
    values: dict[str, np.ndarray],
    valid: dict[str, np.ndarray],
    level: int,
    zstd: bool = False,
) -> bytes:
    """The file: ``header`` and the columns ``values`` (every one of ``COLUMNS``, absolute
    values; ``valid``: each nullable column's validity), encoded by their codecs.

    ``values`` is consumed: each column is let go once encoded and no later column is
    relative to it, and the encoded columns once joined into the document. A merge at the
    top of a fleet's tree (hundreds of thousands of ranks) otherwise held the columns three
    times over at its peak."""
    bases = {_codec(spec)[2] for _, spec in COLUMNS} - {None}
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    body: list[bytes] = [struct.pack("<I", len(head)), head]
    for name, spec in COLUMNS:
        codec, nullable, base = _codec(spec)
        dtype = np.dtype(_NUMPY[codec])
        a = (values[name] if name in bases else values.pop(name)).astype(dtype, copy=True)
        if nullable:
            ok = valid[name]
            body.append(np.packbits(ok).tobytes())
            a[~ok] = 0
        if codec == "d8" and len(a):
            a = np.diff(a, prepend=np.int64(0))
        elif codec == "r8":
            a = a - values[base].astype(dtype)  # type: ignore[index]
            if nullable:
                a[~ok] = 0
        body.append(_shuffle(a.astype(dtype, copy=False)))
        del a
    values.clear()
    payload = b"".join(body)
    del body[:]
    if zstd:
        frame = _zstd(level).compress(payload, asbytes=True)
        return ZSTD_MAGIC + _ZSTD_SIZE.pack(len(payload)) + frame
    return MAGIC + zlib.compress(payload, level)


# -- merging -------------------------------------------------------------------------------


def _hosts_of(part: PackedHost) -> list[str]:
    return part.hosts or ([part.host] if part.host else [])


def merge_packed(
    parts: Sequence[PackedHost], names: Sequence[str] | None = None, *, level: int = 1
) -> bytes:
    """Several packed summaries (hosts, or partials already merged) as one partial
    (version 3): every rank of every part, in rank order.

    The result depends only on the set of ranks, not on the parts' order or grouping:
    ``merge([merge([a, b]), c]) == merge([a, merge([c, b])])``, byte for byte. Ranks are
    sorted; the strings are the sorted union of the parts' (``""`` first), the groups the
    sorted union of ``[name, desc, ranks, local]``; each rank's rows and its own group list
    keep their order. A window is the smallest of the parts' (None if one has none). A rank
    in two parts is a ``SummaryError`` naming it and both parts (``names``: what to call
    each part, default its hosts). Nothing is pruned: every op, frontier and fact a part
    holds is kept (docs/summary-format.md, "Partials"). zstd at ``level`` 1
    (``ZSTD_MAGIC``)."""
    labels = (
        list(names)
        if names is not None
        else [",".join(_hosts_of(p))[:80] or f"part {i}" for i, p in enumerate(parts)]
    )
    owner: dict[int, int] = {}
    order: list[tuple[int, int, int]] = []  # (rank, part, position in part)
    for i, part in enumerate(parts):
        for k, r in enumerate(part.ranks):
            j = owner.setdefault(r.rank, i)
            if len(owner) == len(order):  # seen before: in another part, or twice in this one
                where = f"both {labels[j]} and {labels[i]}" if j != i else f"{labels[i]} twice"
                raise SummaryError(f"rank {r.rank} is in {where}")
            order.append((r.rank, i, k))
    order.sort()
    want(len(order) <= MAX_PARTIAL_RANKS, f"a partial holds at most {MAX_PARTIAL_RANKS} ranks")
    strings = sorted(set().union(*(p.strings for p in parts)) | {""})
    string_index = {t: i for i, t in enumerate(strings)}
    group_keys = sorted(set().union(*(((g[0], g[1], g[2], g[4]) for g in p.groups) for p in parts)))
    group_index = {k: i for i, k in enumerate(group_keys)}
    string_maps = [np.array([string_index[t] for t in p.strings], dtype=np.int64) for p in parts]
    group_maps = [[group_index[(g[0], g[1], g[2], g[4])] for g in p.groups] for p in parts]

    base = np.concatenate([[0], np.cumsum([p.n_entries for p in parts])]).astype(np.int64)
    merged = [parts[i].ranks[k] for _, i, k in order]
    rank_groups = [
        [[group_maps[i][hg], *f] for hg, f in parts[i].ranks[k].groups] for _, i, k in order
    ]
    starts = [int(base[i] + parts[i].offsets[k]) for _, i, k in order]
    counts = [r.n_entries for r in merged]
    n = np.array(counts, dtype=np.int64)
    total = int(n.sum())
    # the rows of each rank in turn, as positions in the parts' columns laid end to end
    at = np.repeat(np.array(starts, dtype=np.int64) - np.cumsum(n) + n, n) + np.arange(total)
    values: dict[str, np.ndarray] = {}
    valid: dict[str, np.ndarray] = {}
    for name, spec in COLUMNS:
        codec, nullable, _base = _codec(spec)
        dtype = np.dtype(_NUMPY[codec])
        fill = -1 if name == "group" else 0
        cols = []
        oks = []
        for i, p in enumerate(parts):
            c = p.columns.get(name)
            if c is None:
                c = np.full(p.n_entries, fill, dtype=dtype)
            elif codec == "s4":
                c = string_maps[i][c.astype(np.int64)]
            cols.append(c.astype(dtype, copy=False))
            if nullable:
                ok = p.valid.get(name)
                if ok is None:
                    ok = np.full(p.n_entries, name in p.columns, dtype=bool)
                oks.append(ok)
        joined = np.concatenate(cols) if cols else np.zeros(0, dtype=dtype)
        values[name] = joined[at]
        if nullable:
            valid[name] = (np.concatenate(oks) if oks else np.zeros(0, dtype=bool))[at]
    windows = [p.window for p in parts]
    hosts = sorted(set().union(*(_hosts_of(p) for p in parts)))
    header = {
        "format": FORMAT,
        "version": PARTIAL_VERSION,
        "kind": PACKED_KIND,
        "host": hosts[0] if len(hosts) == 1 else None,
        "hosts": hosts,
        "window": None if not windows or None in windows else min(windows),  # type: ignore[type-var]
        "strings": strings,
        "groups": [list(k) for k in group_keys],
        "columns": [list(c) for c in COLUMNS],
        "rank_table": _rank_table_doc(merged, rank_groups),
    }
    return _pack(header, values, valid, level, zstd=True)


# a partial's rank table: its columns of one value per rank, as PackedRank names them
_TABLE_SCALARS = (
    "rank", "world_size", "taken_ns", "heartbeat_ns", "dump_time_ns", "records_written",
    "omitted", "stalled", "alive", "wrapped", "exit_kind", "exit_detail", "startup_phase",
    "stacks", "notes",
)  # fmt: skip


def _rank_table_doc(ranks: Sequence[PackedRank], groups: list[list[list[int]]]) -> dict:
    """The ranks of a partial as columns (version 3's ``rank_table``): one list per field,
    ``identity`` one list per identity key some rank has (null where a rank has not),
    ``groups`` each rank's ``[group, five frontier values]`` lists, ``entries`` its ops."""
    table: dict[str, Any] = {name: [getattr(r, name) for r in ranks] for name in _TABLE_SCALARS}
    table["entries"] = [r.n_entries for r in ranks]
    table["identity"] = {
        key: [r.identity.get(key) for r in ranks]
        for key in IDENTITY_KEYS
        if any(key in r.identity for r in ranks)
    }
    table["groups"] = groups
    return table


# -- reading -------------------------------------------------------------------------------


def _inflate(d: Any, data: bytes, limit: int) -> bytes:
    """Up to ``limit`` more bytes of the stream ``d`` (``zlib.decompressobj``)."""
    try:
        return d.decompress(data, limit)
    except zlib.error as e:
        raise SummaryError(f"packed summary is corrupt: {e}") from None


def _parse_header(raw: bytes, head_len: int) -> Any:
    try:
        return json.loads(raw[4 : 4 + head_len], parse_constant=refuse_constant)
    except RecursionError:
        raise SummaryError("packed summary header nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SummaryError(f"packed summary header is not JSON: {str(e)[:120]}") from None


def _unzstd(data: bytes) -> bytes:
    """A ``ZSTD_MAGIC`` file's document: its stated size bounded (``MAX_PARTIAL_BYTES``)
    before anything is produced, the frame decompressed into exactly that many bytes."""
    at = len(ZSTD_MAGIC) + _ZSTD_SIZE.size
    want(len(data) >= at, "packed summary is truncated (no document size)")
    (size,) = _ZSTD_SIZE.unpack_from(data, len(ZSTD_MAGIC))
    want(size <= MAX_PARTIAL_BYTES, f"packed summary expands beyond {MAX_PARTIAL_BYTES} bytes")
    want(
        size <= _ZSTD_MAX_RATIO * (len(data) - at),
        "packed summary states a size its zstd frame cannot hold",
    )
    try:
        return _zstd().decompress(memoryview(data)[at:], decompressed_size=size, asbytes=True)
    except (OSError, ValueError) as e:  # pyarrow: a frame of another size, or corrupt
        raise SummaryError(f"packed summary is corrupt: {str(e)[:120]}") from None
    except (NotImplementedError, MemoryError) as e:  # a pyarrow without zstd; no memory
        raise SummaryError(f"packed summary cannot be decompressed here: {e!r:.120}") from None


def _document(data: bytes) -> tuple[bytes, int, Any, Any]:
    """The inflated document, its header's length and the header, bounded before each is
    produced: a host's file to ``MAX_DOCUMENT_BYTES`` and its header to
    ``MAX_HEADER_BYTES``. Only a partial, whose header starts with ``PARTIAL_PREFIX``, may
    be larger: its header up to ``MAX_PARTIAL_HEADER_BYTES``, the rest no more than the
    columns that header describes (``_partial_rest``). Also returns the zlib stream (None:
    a zstd file's whole document, read at once)."""
    d = None
    if data[: len(ZSTD_MAGIC)] == ZSTD_MAGIC:
        raw = _unzstd(data)
        more = len(raw) > MAX_DOCUMENT_BYTES
    else:
        d = zlib.decompressobj()
        raw = _inflate(d, data[len(MAGIC) :], MAX_DOCUMENT_BYTES)
        more = bool(d.unconsumed_tail)
    want(len(raw) >= 4, "packed summary without a header")
    (head_len,) = struct.unpack_from("<I", raw)
    prefix = raw[4 : 4 + len(PARTIAL_PREFIX)]
    partial = next((v for v, p in _PARTIAL_PREFIXES.items() if p == prefix), None)
    want(
        not more or partial is not None,
        f"packed summary expands beyond {MAX_DOCUMENT_BYTES} bytes",
    )
    want(
        head_len <= (MAX_HEADER_BYTES if partial is None else MAX_PARTIAL_HEADER_BYTES),
        "packed summary header is cut",
    )
    if d is not None and more and head_len > len(raw) - 4:
        raw += _inflate(d, d.unconsumed_tail, 4 + head_len - len(raw))
    want(head_len <= len(raw) - 4, "packed summary header is cut")
    header = _parse_header(raw, head_len)
    if partial is not None:  # the prefix is no promise: a later "version" key overrides it
        want(
            isinstance(header, dict) and header.get("version") == partial,
            "a partial's header names another version",
        )
    return raw, head_len, header, d


def _partial_rest(raw: bytes, d: Any, head_len: int, columns: Any, n: int) -> bytes:
    """The rest of a partial's document: exactly the column bytes its header describes
    (one byte more is inflated to see whether it has more; a zstd file's is all there)."""
    _, end = _layout(columns, None, n)
    total = 4 + head_len + end
    want(total <= MAX_PARTIAL_BYTES, f"partial expands beyond {MAX_PARTIAL_BYTES} bytes")
    if d is None:
        return raw  # its size is checked against the columns' with the layout
    if len(raw) <= total and d.unconsumed_tail:
        raw += _inflate(d, d.unconsumed_tail, total + 1 - len(raw))
    want(not d.unconsumed_tail, "packed summary has bytes after its last column")
    return raw


def decode_packed(data: bytes) -> PackedHost:
    """A packed host summary's metadata and columns; ``SummaryError`` when it is not a
    valid, bounded one."""
    (host,) = decode_packed_many([data])
    if isinstance(host, SummaryError):
        raise host
    return host


def decode_packed_many(datas: Sequence[bytes]) -> list[PackedHost | SummaryError]:
    """Several packed host summaries at once: per file its ``PackedHost`` or the
    ``SummaryError`` that refused it (one bad file does not fail the others).

    Each file's header is checked on its own; the columns of all the files are decoded
    and range-checked together, one numpy call per column for the batch rather than per
    file: at 16,384 hosts the per-call cost, not the bytes, is what reading costs."""
    out: list[PackedHost | SummaryError] = []
    heads: list[_Head] = []
    where: list[int] = []
    for data in datas:
        try:
            head = _head(data)
        except SummaryError as e:
            out.append(e)
            continue
        heads.append(head)
        where.append(len(out))
        out.append(head.host)
    for k, error in _decode_columns(heads).items():
        out[where[k]] = error
    return out


@dataclass
class _Head:
    """One file's checked header and where each of its columns lies in its body."""

    host: PackedHost
    bytes: np.ndarray  # the body as uint8
    n_strings: int
    # name -> (codec, base column, validity bitmap offset or -1, values offset)
    layout: dict[str, tuple[str, str | None, int, int]]


def _head(data: bytes) -> _Head:
    if not looks_packed(data):
        raise SummaryError("not a packed frtools host summary (no FRTSUMPK/FRTSUMPZ magic)")
    raw, head_len, header, d = _document(bytes(data))
    want(isinstance(header, dict) and header.get("format") == FORMAT, "not an frtools summary")
    version = header.get("version")
    partial = version in PARTIAL_VERSIONS and type(version) is int
    want(
        version == VERSION or partial,
        f"unsupported summary version {version!r} (this reads {VERSION}, 2 and 3)",
    )
    want(header.get("kind") == PACKED_KIND, f"unknown summary kind {header.get('kind')!r}")
    hosts: list[str] = []
    max_ranks, scale = MAX_HOST_RANKS, 1
    if partial:  # bounds scale with the hosts it holds
        hosts = header.get("hosts")  # type: ignore[assignment]
        want(
            type(hosts) is list
            and len(hosts) <= MAX_PARTIAL_RANKS
            and all(type(h) is str and len(h) <= MAX_IDENTITY_CHARS for h in hosts),
            "hosts is not a list of host names",
        )
        max_ranks, scale = MAX_PARTIAL_RANKS, max(1, len(hosts))
    strings = header.get("strings")
    want(isinstance(strings, list) and 1 <= len(strings) <= MAX_HOST_STRINGS * scale, "strings")
    want(
        all(type(s) is str and len(s) <= MAX_STRING_CHARS for s in strings),
        "a string is too long or not one",
    )
    want(strings[0] == "", "strings[0] must be the empty string")
    groups = _host_groups(header.get("groups"), MAX_GROUPS * 8 * scale)
    ranks = None
    if version == 3:
        table = _rank_table(header.get("rank_table"), len(groups), max_ranks)
    else:
        ranks = _ranks(header.get("ranks"), len(groups), max_ranks)
        table = _rank_table_doc(ranks, [[[hg, *f] for hg, f in r.groups] for r in ranks])
    counts = np.array(table["entries"], dtype=np.int64)
    n = int(counts.sum())
    want(n <= MAX_HOST_ENTRIES * scale, f"more than {MAX_HOST_ENTRIES * scale} entries")
    if partial:
        raw = _partial_rest(raw, d, head_len, header.get("columns"), n)
    want(d is None or d.eof, "packed summary is truncated (compressed stream ended early)")
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    body = memoryview(raw)[4 + head_len :]
    layout, _ = _layout(header.get("columns"), len(body), n)
    host = optional_str(header.get("host"), "host", MAX_IDENTITY_CHARS)
    window = optional_int(header.get("window"), "window", 1, MAX_ENTRIES)
    packed = PackedHost(host, window, strings, groups, table, offsets, {}, {}, _ranks=ranks)
    packed.hosts = hosts if partial else ([host] if host else [])
    return _Head(packed, np.frombuffer(body, dtype=np.uint8), len(strings), layout)


def _host_groups(raw: Any, limit: int) -> list[tuple[str, str, str, tuple[int, ...], bool]]:
    want(isinstance(raw, list) and len(raw) <= limit, "groups is not a short list")
    out = []
    for i, g in enumerate(raw):
        want(isinstance(g, list) and len(g) == 4, f"group {i} is not [name, desc, ranks, local]")
        name = optional_str(g[0], f"group {i} name", MAX_IDENTITY_CHARS) or ""
        desc = optional_str(g[1], f"group {i} desc", MAX_IDENTITY_CHARS) or ""
        text = optional_str(g[2], f"group {i} ranks", MAX_STRING_CHARS) or ""
        try:
            ranks = parse_ranks(text) if text else ()
        except RankTextError as e:
            raise SummaryError(f"group {i} ranks: {e}") from None
        local = optional_bool(g[3], f"group {i} local")
        out.append((name, desc, text, ranks, bool(local)))
    return out


def _plain_groups(raw: list[Any], n_groups: int) -> bool:
    """Every rank item an object whose groups are lists of 6 integers in range, checked
    for all ranks at once (a partial of 32,768 ranks: 0.3 s rank by rank); False: some
    item is not, and ``_ranks`` finds it and says which."""
    if set(map(type, raw)) != {dict}:
        return False
    return _group_lists_ok([doc.get("groups") for doc in raw], n_groups)


def _group_lists_ok(lists: list[Any], n_groups: int) -> bool:
    """Per rank a list of at most MAX_GROUPS ``[group, five frontier values]`` lists of
    integers: the group an index into the table of ``n_groups``, each value >= -1."""
    if set(map(type, lists)) != {list} or max(map(len, lists)) > MAX_GROUPS:
        return False
    rows = list(chain.from_iterable(lists))
    if not rows:
        return True
    if set(map(type, rows)) != _ALL_LISTS or set(map(len, rows)) != _SIX:
        return False
    flat = list(chain.from_iterable(rows))
    if set(map(type, flat)) != _ALL_INTS:
        return False
    first = flat[0::6]
    return min(first) >= 0 and max(first) < n_groups and min(flat) >= -1 and max(flat) <= _INT64_MAX


def _ranks(raw: Any, n_groups: int, limit: int) -> list[PackedRank]:
    want(isinstance(raw, list) and len(raw) <= limit, "ranks is not a short list")
    if raw and _plain_groups(raw, n_groups):
        top = MAX_ENTRIES
        out = []
        for doc in raw:
            n = doc.get("entries")
            out.append(
                PackedRank(
                    **rank_fields(doc),
                    groups=[(g[0], tuple(g[1:])) for g in doc["groups"]],  # type: ignore[misc]
                    n_entries=n
                    if type(n) is int and 0 <= n <= top
                    else checked_int(n, "entries", 0, top),
                )
            )
        return out
    out = []
    for i, doc in enumerate(raw):
        want(isinstance(doc, dict), f"rank item {i} is not an object")
        fields = rank_fields(doc)
        rank = fields["rank"]
        groups_raw = doc.get("groups")
        want(isinstance(groups_raw, list) and len(groups_raw) <= MAX_GROUPS, "rank groups")
        # thousands of hosts x ranks x groups: checked in bulk (map, not a loop per value)
        if groups_raw:
            flat = (
                list(chain.from_iterable(groups_raw))
                if set(map(type, groups_raw)) <= _ALL_LISTS
                else ()
            )
            want(
                len(flat) == 6 * len(groups_raw)
                and set(map(len, groups_raw)) <= _SIX
                and set(map(type, flat)) <= _ALL_INTS,
                f"rank {rank} groups are not lists of 6 integers",
            )
            first = flat[0::6]
            want(
                min(first) >= 0 and max(first) < n_groups,
                f"rank {rank} names a group beyond the host's table",
            )
            # every value but the group index is a frontier value; those are >= 0
            want(min(flat) >= -1 and max(flat) <= _INT64_MAX, f"rank {rank} frontier out of range")
        out.append(
            PackedRank(
                **fields,
                groups=[(g[0], tuple(g[1:])) for g in groups_raw],  # type: ignore[misc]
                n_entries=checked_int(doc.get("entries"), "entries", 0, MAX_ENTRIES),
            )
        )
    return out


_NONE = type(None)
# the rank table's integer columns: (name, lowest, highest, nullable)
_TABLE_INTS = (
    ("rank", 0, MAX_WORLD_SIZE - 1, False),
    ("world_size", 1, MAX_WORLD_SIZE, True),
    ("entries", 0, MAX_ENTRIES, False),
    ("taken_ns", 0, _INT64_MAX, False),
    ("heartbeat_ns", 0, _INT64_MAX, True),
    ("dump_time_ns", 0, _INT64_MAX, True),
    ("records_written", 0, _INT64_MAX, False),
    ("omitted", 0, _INT64_MAX, False),
)
# its text columns: (name, longest)
_TABLE_TEXTS = (
    ("exit_kind", 32),
    ("exit_detail", MAX_STRING_CHARS),
    ("startup_phase", 32),
    ("stacks", MAX_STACKS_CHARS),
)


def _table_column(table: dict[str, Any], name: str, n: int, label: str = "") -> list[Any]:
    column = table.get(name)
    want(
        type(column) is list and len(column) == n,
        f"rank_table {label or name} is not a list of {n}",
    )
    return column


def _present(column: list[Any], kinds: set[type]) -> list[Any]:
    """The values of ``column`` that are not null."""
    return [v for v in column if v is not None] if _NONE in kinds else column


def _rank_table(raw: Any, n_groups: int, limit: int) -> dict[str, Any]:
    """A version 3 partial's ranks (``rank_table``), checked a column at a time: the type
    of every value, the range of each column, the tables each value names. Returns the
    columns this reader knows (a rank's identity: the keys it knows)."""
    want(type(raw) is dict, "rank_table is not an object")
    ranks = raw.get("rank")
    want(type(ranks) is list and len(ranks) <= limit, "rank_table rank is not a short list")
    n = len(ranks)
    columns: dict[str, list[Any]] = {}
    for name, lo, hi, nullable in _TABLE_INTS:
        column = columns[name] = _table_column(raw, name, n)
        kinds = set(map(type, column))
        want(
            kinds <= ({int, _NONE} if nullable else _ALL_INTS),
            f"rank_table {name} holds a value that is not an integer",
        )
        values = _present(column, kinds)
        want(
            not values or (lo <= min(values) and max(values) <= hi),
            f"rank_table {name} holds a value out of range",
        )
    for name in ("stalled", "alive", "wrapped"):
        column = columns[name] = _table_column(raw, name, n)
        kinds = set(map(type, column))
        want(
            kinds <= ({bool} if name == "wrapped" else {bool, _NONE}),
            f"rank_table {name} holds a value that is not true or false",
        )
    for name, longest in _TABLE_TEXTS:
        column = columns[name] = _table_column(raw, name, n)
        kinds = set(map(type, column))
        want(kinds <= {str, _NONE}, f"rank_table {name} holds a value that is not text")
        values = _present(column, kinds)
        want(
            not values or max(map(len, values)) <= longest,
            f"rank_table {name} holds a text longer than {longest} characters",
        )
    exit_kinds, phases = endings()
    for name, known in (("exit_kind", exit_kinds), ("startup_phase", phases)):
        unknown = set(columns[name]) - known - {None}
        if unknown:
            raise SummaryError(f"rank_table {name} holds an unknown value {min(unknown)[:32]!r}")
    world = columns["world_size"]
    for r, w in zip(ranks, world, strict=True):
        want(w is None or r < w, f"rank {r} is not below world_size {w}")
    notes = columns["notes"] = _table_column(raw, "notes", n)
    want(
        not notes or (set(map(type, notes)) == _ALL_LISTS and max(map(len, notes)) <= MAX_NOTES),
        f"rank_table notes is not a list of up to {MAX_NOTES} notes a rank",
    )
    every_note = list(chain.from_iterable(notes))
    want(
        not every_note
        or (set(map(type, every_note)) == {str} and max(map(len, every_note)) <= MAX_NOTE_CHARS),
        f"rank_table notes holds a note that is not text of at most {MAX_NOTE_CHARS} characters",
    )
    groups = _table_column(raw, "groups", n)
    want(
        not groups or _group_lists_ok(groups, n_groups),
        "rank_table groups are not lists of [group, five frontier values] in range",
    )
    identity = raw.get("identity")
    want(type(identity) is dict, "rank_table identity is not an object")
    keys = [key for key in IDENTITY_KEYS if key in identity]
    lo, hi = -_INT64_MAX - 1, _INT64_MAX
    for key in keys:
        column = _table_column(identity, key, n, f"identity {key}")
        kinds = set(map(type, column))
        want(kinds <= {str, int, _NONE}, f"rank_table identity {key} holds a value of another type")
        texts = [v for v in column if type(v) is str]
        numbers = [v for v in column if type(v) is int]
        want(
            (not texts or max(map(len, texts)) <= MAX_IDENTITY_CHARS)
            and (not numbers or (lo <= min(numbers) and max(numbers) <= hi)),
            f"rank_table identity {key} holds a value out of bounds",
        )
    table = {name: columns[name] for name in _TABLE_SCALARS}
    table["entries"] = columns["entries"]
    table["identity"] = {key: identity[key] for key in keys}
    table["groups"] = groups
    return table


def _packed_ranks(table: dict[str, Any]) -> list[PackedRank]:
    """One ``PackedRank`` per rank of a checked rank table."""
    keys = list(table["identity"])
    n = len(table["rank"])
    by_rank = zip(*table["identity"].values(), strict=True) if keys else ((),) * n
    scalars = zip(*(table[name] for name in _TABLE_SCALARS), strict=True)
    return [
        PackedRank(
            **dict(zip(_TABLE_SCALARS, values, strict=True)),
            identity={k: v for k, v in zip(keys, ident, strict=True) if v is not None},
            groups=[(g[0], tuple(g[1:])) for g in gs],  # type: ignore[misc]
            n_entries=entries,
        )
        for values, ident, gs, entries in zip(
            scalars, by_rank, table["groups"], table["entries"], strict=True
        )
    ]


@functools.lru_cache(maxsize=64)
def _codec_checked(spec: str) -> tuple[str, bool, str | None]:
    codec, nullable, base = _codec(spec)
    want(codec in _NUMPY, f"has an unknown codec {spec[:40]!r}")
    return codec, nullable, base


def _layout(
    raw: Any, size: int | None, n: int
) -> tuple[dict[str, tuple[str, str | None, int, int]], int]:
    """Where each column the header lists lies in the body, in the order listed, and where
    the last one ends; a column this reader does not know is skipped by its codec's size,
    and the body (of ``size`` bytes; None: not known yet) must end with the last one."""
    want(isinstance(raw, list) and len(raw) <= 256, "columns is not a short list")
    layout: dict[str, tuple[str, str | None, int, int]] = {}
    pos = 0
    limit = size if size is not None else _INT64_MAX
    for item in raw:
        want(
            type(item) is list and len(item) == 2 and all(type(x) is str for x in item),
            "a column is not [name, codec]",
        )
        name, spec = item
        try:
            codec, nullable, base = _codec_checked(spec)
        except SummaryError as e:
            raise SummaryError(f"column {name[:40]!r} {e}") from None
        bits = -1
        if nullable:
            bits = pos
            pos += (n + 7) // 8
            want(pos <= limit, f"column {name[:40]} is cut")
        start = pos
        pos += n * _ITEMSIZE[codec]
        want(pos <= limit, f"column {name[:40]} is cut")
        if codec == "r8":
            want(base in layout, f"column {name[:40]} is relative to a missing column")
        layout[name] = (codec, base, bits, start)
    want(size is None or pos == size, "packed summary has bytes after its last column")
    return layout, pos


def _decode_columns(heads: list[_Head]) -> dict[int, SummaryError]:
    """Fill each host's columns from its body, all hosts' rows of a column in one call;
    the hosts whose values are out of range, with their reason (their columns left empty)."""
    if not heads:
        return {}
    rows = np.array([h.host.n_entries for h in heads], dtype=np.int64)
    # the hosts that have a column under one codec are decoded together (normally all)
    together: dict[tuple[str, str, bool], list[int]] = {}
    for k, h in enumerate(heads):
        for name, (codec, _base, bits, _start) in h.layout.items():
            together.setdefault((name, codec, bits >= 0), []).append(k)
    for (name, codec, nullable), hosts in together.items():
        dtype = np.dtype(_NUMPY[codec])
        w = dtype.itemsize
        n = rows[hosts]
        spans = [(heads[k].bytes, heads[k].layout[name], int(rows[k])) for k in hosts]
        # a file read alone (a partial: millions of rows) skips the joins and the per-row
        # offsets a batch of hosts needs (one copy of each column fewer)
        alone = len(spans) == 1
        if w > 1:  # each host's bytes are w planes of n bytes: side by side, then transposed
            parts = [b[lay[3] : lay[3] + c * w].reshape(w, c) for b, lay, c in spans]
            planes = parts[0] if alone else np.concatenate(parts, axis=1)
            values = np.ascontiguousarray(planes.T).view(dtype)
            values = values.reshape(len(values))
        else:
            values = np.concatenate([b[lay[3] : lay[3] + c] for b, lay, c in spans]).view(dtype)
        bounds = np.concatenate([[0], np.cumsum(n)])
        if codec == "d8":  # differences to the previous row, from 0 at each host's first
            first = bounds[:-1][n > 0]
            head_values = values[first].copy()
            values[first] = 0
            np.cumsum(values, out=values)
            if len(first) == 1:
                values += head_values[0] - values[first[0]]
            else:
                values += np.repeat(head_values - values[first], n[n > 0])
        valid = None
        if nullable and alone:
            b, lay, c = spans[0]
            valid = np.unpackbits(b[lay[2] : lay[2] + (c + 7) // 8], count=c).view(bool)
        elif nullable:  # each host's validity bitmap is padded to whole bytes
            padded = (n + 7) // 8
            bits = np.unpackbits(
                np.concatenate([b[lay[2] : lay[2] + (c + 7) // 8] for b, lay, c in spans])
            )
            at = np.arange(len(bits)) - np.repeat(np.cumsum(padded * 8) - padded * 8, padded * 8)
            valid = bits[at < np.repeat(n, padded * 8)].astype(bool)
        for i, k in enumerate(hosts):
            host = heads[k].host
            lo, hi = bounds[i], bounds[i + 1]
            host.columns[name] = values[lo:hi]
            if valid is not None:
                host.valid[name] = valid[lo:hi]
    for h in heads:  # relative columns, once their bases are decoded (listed before them)
        for name, (codec, base, _bits, _start) in h.layout.items():
            if codec == "r8":
                h.host.columns[name] = h.host.columns[name] + h.host.columns[base]  # type: ignore[index]
    return _check_columns(heads, rows)


def _check_columns(heads: list[_Head], rows: np.ndarray) -> dict[int, SummaryError]:
    """The hosts whose columns name what their header lacks, with the first reason each
    fails on. Per check one pass over every host's rows: each host's smallest and largest
    value (``reduceat``), compared with its bounds, not a comparison per row."""
    errors: dict[int, SummaryError] = {}

    def fail(have: list[int], bad: Any, reason: str) -> None:
        for i in np.flatnonzero(bad).tolist():
            errors.setdefault(have[i], SummaryError(reason))

    def joined(name: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The hosts with rows in the column, their rows end to end, each one's first row."""
        have = [k for k, h in enumerate(heads) if name in h.host.columns and rows[k] > 0]
        arrays = [heads[k].host.columns[name] for k in have]
        values = arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays else None
        starts = np.cumsum(rows[have]) - rows[have]
        return have, values, starts  # type: ignore[return-value]

    def extremes(name: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        have, values, starts = joined(name)
        if not have:
            return have, np.zeros(0, np.int64), np.zeros(0, np.int64)
        lo = np.minimum.reduceat(values, starts).astype(np.int64)
        return have, lo, np.maximum.reduceat(values, starts).astype(np.int64)

    for k, h in enumerate(heads):
        for name in ("record_id", "state", "time_created_ns"):
            if name not in h.host.columns:
                errors.setdefault(k, SummaryError(f"columns lack {name}"))
    n_strings = np.array([h.n_strings for h in heads], dtype=np.int64)
    for name in STRING_COLUMNS:
        have, _lo, hi = extremes(name)
        fail(have, hi >= n_strings[have], f"column {name} names a string beyond the table")
    have, _lo, hi = extremes("state")
    fail(have, hi >= len(STATE_CODES), "unknown state code")
    have, lo, hi = extremes("retired")
    fail(have, (lo < 0) | (hi > 1), "retired is not 0 or 1")
    have, _lo, hi = extremes("is_p2p")
    fail(have, hi > 1, "is_p2p is not 0 or 1")
    # a row's group index is within its rank's own group list (a bound per rank: per row)
    have, values, starts = joined("group")
    if have:
        limit = np.concatenate(
            [np.repeat(np.array([len(g) for g in heads[k].host.rank_table["groups"]], dtype=np.int64),
                       np.diff(heads[k].host.offsets)) for k in have]
        )  # fmt: skip
        bad_rows = np.flatnonzero((values < -1) | (values >= limit))
        bad = np.zeros(len(have), dtype=bool)
        bad[np.searchsorted(starts, bad_rows, side="right") - 1] = True
        fail(have, bad, "group out of range")
    return errors


def to_summaries(packed: PackedHost) -> list[RankSummary]:
    """The ``RankSummary`` objects of a decoded packed host summary."""
    cols = packed.columns
    strings = packed.strings
    n = packed.n_entries

    def column(name: str, default: Any) -> list[Any]:
        a = cols.get(name)
        if a is None:
            return [default] * n
        values = a.tolist()
        ok = packed.valid.get(name)
        if ok is not None:
            values = [v if k else None for v, k in zip(values, ok.tolist(), strict=True)]
        return values

    def text(name: str) -> list[str]:
        a = cols.get(name)
        return [""] * n if a is None else [strings[i] for i in a.tolist()]

    c = {name: column(name, None) for name in NUMBER_COLUMNS}
    c["group"] = [-1 if v is None else v for v in c["group"]]
    for name in ("collective_seq_id", "p2p_seq_id"):
        c[name] = [v or 0 for v in c[name]]
    c["is_p2p"] = [bool(v) for v in c["is_p2p"]]
    c["state"] = [STATE_CODES[v] for v in c["state"]]
    c.update({name: text(name) for name in STRING_COLUMNS})
    # one tuple per op in SummaryEntry's field order (the field list is one)
    values = list(zip(*(c[name] for name in ENTRY_FIELDS), strict=True)) if n else []
    out = []
    for k, r in enumerate(packed.ranks):
        lo, hi = int(packed.offsets[k]), int(packed.offsets[k + 1])
        entries = [SummaryEntry(*v) for v in values[lo:hi]]
        groups = [
            SummaryGroup(
                packed.groups[hg][0],
                packed.groups[hg][1],
                packed.groups[hg][3],
                *f,
                local_peers=packed.groups[hg][4],
            )
            for hg, f in r.groups
        ]
        scalars = {name: getattr(r, name) for name in _RANK_SCALARS}
        scalars["notes"] = list(r.notes)
        out.append(RankSummary(**scalars, groups=groups, entries=entries))
    return out
