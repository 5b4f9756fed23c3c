"""Reader for rank summaries (``rank_<R>.summary.json``, docs/summary-format.md).

A summary is the part of a black box a verdict needs (``frtools.formats.summary``); this
reader maps it onto the Trace exactly as the snapshot reader maps the box it came from, so
that a folder of summaries gives the verdict the boxes give. ``frtools.recovery`` writes
the summaries its ranks agreed on into each incident folder: ``frtools analyze`` of that
folder shows how the verdict was reached.

``read`` takes a file with one rank's summary; ``read_all`` also takes a host summary (many
ranks in one document) and returns one ``RankDump`` per rank. A packed host summary
(``formats.summary_packed``, what ``frtools summarize`` writes) goes from its numpy columns
straight into one Arrow table for all its ranks, without a Python object per op: a fleet
analysis reads 16,384 of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from frtools.formats import limits
from frtools.formats.blackbox import parse_splits
from frtools.formats.summary import (
    RankSummary,
    SummaryError,
    decode,
    looks_like_summary,
)
from frtools.formats.summary_packed import (
    NUMBER_COLUMNS,
    STATE_CODES,
    STRING_COLUMNS,
    PackedHost,
    decode_packed,
    decode_packed_many,
    looks_packed,
)
from frtools.model.codes import dense_unique
from frtools.model.ops import op_name
from frtools.model.trace import (
    ENTRY_SCHEMA,
    STATES,
    ProcessGroup,
    RankInfo,
    entries_table,
)

from .base import DumpError, RankDump, read_content
from .frtools_snapshot import all_ranks_of, call_site_of, split_columns

FORMAT = "frtools-summary"
# a summary's group table names every group its ops are on
LISTS_ALL_GROUPS = True


def sniff(path: Path, head: bytes) -> bool:
    return looks_like_summary(head) or looks_packed(head)


def read(path: Path) -> RankDump:
    """One rank's summary -> RankDump (a host summary of one rank too)."""
    dumps = read_all(path)
    if len(dumps) != 1:
        raise DumpError(
            f"host summary of {len(dumps)} ranks: read it with readers.summary.read_all"
        )
    return dumps[0]


def read_all(path: Path) -> list[RankDump]:
    """Every rank summary in the file (one, or a host summary's list)."""
    data, stored = read_content(path)
    try:
        if looks_packed(data):  # bounded by its own reader (inflated size, every field)
            return packed_to_rank_dumps(decode_packed(data), str(path))
        limits.check_json(data, stored=stored)  # what parsing it costs, as for a JSON dump
        summaries = decode(data)
    except (SummaryError, limits.InputRefused) as e:
        raise DumpError(str(e)) from None
    return [summary_to_rank_dump(s, str(path)) for s in summaries]


