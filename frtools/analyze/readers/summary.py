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

from pathlib import Path

import numpy as np
import pyarrow as pa

from frtools.formats import limits
from frtools.formats.summary import (
    RankSummary,
    SummaryError,
    decode,
    looks_like_summary,
)
from frtools.formats.summary_packed import (
    STATE_CODES,
    PackedHost,
    decode_packed,
    looks_packed,
    to_summaries,
)
from frtools.model.ops import op_name
from frtools.model.trace import ENTRY_SCHEMA, STATES, ProcessGroup, RankInfo, entries_table

from .base import DumpError, RankDump, read_content
from .frtools_snapshot import ALL_RANKS_ABOVE, call_site_of

FORMAT = "frtools-summary"


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


def read_summaries(path: Path) -> list[RankSummary]:
    """The ``RankSummary`` objects in a file of any summary encoding."""
    data, stored = read_content(path)
    try:
        if looks_packed(data):
            return to_summaries(decode_packed(data))
        limits.check_json(data, stored=stored)
        return decode(data)
    except (SummaryError, limits.InputRefused) as e:
        raise DumpError(str(e)) from None


def summary_to_rank_dump(summary: RankSummary, source: str) -> RankDump:
    """Map a summary onto the Trace model (as ``frtools_snapshot`` maps a black box)."""
    ident = summary.identity
    backend = ident.get("backend") or None
    info = RankInfo(
        rank=summary.rank,
        source=source,
        format=FORMAT,
        version="1",
        host=ident.get("host") or None,
        pid=ident.get("pid") if isinstance(ident.get("pid"), int) else None,
        local_rank=ident.get("local_rank") if isinstance(ident.get("local_rank"), int) else None,
        device=ident.get("device") or None,
        device_id=ident.get("device_id") or None,
        world_size=summary.world_size,
        comm_lib_version=ident.get("comm_lib_version") or None,
        pg_status={
            g.name: {
                "last_enqueued_collective": g.last_enqueued_collective,
                "last_started_collective": g.last_started_collective,
                "last_completed_collective": g.last_completed_collective,
            }
            for g in summary.groups
        },
        stacks=summary.stacks,
        dump_time_ns=(
            summary.dump_time_ns if summary.dump_time_ns is not None else summary.heartbeat_ns
        ),
        stalled=summary.stalled,
        alive=summary.alive,
        wrapped=summary.wrapped,
        exit_kind=summary.exit_kind,
        exit_detail=summary.exit_detail,
        last_heartbeat_ns=summary.heartbeat_ns,
    )
    world = summary.world_size
    default_pg_all = False
    process_groups = {}
    for g in summary.groups:
        ranks = g.ranks
        if _all_ranks_of(g.name, g.desc, ranks, world):
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


def _all_ranks_of(name: str, desc: str, ranks: tuple[int, ...], world: int | None) -> bool:
    """The default group of a big job, listing every rank: passed as "all ranks" (as the
    snapshot reader does), checked without comparing 100,000-int tuples (members are sorted
    and distinct, so first, last and count decide)."""
    return (
        (name == "0" or desc == "default_pg")
        and world is not None
        and world > ALL_RANKS_ABOVE
        and len(ranks) == world
        and ranks[0] == 0
        and ranks[-1] == world - 1
    )


# -- packed host summaries: columns -> Arrow -------------------------------------------------

# derived text per distinct string, shared by every file a process reads
_OPS: dict[str, str] = {}
_SITES: dict[str, str | None] = {}


def _dictionary(codes: np.ndarray, texts: list[str], valid: np.ndarray | None = None) -> pa.Array:
    """A dictionary column holding only the texts ``codes`` use (codes index ``texts``)."""
    used, inverse = np.unique(codes, return_inverse=True)
    values = pa.array([texts[i] for i in used.tolist()], type=pa.string())
    idx = pa.array(inverse.astype(np.int32), mask=None if valid is None else ~valid)
    return pa.DictionaryArray.from_arrays(idx, values)