def summary_to_rank_dump(summary: RankSummary, source: str) -> RankDump:
    """Map a summary onto the Trace model (as ``frtools_snapshot`` maps a black box)."""
    backend = summary.identity.get("backend") or None
    info = _rank_info(
        source,
        {
            g.name: {
                "last_enqueued_collective": g.last_enqueued_collective,
                "last_started_collective": g.last_started_collective,
                "last_completed_collective": g.last_completed_collective,
            }
            for g in summary.groups
        },
        *_facts(summary),
    )
    world = summary.world_size
    default_pg_all = False
    process_groups = {}
    for g in summary.groups:
        ranks = g.ranks
        if all_ranks_of(g.name, g.desc, ranks, world):
            default_pg_all = True
            ranks = ()
        process_groups[g.name] = ProcessGroup(name=g.name, desc=g.desc, ranks=ranks)
    sites: dict[str, str | None] = {}

    def site(stack: str) -> str | None:
        if stack not in sites:
            sites[stack] = call_site_of(stack) if stack else None
        return sites[stack]

    groups = summary.groups
    es = summary.entries
    columns = {
        "rank": [summary.rank] * len(es),
        "record_id": [e.record_id for e in es],
        "pg_name": [groups[e.group].name if e.group >= 0 else None for e in es],
        "pg_desc": [groups[e.group].desc if e.group >= 0 else None for e in es],
        "collective_seq_id": [e.collective_seq_id for e in es],
        "p2p_seq_id": [e.p2p_seq_id for e in es],
        "is_p2p": [e.is_p2p for e in es],
        "op": [op_name(e.op) for e in es],
        "profiling_name": [
            e.op if (":" in e.op or not backend or not e.op) else f"{backend}:{e.op}" for e in es
        ],
        "peer": [e.peer for e in es],
        "input_sizes": [e.input_sizes for e in es],
        "output_sizes": [e.output_sizes for e in es],
        "input_dtypes": [e.input_dtypes for e in es],
        "output_dtypes": [e.output_dtypes for e in es],
        "state": [e.state for e in es],
        "time_created_ns": [e.time_created_ns for e in es],
        "time_started_ns": [e.time_started_ns for e in es],
        "time_completed_ns": [e.time_completed_ns for e in es],
        "duration_ms": [e.duration_ms for e in es],
        "retired": [e.state == "completed" if e.retired is None else bool(e.retired) for e in es],
        "timeout_ms": [e.timeout_ms for e in es],
        "thread_id": [e.thread_id for e in es],
        "thread_name": [e.thread_name or None for e in es],
        "call_site": [e.call_site or site(e.stack) for e in es],
        "stack": [e.stack or None for e in es],
        "error": [e.error or None for e in es],
    }
    columns.update(_split_lists([e.splits for e in es]))
    created = columns["time_created_ns"]
    return RankDump(
        rank_info=info,
        entries=entries_table(columns),
        process_groups=process_groups,
        notes=list(summary.notes),
        max_time_created_ns=max(created) if created else None,
        default_pg_all=default_pg_all,
        unmapped_peer_groups={g.name for g in summary.groups if g.local_peers},
    )


def _facts(r: RankSummary) -> tuple[Any, ...]:
    """``_rank_info``'s values after ``pg_status``, of a JSON summary's rank."""
    return (
        r.rank, r.world_size, r.identity, r.stacks, r.dump_time_ns, r.heartbeat_ns, r.stalled,
        r.alive, r.wrapped, r.exit_kind, r.exit_detail, r.startup_phase,
    )  # fmt: skip


# a rank table's columns in the order of ``_rank_info``'s values after ``ident``
_FACT_COLUMNS = (
    "stacks", "dump_time_ns", "heartbeat_ns", "stalled", "alive", "wrapped", "exit_kind",
    "exit_detail", "startup_phase",
)  # fmt: skip


def _split_lists(texts: list[str]) -> dict[str, list[Any]]:
    """The all_to_all split columns of a rank summary's entries (their ``splits`` texts)."""
    parsed = [parse_splits(t) if t else None for t in texts]
    if not any(parsed):
        return {}
    return {
        "input_split_sizes": [p[0] if p else None for p in parsed],
        "output_split_sizes": [p[1] if p else None for p in parsed],
    }


def _rank_info(
    source: str,
    pg_status: dict[str, dict[str, int]],
    rank: int,
    world_size: int | None,
    ident: dict[str, Any],
    stacks: str | None,
    dump_time_ns: int | None,
    heartbeat_ns: int | None,
    stalled: bool | None,
    alive: bool | None,
    wrapped: bool,
    exit_kind: str | None,
    exit_detail: str | None,
    startup_phase: str | None,
) -> RankInfo:
    """A rank's identity and failure facts, the one mapping for a JSON summary's rank
    (``_facts``) and a packed host's rank table (``_FACT_COLUMNS``): both give the values
    in this order."""
    pid, local_rank = ident.get("pid"), ident.get("local_rank")
    return RankInfo(
        rank=rank,
        source=source,
        format=FORMAT,
        version="1",
        host=ident.get("host") or None,
        pid=pid if isinstance(pid, int) else None,
        local_rank=local_rank if isinstance(local_rank, int) else None,
        device=ident.get("device") or None,
        device_id=ident.get("device_id") or None,
        world_size=world_size,
        comm_lib_version=ident.get("comm_lib_version") or None,
        pg_status=pg_status,
        stacks=stacks,
        dump_time_ns=dump_time_ns if dump_time_ns is not None else heartbeat_ns,
        stalled=stalled,
        alive=alive,
        wrapped=wrapped,
        exit_kind=exit_kind,
        exit_detail=exit_detail,
        last_heartbeat_ns=heartbeat_ns,
        startup_phase=startup_phase,
    )


# -- packed host summaries: columns -> Arrow -------------------------------------------------

# derived text per distinct string, shared by every file a process reads
_OPS: dict[str, str] = {}
_SITES: dict[str, str | None] = {}


class _Interner:
    """One string table for a batch of hosts (each host's table maps into it)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}
        self.texts: list[str] = [""]

    def codes(self, strings: list[str]) -> np.ndarray:
        index, texts = self.index, self.texts
        out = np.empty(len(strings), dtype=np.int64)
        for k, t in enumerate(strings):
            i = index.get(t)
            if i is None:
                i = index[t] = len(texts)
                texts.append(t)
            out[k] = i
        return out


def _dict_column(codes: np.ndarray, dictionary: pa.Array, null: np.ndarray | None) -> pa.Array:
    """Every caller's codes come out of a look-up table of ``len(dictionary)`` values (the
    file's own numbers never index the dictionary): Arrow's pass checking them is skipped."""
    idx = pa.array(codes.astype(np.int32, copy=False), mask=null)
    return pa.DictionaryArray.from_arrays(idx, dictionary, safe=False)


def _text_column(
    codes: np.ndarray,
    texts: list[str],
    null: np.ndarray | None = None,
    derive: Callable[[str], str] | None = None,
) -> pa.Array:
    """Rows naming strings of a batch's table, as a dictionary column of only the distinct
    values they use (``derive``: of each string, e.g. its op name). The table holds every
    string of every column, so sharing it made each column's categories the whole table:
    131,072 op "categories" at fleet scale, and a rule looked up per category."""
    seen = np.zeros(len(texts), dtype=bool)  # marked, not counted: half the time of bincount
    seen[codes] = True
    used = np.flatnonzero(seen)
    target = np.zeros(len(texts), dtype=np.int32)  # the codes' own type: no cast after
    index: dict[str, int] = {}
    values: list[str] = []
    for u in used.tolist():
        v = texts[u] if derive is None else derive(texts[u])
        i = index.get(v)
        if i is None:
            i = index[v] = len(values)
            values.append(v)
        target[u] = i
    return _dict_column(target[codes], pa.array(values, type=pa.string()), null)


def _distinct(codes: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(codes, return_inverse=True)`` for codes in ``[0, size)``, by counting
    rather than sorting: a partial of 131,072 ranks has 8 M rows a column."""
    # out of range (the caller's bug): sorted all the same
    return dense_unique(codes, max(size, 1)) or np.unique(codes, return_inverse=True)


def _op_name(text: str) -> str:
    name = _OPS.get(text)
    if name is None:
        name = _OPS[text] = op_name(text)
    return name