def packed_to_rank_dumps(packed: PackedHost, source: str) -> list[RankDump]:
    """Map a packed host summary onto the Trace: one entries table for all its ranks (each
    RankDump's ``entries`` a slice of it), as ``summary_to_rank_dump`` maps each rank."""
    cols = packed.columns
    valid = packed.valid
    strings = packed.strings
    n = packed.n_entries
    counts = np.diff(packed.offsets)
    rank_ids = np.array([r.rank for r in packed.ranks], dtype=np.int32)
    which = np.repeat(np.arange(len(packed.ranks)), counts)

    def ints(name: str) -> np.ndarray:
        a = cols.get(name)
        return np.zeros(n, dtype=np.int64) if a is None else a

    def nullable(name: str, dtype: pa.DataType) -> pa.Array:
        a = cols.get(name)
        if a is None:
            return pa.nulls(n, type=dtype)
        ok = valid.get(name)
        return pa.array(a, type=dtype, mask=None if ok is None else ~ok)

    def text(name: str, empty_is_null: bool) -> pa.Array:
        a = cols.get(name)
        if a is None:
            return pa.nulls(n, type=ENTRY_SCHEMA.field(name).type)
        return _dictionary(a, strings, (a != 0) if empty_is_null else None)

    # group: rank-local index -> the host's group table -> distinct names
    local = cols.get("group")
    local = np.full(n, -1, dtype=np.int64) if local is None else local.astype(np.int64)
    table_of_rank = [np.array([hg for hg, _ in r.groups], dtype=np.int64) for r in packed.ranks]
    base = np.concatenate([[0], np.cumsum([len(t) for t in table_of_rank])]).astype(np.int64)
    flat = np.concatenate(table_of_rank + [np.zeros(1, dtype=np.int64)])
    has_group = local >= 0
    host_group = np.where(has_group, flat[np.where(has_group, base[which] + local, 0)], 0)
    names = [g[0] for g in packed.groups] or [""]
    descs = [g[1] for g in packed.groups] or [""]

    op_codes = ints("op")
    op_texts = [_OPS.get(t) or _OPS.setdefault(t, op_name(t)) for t in strings]
    backends = {r.identity.get("backend") or None for r in packed.ranks}
    if len(backends) == 1:
        backend = next(iter(backends))
        profiling = pa.array(
            [t if (":" in t or not backend or not t) else f"{backend}:{t}" for t in strings]
        )
        profiling_col = pa.DictionaryArray.from_arrays(
            pa.array(op_codes.astype(np.int32)), profiling
        )
    else:  # ranks of one host on different backends: per entry, as the JSON path does
        texts = [strings[i] for i in op_codes.tolist()]
        bk = [packed.ranks[k].identity.get("backend") or None for k in which.tolist()]
        profiling_col = pa.array(
            [
                t if (":" in t or not b or not t) else f"{b}:{t}"
                for t, b in zip(texts, bk, strict=True)
            ]
        ).dictionary_encode()

    stack = ints("stack")
    site_col = cols.get("call_site")
    site_codes = np.zeros(n, dtype=np.int64) if site_col is None else site_col
    derived = [_SITES[t] if t in _SITES else _SITES.setdefault(t, call_site_of(t) if t else None)
               for t in strings]  # fmt: skip
    sites = pa.array(
        [
            strings[c] if c else derived[k]
            for c, k in zip(site_codes.tolist(), stack.tolist(), strict=True)
        ],
        type=pa.string(),
    ).dictionary_encode()

    state = ints("state")
    state_of = np.array([STATES.index(s) for s in STATE_CODES], dtype=np.int32)
    retired_raw = cols.get("retired")
    done = state == STATE_CODES.index("completed")
    if retired_raw is not None:
        ok = valid.get("retired", np.ones(n, dtype=bool))
        retired = np.where(ok, retired_raw != 0, done)
    else:
        retired = done
    duration = cols.get("duration_ms")
    peer = cols.get("peer")
    arrays = {
        "rank": pa.array(rank_ids[which] if n else np.zeros(0, np.int32), type=pa.int32()),
        "record_id": pa.array(ints("record_id")),
        "pg_name": _dictionary(host_group, names, has_group),
        "pg_desc": _dictionary(host_group, descs, has_group),
        "collective_seq_id": pa.array(ints("collective_seq_id")),
        "p2p_seq_id": pa.array(ints("p2p_seq_id")),
        "is_p2p": pa.array(ints("is_p2p") != 0),
        "op": _dictionary(op_codes, op_texts),
        "profiling_name": profiling_col,
        "peer": nullable("peer", pa.int32()) if peer is not None else pa.nulls(n, pa.int32()),
        "input_sizes": text("input_sizes", False),
        "output_sizes": text("output_sizes", False),
        "input_dtypes": text("input_dtypes", False),
        "output_dtypes": text("output_dtypes", False),
        "state": pa.DictionaryArray.from_arrays(
            pa.array(state_of[state]), pa.array(list(STATES), type=pa.string())
        ),
        "time_created_ns": pa.array(ints("time_created_ns")),
        "time_started_ns": nullable("time_started_ns", pa.int64()),
        "time_completed_ns": nullable("time_completed_ns", pa.int64()),
        "duration_ms": (
            pa.nulls(n, pa.float64())
            if duration is None
            else pa.array(duration, mask=~valid.get("duration_ms", ~np.isnan(duration)))
        ),
        "retired": pa.array(retired),
        "timeout_ms": nullable("timeout_ms", pa.int64()),
        "thread_id": text("thread_id", False),
        "thread_name": text("thread_name", True),
        "call_site": sites,
        "stack": text("stack", True),
        "error": text("error", True),
    }
    columns = []
    for f in ENTRY_SCHEMA:
        array = arrays[f.name]
        columns.append(array if array.type == f.type else array.cast(f.type))
    table = pa.Table.from_arrays(columns, schema=ENTRY_SCHEMA)

    created = ints("time_created_ns")
    dumps = []
    for k, r in enumerate(packed.ranks):
        lo, hi = int(packed.offsets[k]), int(packed.offsets[k + 1])
        ident = r.identity
        groups = [packed.groups[hg] for hg, _ in r.groups]
        info = RankInfo(
            rank=r.rank,
            source=source,
            format=FORMAT,
            version="1",
            host=ident.get("host") or None,
            pid=ident.get("pid") if isinstance(ident.get("pid"), int) else None,
            local_rank=(
                ident.get("local_rank") if isinstance(ident.get("local_rank"), int) else None
            ),
            device=ident.get("device") or None,
            device_id=ident.get("device_id") or None,
            world_size=r.world_size,
            comm_lib_version=ident.get("comm_lib_version") or None,
            pg_status={
                g[0]: {
                    "last_enqueued_collective": f[0],
                    "last_started_collective": f[1],
                    "last_completed_collective": f[2],
                }
                for g, (_, f) in zip(groups, r.groups, strict=True)
            },
            stacks=r.stacks,
            dump_time_ns=r.dump_time_ns if r.dump_time_ns is not None else r.heartbeat_ns,
            stalled=r.stalled,
            alive=r.alive,
            wrapped=r.wrapped,
            exit_kind=r.exit_kind,
            exit_detail=r.exit_detail,
            last_heartbeat_ns=r.heartbeat_ns,
        )
        default_pg_all = False
        process_groups = {}
        for name, desc, _text, ranks, _local in groups:
            if _all_ranks_of(name, desc, ranks, r.world_size):
                default_pg_all = True
                ranks = ()
            process_groups[name] = ProcessGroup(name=name, desc=desc, ranks=ranks)
        dumps.append(
            RankDump(
                rank_info=info,
                entries=table.slice(lo, hi - lo),
                process_groups=process_groups,
                notes=list(r.notes),
                max_time_created_ns=int(created[lo:hi].max()) if hi > lo else None,
                default_pg_all=default_pg_all,
                unmapped_peer_groups={g[0] for g in groups if g[4]},
            )
        )
    return dumps