def packed_to_arrow(
    hosts: list[PackedHost], sources: list[str]
) -> tuple[pa.Table, list[PackedRanks]]:
    """Several decoded packed host summaries -> one entries table (all their ranks, host
    after host) and, per host, its ranks (``PackedRanks``: one RankDump per rank when
    asked, ``entries`` left None; its ``rows``: each rank's rows of the table, in order),
    mapped as ``summary_to_rank_dump`` maps each rank. One table per batch: building Arrow
    arrays costs per call, not per row."""
    strings = _Interner()
    n_host = np.array([h.n_entries for h in hosts], dtype=np.int64)
    n_total = int(n_host.sum())
    group_index: dict[tuple[str, str], int] = {}
    group_names: list[str] = []
    group_descs: list[str] = []
    all_blocks: list[PackedRanks] = []
    # per host and per rank, small tables; the rows are mapped through them in one pass
    code_parts: list[np.ndarray] = []  # host string -> batch string
    gmap_parts: list[list[int]] = []  # host group -> batch group
    rank_groups: list[int] = []  # per rank: its groups' host group indices, then -1
    rank_base: list[int] = []  # where each rank's list starts in rank_groups
    rank_ids: list[int] = []
    rank_rows: list[int] = []
    backends: list[str] = []
    for packed, source in zip(hosts, sources, strict=True):
        code_parts.append(strings.codes(packed.strings))
        found = []
        for g in packed.groups:
            i = group_index.get((g[0], g[1]))
            if i is None:
                i = group_index[(g[0], g[1])] = len(group_names)
                group_names.append(g[0])
                group_descs.append(g[1])
            found.append(i)
        gmap_parts.append(found + [-1])
        ranks = packed.rank_table
        for gs in ranks["groups"]:
            rank_base.append(len(rank_groups))
            rank_groups.extend(g[0] for g in gs)
            rank_groups.append(-1)
        rank_ids.extend(ranks["rank"])
        backends.extend(
            b or "" for b in ranks["identity"].get("backend", [None] * len(ranks["rank"]))
        )
        rows = np.diff(packed.offsets).tolist()
        rank_rows.extend(rows)
        all_blocks.append(_block(packed, source, rows))

    # row -> host, rank, group numbers in 32 bits: each such array is fresh memory a row
    host_of_row = np.repeat(np.arange(len(hosts), dtype=np.int32), n_host)
    rank_of_row = np.repeat(
        np.arange(len(rank_ids), dtype=np.int32), np.array(rank_rows, dtype=np.int64)
    )

    def batch(name: str, dtype: Any, fill: int = 0) -> np.ndarray:
        """A column over every host (a host without it: ``fill``); a file read alone (a
        partial: millions of rows) hands its own array over, not a copy, in its own type."""
        arrays = [h.columns.get(name) for h in hosts]
        if not arrays:
            return np.zeros(0, dtype=dtype)
        if len(arrays) == 1 and arrays[0] is not None:
            return arrays[0]
        return np.concatenate(
            [
                a if a is not None else np.full(h.n_entries, fill, dtype=dtype)
                for a, h in zip(arrays, hosts, strict=True)
            ]
        )

    def nulls(name: str) -> np.ndarray | None:
        """Where a nullable column has no value (a host without the column: everywhere)."""
        if all(name in h.columns and name not in h.valid for h in hosts):
            return None
        ok = np.concatenate(
            [
                h.valid.get(name, np.ones(h.n_entries, bool))
                if name in h.columns
                else np.zeros(h.n_entries, bool)
                for h in hosts
            ]
        )
        return None if ok.all() else ~ok

    if len(hosts) == 1 and np.array_equal(code_parts[0], np.arange(len(code_parts[0]))):
        # one file whose strings are all distinct: its codes are the batch's already
        text_codes = {name: batch(name, np.uint32) for name in STRING_COLUMNS}
    else:
        str_base = np.concatenate([[0], np.cumsum([len(c) for c in code_parts])]).astype(np.int64)
        code_all = np.concatenate(code_parts) if code_parts else np.zeros(1, dtype=np.int64)
        row_str_base = str_base[:-1][host_of_row]
        text_codes = {
            name: code_all[row_str_base + batch(name, np.uint32).astype(np.int64)]
            for name in STRING_COLUMNS
        }
    ints = {  # in their file's own types where they are only compared (states, flags)
        name: batch(name, np.int64)
        for name in NUMBER_COLUMNS
        if name not in ("group", "duration_ms")  # mapped through group tables; a float
    }
    d = batch("duration_ms", np.float64, fill=0)
    duration_null = nulls("duration_ms")
    duration = np.where(duration_null, np.nan, d) if duration_null is not None else d
    # rank-local group index -> host group -> batch group
    local = batch("group", np.int16, fill=-1).astype(np.int32)
    table = np.array(rank_groups or [-1], dtype=np.int32)
    at = np.array(rank_base or [0], dtype=np.int32)[rank_of_row]
    at += np.maximum(local, 0)
    host_group = table[at]
    host_group[local < 0] = -1
    gmap = np.array([i for part in gmap_parts for i in part] or [-1], dtype=np.int32)
    at = np.maximum(host_group, 0)
    if len(hosts) > 1:
        gbase = np.concatenate([[0], np.cumsum([len(p) for p in gmap_parts])]).astype(np.int32)
        at += gbase[:-1][host_of_row]
    group = gmap[at]
    group[host_group < 0] = -1
    rank = np.array(rank_ids, dtype=np.int32)[rank_of_row]
    backend = strings.codes(backends)[rank_of_row] if backends else np.zeros(0, np.int64)

    texts = strings.texts
    op = text_codes["op"]
    if not backend.any():
        profiling = _text_column(op, texts)
    else:  # an op without a prefix takes its rank's backend's, as the JSON path does
        ops, op_of = _distinct(op, len(texts))
        backends_used, backend_of = _distinct(backend, len(texts))
        uniq, inverse = _distinct(op_of * len(backends_used) + backend_of,
                                  len(ops) * len(backends_used))  # fmt: skip
        values = []
        for key in uniq.tolist():
            t = texts[int(ops[key // len(backends_used)])]
            b = texts[int(backends_used[key % len(backends_used)])]
            values.append(t if (":" in t or not b or not t) else f"{b}:{t}")
        profiling = _dict_column(inverse, pa.array(values, type=pa.string()), None)
    stack = text_codes["stack"]
    site = text_codes["call_site"]
    # a call site as recorded, else derived from the stack (one derivation per text)
    key = np.where(site != 0, site, len(texts) + stack.astype(np.int64))
    uniq, inverse = _distinct(key, 2 * len(texts))
    site_texts = []
    for k in uniq.tolist():
        if k < len(texts):
            site_texts.append(texts[k])
        else:
            t = texts[k - len(texts)]
            if t not in _SITES:
                _SITES[t] = call_site_of(t) if t else None
            site_texts.append(_SITES[t])
    site_values = pa.array(site_texts, type=pa.string())
    site_null = np.asarray(site_values.is_null())[inverse] if site_values.null_count else None
    if site_null is not None:  # the rows are masked; a category may not be null
        site_values = pa.array(["" if t is None else t for t in site_texts], type=pa.string())
    state = ints["state"]
    state_of = np.array([STATES.index(x) for x in STATE_CODES], dtype=np.int32)
    retired = ints["retired"]
    retired_null = nulls("retired")
    done = state == STATE_CODES.index("completed")
    retired_b = (
        np.where(retired_null, done, retired != 0) if retired_null is not None else retired != 0
    )
    if not any("retired" in h.columns for h in hosts):
        retired_b = done
    no_group = group < 0
    group = np.maximum(group, 0)
    # one dictionary entry per distinct name (and desc): categories must be unique
    name_values, name_of = np.unique(np.array(group_names or [""], object), return_inverse=True)
    desc_values, desc_of = np.unique(np.array(group_descs or [""], object), return_inverse=True)
    names = pa.array(name_values.tolist(), type=pa.string())
    descs = pa.array(desc_values.tolist(), type=pa.string())
    arrays = {
        "rank": pa.array(rank, type=pa.int32()),
        "record_id": pa.array(ints["record_id"]),
        "pg_name": _dict_column(name_of[group], names, no_group if no_group.any() else None),
        "pg_desc": _dict_column(desc_of[group], descs, no_group if no_group.any() else None),
        "collective_seq_id": pa.array(ints["collective_seq_id"]),
        "p2p_seq_id": pa.array(ints["p2p_seq_id"]),
        "is_p2p": pa.array(ints["is_p2p"] != 0),
        "op": _text_column(op, texts, derive=_op_name),
        "profiling_name": profiling,
        "peer": pa.array(ints["peer"].astype(np.int32), mask=nulls("peer")),
        "state": _dict_column(state_of[state], pa.array(list(STATES), type=pa.string()), None),
        "time_created_ns": pa.array(ints["time_created_ns"]),
        "time_started_ns": pa.array(ints["time_started_ns"], mask=nulls("time_started_ns")),
        "time_completed_ns": pa.array(ints["time_completed_ns"], mask=nulls("time_completed_ns")),
        "duration_ms": pa.array(duration, mask=np.isnan(duration)),
        "retired": pa.array(retired_b),
        "timeout_ms": pa.array(ints["timeout_ms"], mask=nulls("timeout_ms")),
        "call_site": _dict_column(inverse, site_values, site_null),
    }
    for name in ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "thread_id"):
        arrays[name] = _text_column(text_codes[name], texts)
    for name in ("thread_name", "stack", "error"):
        codes = text_codes[name]
        empty = codes == 0
        arrays[name] = _text_column(codes, texts, empty if empty.any() else None)
    codes, inverse = _distinct(text_codes["splits"], len(texts))
    arrays.update(split_columns([texts[c] for c in codes.tolist()], inverse))
    columns = []
    for f in ENTRY_SCHEMA:
        array = arrays.get(f.name)
        if array is None:  # a column summaries do not keep
            array = pa.nulls(n_total, f.type)
        columns.append(array if array.type == f.type else array.cast(f.type))
    assert all(len(c) == n_total for c in columns)
    return pa.Table.from_arrays(columns, schema=ENTRY_SCHEMA), all_blocks


@dataclass
class PackedRanks:
    """A packed host's ranks as its rank table's columns, made into RankDumps (entries
    None) where they are used: a worker process hands these over rather than the dumps
    (building and pickling 32,768 RankDumps cost a worker more than decoding their rows).
    ``rows``: each rank's rows in the batch's table, in order."""

    source: str
    table: dict[str, Any]  # PackedHost.rank_table
    groups: list[tuple[str, str, tuple[int, ...], bool]]  # name, desc, ranks, local
    newest: list[int | None]  # each rank's newest time_created_ns
    rows: list[int]
    format: str = FORMAT

    @property
    def ranks(self) -> list[int]:
        return self.table["rank"]

    def dumps(self) -> list[RankDump]:
        """One RankDump per rank. The ranks share their ProcessGroup objects (and member
        tuples): the loader counts them by identity."""
        t = self.table
        n = len(t["rank"])
        ident_keys = list(t["identity"])
        idents = (
            ({k: v for k, v in zip(ident_keys, values, strict=True) if v is not None}
             for values in zip(*t["identity"].values(), strict=True))
            if ident_keys else ({} for _ in range(n))
        )  # fmt: skip
        shared: dict[tuple[int, int | None], tuple[ProcessGroup, bool, bool]] = {}
        dumps = []
        for rank, world, ident, gs, notes, newest, facts in zip(
            t["rank"], t["world_size"], idents, t["groups"], t["notes"], self.newest,
            zip(*(t[name] for name in _FACT_COLUMNS), strict=True),
            strict=True,
        ):  # fmt: skip
            process_groups = {}
            pg_status = {}
            default_pg_all = False
            local_peers = set()
            for g in gs:  # [host group, five frontier values]
                found = shared.get((g[0], world))
                if found is None:
                    name, desc, ranks, local = self.groups[g[0]]
                    everyone = all_ranks_of(name, desc, ranks, world)
                    pg = ProcessGroup(name, desc, () if everyone else ranks)
                    found = shared[(g[0], world)] = (pg, everyone, bool(local))
                pg, everyone, local = found
                name = pg.name
                default_pg_all = default_pg_all or everyone
                process_groups[name] = pg
                pg_status[name] = {
                    "last_enqueued_collective": g[1],
                    "last_started_collective": g[2],
                    "last_completed_collective": g[3],
                }
                if local:
                    local_peers.add(name)
            dumps.append(
                RankDump(
                    rank_info=_rank_info(self.source, pg_status, rank, world, ident, *facts),
                    entries=None,  # type: ignore[arg-type]
                    process_groups=process_groups,
                    notes=list(notes),
                    max_time_created_ns=newest,
                    default_pg_all=default_pg_all,
                    unmapped_peer_groups=local_peers,
                )
            )
        return dumps


def _block(packed: PackedHost, source: str, rows: list[int]) -> PackedRanks:
    """A host's ranks, with each rank's newest time_created_ns (all ranks at once)."""
    offsets = packed.offsets
    sizes = np.diff(offsets)
    newest: list[int | None] = [None] * len(sizes)
    created = packed.columns.get("time_created_ns")
    if created is not None and len(created):
        has = np.flatnonzero(sizes > 0)
        if len(has):
            peaks = np.maximum.reduceat(created[: offsets[-1]], offsets[has]).tolist()
            for k, v in zip(has.tolist(), peaks, strict=True):
                newest[k] = v
    groups = [(g[0], g[1], g[3], g[4]) for g in packed.groups]
    return PackedRanks(source, packed.rank_table, groups, newest, rows)


def packed_to_rank_dumps(packed: PackedHost, source: str) -> list[RankDump]:
    """One host's ranks as RankDumps, each ``entries`` a slice of one table."""
    table, (block,) = packed_to_arrow([packed], [source])
    dumps = block.dumps()
    offset = 0
    for d, n in zip(dumps, block.rows, strict=True):
        d.entries = table.slice(offset, n)
        offset += n
    return dumps


def read_many(
    paths: list[Path],
) -> tuple[list[list[RankDump] | PackedRanks | DumpError], pa.Table | None, list[list[int]]]:
    """Several files at once (the loader's batch of a worker's chunk): per file its
    RankDumps, or its ``PackedRanks`` (a packed host summary's ranks, RankDumps when
    asked), or the ``DumpError`` that refused it. Packed host summaries are decoded into
    one table for all of them (``rows``: per file, each rank's row count in it, in order;
    its dumps' ``entries`` are None); other summaries come with their own tables (``rows``
    empty for them)."""
    out: list[list[RankDump] | PackedRanks | DumpError] = []
    packed: list[bytes] = []
    packed_at: list[int] = []
    for path in paths:
        try:
            data, stored = read_content(path)
            if looks_packed(data):  # bounded by its own reader, decoded below with the rest
                packed.append(data)
                packed_at.append(len(out))
                out.append([])
            else:
                limits.check_json(data, stored=stored)  # as for a JSON dump
                out.append([summary_to_rank_dump(s, str(path)) for s in decode(data)])
        except (SummaryError, limits.InputRefused) as e:
            out.append(DumpError(str(e)))
        except DumpError as e:
            out.append(e)
    hosts: list[PackedHost] = []
    host_paths: list[str] = []
    where: list[int] = []
    for i, host in zip(packed_at, decode_packed_many(packed), strict=True):
        if isinstance(host, SummaryError):
            out[i] = DumpError(str(host))
        else:
            hosts.append(host)
            host_paths.append(str(paths[i]))
            where.append(i)
    rows: list[list[int]] = [[] for _ in out]
    if not hosts:
        return out, None, rows
    table, blocks = packed_to_arrow(hosts, host_paths)
    for i, b in zip(where, blocks, strict=True):
        out[i] = b
        rows[i] = b.rows
    return out, table, rows
