"""Alignment: put the members' records of each process group side by side.

Collectives are matched by ``(pg_name, collective_seq_id)``: PyTorch counts that id per group
on every member, so the n-th collective of a group is the same call on every rank.

Rules (see docs/verdict.md):

* **Coalesced units.** Several entries of one rank sharing a group and a collective seq id
  (the ops of a coalescing block, with or without a trailing ``coalesced`` entry) form one
  unit: its op is ``coalesced`` and its sizes/dtypes are the parts joined with ``;``.
* **Completion.** An entry counts as completed when its state says ``completed``, when it is
  ``retired``, or — only for ranks whose states never leave ``scheduled`` (Gloo) — when its
  seq id is at or below the rank's ``pg_status`` ``last_completed_collective``. It is known
  *not* completed when any of those sources exist and none says so; otherwise unknown.
* **Last issued** on a group is the larger of the highest recorded seq id and the
  ``pg_status`` ``last_enqueued_collective``; a rank with entries up to seq n certainly
  issued everything up to n, so a ring buffer that dropped older entries (``first_seq`` > 1)
  never makes a rank look missing for older seqs.
* **P2P.** ``p2p_seq_id`` counts per rank per group, not per peer pair, so it is not matched
  across ranks. Instead, within a group, the k-th send from r to p (in record order) matches
  the k-th recv at p from r. A pair whose either side wrapped is marked ``uncertain``.
* **Agreement.** ``sig`` is equal on two members iff every attribute that the op's family
  requires to agree does (``frtools.model.ops.SEMANTICS``): an all_to_all's per-rank split
  sizes, a gather's root output, a coalesced block of sends are not compared.

Everything is columnar (pandas over the Arrow entries); the only Python loops are per rank
or per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from frtools.analyze import membership
from frtools.formats.torch_fr import NCCL_ENGINES
from frtools.model.codes import among, dense_unique
from frtools.model.ops import OP, P2P_OPS, OpFamily, family_of, parts_must_agree
from frtools.model.trace import ProcessGroup, Trace

SIGNATURE_COLUMNS = ("op", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes")
_LOAD_COLUMNS = (
    "rank",
    "record_id",
    "pg_name",
    "collective_seq_id",
    "p2p_seq_id",
    "is_p2p",
    "op",
    "peer",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "state",
    "time_created_ns",
    "retired",
    "call_site",
    "error",
)


@dataclass
class GroupTimeline:
    """One process group's aligned view: what each member did at each seq."""

    pg: ProcessGroup
    ops: pd.DataFrame  # this group's collective units (see Alignment.collectives)
    status: pd.DataFrame  # per member: first_seq, last_issued, last_completed

    def seq_view(self) -> pd.DataFrame:
        """Rows = seq, columns = member rank, values = op (NaN where not recorded)."""
        return self.ops.pivot_table(
            index="seq", columns="rank", values="op", aggfunc="first", observed=True
        )


@dataclass
class Alignment:
    collectives: pd.DataFrame
    """One row per (rank, pg_name, seq) unit: signature columns, ``sig`` (an int, equal iff
    the op family and every attribute that family requires to agree are equal), state,
    completed (nullable bool), time_created_ns, record_id, call_site, and ``parts`` (the
    ops of a coalesced unit joined with ``;``; null for a single op)."""
    p2p: pd.DataFrame
    """One row per P2P op: rank, pg_name, op, peer, sender, receiver, pair_index, sizes,
    completed, time_created_ns, call_site, uncertain."""
    status: pd.DataFrame
    """Index (rank, pg_name): first_seq, last_issued, last_completed (nullable ints)."""
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    process_groups: dict[str, ProcessGroup] = field(default_factory=dict)
    state_informative: dict[int, bool] = field(default_factory=dict)
    counters: pd.DataFrame | None = None
    """pg_status as each rank stated it: rank, pg_name, ps_enqueued, ps_completed (NA where
    a counter is unknown), one row per rank and group."""

    def group(self, pg_name: str) -> GroupTimeline:
        pg = self.process_groups.get(pg_name) or ProcessGroup(pg_name)
        ops = self.collectives[self.collectives["pg_name"] == pg_name]
        try:
            status = self.status.xs(pg_name, level="pg_name")
        except KeyError:
            status = self.status.iloc[0:0]
        return GroupTimeline(pg, ops, status)


_STRING_COLUMNS = ("pg_name", "op", "state", "call_site", "error") + SIGNATURE_COLUMNS[1:]
# only P2P ops use these: loaded for their rows alone (``_p2p_frame``), not for millions of
# collectives (16,384 ranks: 0.5 GB of the frame, a float64 of NaN and an int64 of 0)
_P2P_ONLY = ("p2p_seq_id", "peer")
_NULLABLE_STRINGS = ("call_site", "error")


def _entries_frame(trace: Trace) -> pd.DataFrame:
    """The entries as pandas, strings as categoricals (groupbys on millions of rows).

    Built column by column from the Arrow buffers: a dictionary column becomes a
    categorical from its codes in one concatenation (``Table.to_pandas`` re-checks every
    rank's chunk and costs 2x more at thousands of ranks)."""
    names = [name for name in _LOAD_COLUMNS if name not in _P2P_ONLY]
    table = trace.entries.select(names)
    data: dict[str, Any] = {}
    for name in names:
        col = table.column(name)
        if name in _STRING_COLUMNS:
            data[name] = _categorical(col, null_as=None if name in _NULLABLE_STRINGS else "")
        elif name in ("collective_seq_id", "p2p_seq_id"):
            data[name] = _ints(col, 0)
        elif name == "record_id":
            data[name] = _ints(col, -1)
        elif name == "retired":  # masked bool: 2 bytes a row, not an object pointer
            data[name] = pd.arrays.BooleanArray(
                _bools(col), col.is_null().to_numpy(zero_copy_only=False)
            )
        elif name == "is_p2p":
            data[name] = _bools(col)
        elif name == "time_created_ns" and col.null_count == 0:
            data[name] = _ints(col, 0)
        elif name == "rank":
            data[name] = col.to_numpy()
        else:
            data[name] = col.to_pandas()
    df = pd.DataFrame(data, copy=False)
    op = df["op"].array
    p2p = np.append(op.categories.isin(list(P2P_OPS)), False)  # per category; -1: none
    if p2p.any():  # by the op's code: not a hash look-up of every row (8 M rows: 0.25 s)
        df["is_p2p"] = df["is_p2p"].to_numpy() | p2p[op.codes]
    if df["time_created_ns"].dtype != np.int64:
        # Unknown times sort by record order within the rank.
        df["time_created_ns"] = df["time_created_ns"].fillna(df["record_id"]).astype(np.int64)
    return df


def _p2p_frame(df: pd.DataFrame, trace: Trace) -> pd.DataFrame:
    """The P2P rows of the entries frame, with the columns only they use (``_P2P_ONLY``),
    in ``_LOAD_COLUMNS``' order."""
    p2p = df[df["is_p2p"]].copy()
    rows = p2p.index.to_numpy(dtype=np.int64)
    for name in _P2P_ONLY:
        col = _take_rows(trace.entries.column(name), rows)
        at = sum(1 for c in _LOAD_COLUMNS[: _LOAD_COLUMNS.index(name)] if c in p2p.columns)
        values = _ints(col, 0) if name == "p2p_seq_id" else col.to_pandas().to_numpy()
        p2p.insert(at, name, values)
    return p2p


def _take_rows(col: pa.ChunkedArray, rows: np.ndarray) -> pa.ChunkedArray:
    """``col.take(rows)`` for ascending ``rows``, from the chunks that hold them: Arrow's
    take of a chunked array touches every chunk (16,384 ranks: 0.7 s and 278 MB of page
    faults to take the few P2P rows, or none)."""
    ends = np.cumsum([len(chunk) for chunk in col.chunks], dtype=np.int64)
    cuts = np.searchsorted(rows, ends)
    parts, start = [], 0
    for k, cut in enumerate(cuts.tolist()):
        if cut > start:
            local = rows[start:cut] - (ends[k] - len(col.chunk(k)))
            parts.append(col.chunk(k).take(pa.array(local)))
        start = cut
    return pa.chunked_array(parts, type=col.type)


def _ints(col: pa.ChunkedArray, null: int) -> np.ndarray:
    """int64 numpy, nulls as ``null`` (one copy: the concatenation of the ranks' chunks)."""
    if col.null_count:
        col = col.fill_null(null)
    return col.to_numpy().astype(np.int64, copy=False)


def _bools(col: pa.ChunkedArray) -> np.ndarray:
    if col.null_count:
        col = col.fill_null(False)
    return col.to_numpy(zero_copy_only=False).astype(bool, copy=False)


def _categorical(col: pa.ChunkedArray, null_as: str | None) -> pd.Categorical:
    """A categorical with ``""`` among its categories; nulls become ``null_as``."""
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    chunks = col.chunks
    first = chunks[0].dictionary if chunks else pa.array([], type=pa.string())
    if not all(c.dictionary.equals(first) for c in chunks[1:]):
        col = col.unify_dictionaries()
        chunks = col.chunks
        first = chunks[0].dictionary
    categories = pd.Index(first.to_pylist(), dtype=object)
    if not categories.is_unique:  # a reader left a repeated value: let pandas sort it out
        cat = col.to_pandas().astype("category")
        cat = cat.cat.add_categories([""]) if "" not in cat.cat.categories else cat
        return cat.fillna(null_as).array if null_as is not None else cat.array
    if "" not in categories:
        categories = categories.append(pd.Index([""], dtype=object))
    # the codes written chunk by chunk into the narrow type pandas keeps them in (an int32
    # concatenation of every row first: 131 MB more new memory at 16,384 ranks), checked
    # first as ``from_codes`` would (a narrow type would wrap a code out of range)
    low, high = pc.min_max(
        pa.chunked_array([c.indices for c in chunks], type=col.type.index_type)
    ).values()
    if low.is_valid and (low.as_py() < 0 or high.as_py() >= len(first)):
        raise ValueError(f"dictionary code out of range in column {col.type}")
    k = len(categories)
    codes = np.empty(len(col), dtype=np.int8 if k < 127 else np.int16 if k < 32767 else np.int32)
    null = -1 if null_as is None else categories.get_loc(null_as)
    at = 0
    for chunk in chunks:
        indices = chunk.indices
        if indices.null_count:
            indices = indices.fill_null(null)
        codes[at : at + len(indices)] = indices.to_numpy()
        at += len(indices)
    return pd.Categorical.from_codes(codes, dtype=pd.CategoricalDtype(categories))


def group_members(trace: Trace, seen: pd.DataFrame | None = None) -> dict[str, tuple[int, ...]]:
    """Global member ranks of every group (``frtools.analyze.membership.members``), who
    recorded on a group read from ``seen`` (rank and pg_name of every entry)."""
    if seen is None or not len(seen):
        return membership.members(trace, (), dict)
    # the column's own narrow codes: no int64 copy of every row (16,384 ranks: 262 MB)
    codes, index = category_codes(seen["pg_name"], wide=False)
    names = [str(n) for n in index]  # not Index lookups one by one (~10^5 groups)
    used = np.flatnonzero(_in_use(codes, len(names))).tolist()

    def recorded_on(unknown: set[str]) -> dict[str, list[int]]:
        wanted = [c for c in used if names[c] in unknown]
        sub = seen[np.isin(codes, wanted)]
        by_group = sub.groupby("pg_name", sort=False, observed=True)["rank"].unique()
        return {str(name): [int(r) for r in ranks] for name, ranks in by_group.items()}

    return membership.members(trace, [names[c] for c in used], recorded_on)


def _pg_status_frame(trace: Trace) -> pd.DataFrame:
    """(rank, group, last enqueued, last completed) per group a rank's record counts ops
    on; a counter that is not a non-negative int is unknown (NA). Built as columns: one
    row per rank and group is ~800,000 rows at 131,072 ranks."""
    ranks: list[int] = []
    names: list[str] = []
    enqueued: list[int | None] = []
    completed: list[int | None] = []
    for info in trace.ranks.values():
        rank = info.rank
        for pg_name, st in info.pg_status.items():
            if not isinstance(st, dict):
                continue
            ranks.append(rank)
            names.append(pg_name if type(pg_name) is str else str(pg_name))
            enqueued.append(st.get("last_enqueued_collective"))
            completed.append(st.get("last_completed_collective"))
    return pd.DataFrame(
        {
            "rank": np.array(ranks, dtype=np.int64),
            "pg_name": pd.Series(names, dtype=object),
            "ps_enqueued": _counters(enqueued),
            "ps_completed": _counters(completed),
        }
    )


def _counters(values: list) -> pd.arrays.IntegerArray:
    """Int64, NA where a value is not a non-negative int."""
    if not all(type(v) is int or v is None for v in values):
        values = [int(v) if isinstance(v, int) else None for v in values]
    out = pd.array(values, dtype="Int64")
    if len(out):
        out[(out < 0).fillna(False).to_numpy(dtype=bool)] = pd.NA
    return out


def _duplicated_units(coll: pd.DataFrame) -> np.ndarray:
    """Rows sharing (rank, group, seq) with another row: the parts of a coalesced unit.

    Counted in the (rank, group) seq spans where those are dense (``_duplicates_by_span``),
    else the three are packed into one int64 and sorted in place (a hash-based
    ``duplicated`` costs 10x more on millions of rows, and every temporary array here is
    64 MB at 131,072 ranks: first-touched memory is slow on a VM); a MultiIndex where the
    values do not fit."""
    if not len(coll):
        return np.zeros(0, dtype=bool)
    pg = category_codes(coll["pg_name"], wide=False)[0]
    rank = coll["rank"].to_numpy()
    seq = coll["collective_seq_id"].to_numpy()
    if not (rank.min() >= 0 and rank.max() < 2**22 and pg.max() < 2**16 - 1 and seq.max() < 2**25):
        return pd.MultiIndex.from_arrays([rank, pg, seq]).duplicated(keep=False)

    by_span = _duplicates_by_span(rank, pg, seq)
    if by_span is not None:
        return by_span

    def packed() -> np.ndarray:  # (rank << 41) | (group code + 1 << 25) | seq, in place
        key = rank.astype(np.int64)
        key <<= 16
        key += pg
        key += 1
        key <<= 25
        key |= seq
        return key

    key = packed()
    key.sort()
    if not (key[1:] == key[:-1]).any():
        return np.zeros(len(coll), dtype=bool)
    key = packed()
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    same = ordered[1:] == ordered[:-1]
    dup = np.zeros(len(key), dtype=bool)
    dup[order] = np.r_[same, False] | np.r_[False, same]
    return dup


def _duplicates_by_span(rank: np.ndarray, pg: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
    """``_duplicated_units`` without a sort: each (rank, group) gets its seq span, each row
    a slot in the spans laid end to end, and a slot counted twice is a repeated unit (a few
    passes over the rows; sorting 8 M packed keys cost 0.8 s here). None where the spans
    hold many more slots than there are rows (seqs far apart): the sort is cheaper then."""
    most = 4 * len(seq) + 1024
    groups = int(pg.max()) + 2  # codes -1 .. max
    # 32-bit numbers where they fit: every array here is fresh memory, and on a VM its first
    # touch costs more than the arithmetic (8 M rows: 1.3 s on fresh memory, 0.3 s reused)
    small = most < 2**31 - 2**26
    # (rank, group) numbered densely, no look-up, where its four per-pair arrays are small
    # beside the rows (every rank on every group: a few groups); else the pairs in use
    if (int(rank.max()) + 1) * groups <= len(seq) // 16:
        unit = rank.astype(np.int32 if small else np.int64)
        unit *= groups
        unit += pg
        unit += 1
        units = (int(rank.max()) + 1) * groups
    else:
        unit, units = _rank_group_units(rank, pg, most)
    seq = seq.astype(np.int64, copy=False)
    low = np.full(units, np.iinfo(np.int64).max)
    np.minimum.at(low, unit, seq)
    high = np.full(units, np.iinfo(np.int64).min)
    np.maximum.at(high, unit, seq)
    span = np.maximum(high - low + 1, 0)  # 0: a (rank, group) with no row
    total = int(span.sum())
    if total > most:
        return None
    base = np.cumsum(span) - span - low  # >= -2**25: seqs are below that
    slot = base.astype(np.int32)[unit] if small else base[unit]
    del unit
    slot += seq
    # each slot keeps one of its rows (whichever): a row that is not kept shares its slot;
    # a block of row numbers at a time, not an array of every row's
    kept = np.empty(total, dtype=slot.dtype)
    lost = np.empty(len(slot), dtype=bool)
    for start in range(0, len(slot), _BLOCK):
        kept[slot[start : start + _BLOCK]] = _row_numbers(start, len(slot), slot.dtype)
    for start in range(0, len(slot), _BLOCK):
        rows = _row_numbers(start, len(slot), slot.dtype)
        np.not_equal(kept[slot[start : start + _BLOCK]], rows, out=lost[start : start + _BLOCK])
    if not lost.any():
        return np.zeros(len(seq), dtype=bool)
    shared = np.zeros(total, dtype=bool)
    shared[slot[lost]] = True
    return shared[slot]


def _row_numbers(start: int, n: int, dtype: np.dtype) -> np.ndarray:
    """The numbers of the rows of the block that begins at ``start`` (of ``n`` rows)."""
    return np.arange(start, min(start + _BLOCK, n), dtype=dtype)


def _rank_group_units(rank: np.ndarray, pg: np.ndarray, most: int) -> tuple[np.ndarray, int]:
    """Each row's (rank, group) numbered among the pairs that occur, and how many occur.
    A box's group table lists groups its rank never recorded on (16,384 boxes: 51,210
    groups, 2,057 in use): among the groups in use, (rank, group) is a small int key that a
    look-up table numbers (0.4 s there); else the pairs are hashed (1.4 s)."""
    in_use = np.cumsum(_in_use(pg, int(pg.max()) + 1), dtype=np.int64)  # code -> number + 1
    groups = int(in_use[-1]) + 1 if len(in_use) else 1
    if (int(rank.max()) + 1) * groups <= most:
        key = rank.astype(np.int32 if most < 2**31 else np.int64)
        key *= groups
        key += np.append(in_use - 1, -1).astype(key.dtype)[pg]
        key += 1
    else:
        key = rank.astype(np.int64)
        key <<= 16
        key += pg
    unit, uniq = _numbered(key, most)
    return unit, len(uniq)


def _in_use(codes: np.ndarray, n: int) -> np.ndarray:
    """Per code 0 … n-1, whether some row has it (-1, none, is left out: it flags an
    extra last slot), one pass over narrow codes instead of a bincount of an int64 copy."""
    on = np.zeros(n + 1, dtype=bool)
    on[codes] = True
    return on[:-1]


def _collapse_coalesced(coll: pd.DataFrame) -> pd.DataFrame:
    dup = _duplicated_units(coll)
    if not dup.any():
        return coll.assign(parts=_no_parts(len(coll)))
    single = coll[~dup]
    multi = coll[dup].sort_values("record_id")
    keys = ["rank", "pg_name", "collective_seq_id"]

    def _join(values: pd.Series) -> str:
        return ";".join(v for v in values if v)

    agg = multi.groupby(keys, sort=False, observed=True).agg(
        record_id=("record_id", "min"),
        is_p2p=("is_p2p", "first"),
        input_sizes=("input_sizes", _join),
        output_sizes=("output_sizes", _join),
        input_dtypes=("input_dtypes", _join),
        output_dtypes=("output_dtypes", _join),
        state=("state", "last"),
        time_created_ns=("time_created_ns", "min"),
        retired=("retired", "last"),
        call_site=("call_site", "first"),
        error=("error", "first"),
        parts=("op", lambda v: ";".join(str(x) for x in v)),
    )
    agg["op"] = "coalesced"
    agg = agg.reset_index()
    single = single.assign(parts=_no_parts(len(single)))
    agg["parts"] = agg["parts"].astype("category")
    out = pd.concat([single, agg[single.columns]], ignore_index=True)
    out["parts"] = out["parts"].astype(object).astype("category")
    return out


def _no_parts(n: int) -> pd.Categorical:
    """A ``parts`` column of nulls, one byte a row (millions of rows are single ops)."""
    return pd.Categorical.from_codes(
        np.full(n, -1, dtype=np.int8), categories=pd.Index([], dtype=object)
    )


def align(trace: Trace) -> Alignment:
    """Match every group's members' entries by seq (collectives) and by peer pair (P2P)."""
    # the counters frame is a Python loop over every rank's groups; it runs in a thread
    # while the entries frame is built (Arrow and numpy, which let go of the GIL)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="frtools-counters") as pool:
        counted = pool.submit(_pg_status_frame, trace)
        df = _entries_frame(trace)
        members = group_members(trace, df[["rank", "pg_name"]])
        ps = counted.result()

    # A rank whose states ever leave "scheduled" has informative states (NCCL, frtools).
    state = df["state"].array  # by the category codes: isin hashed every row (0.9 s)
    moving = np.append(np.asarray(state.categories.isin(["completed", "started"])), False)
    slot, ranks = _rank_slots(df["rank"].to_numpy())
    per_rank = np.zeros(len(ranks), dtype=bool)
    for start in range(0, len(slot), _BLOCK):
        rows = slice(start, start + _BLOCK)
        per_rank[slot[rows][moving[state.codes[rows]]]] = True
    del slot
    state_informative = {r: bool(per_rank[i]) for i, r in enumerate(ranks.tolist()) if r >= 0}

    is_coll = ~df["is_p2p"] & (df["collective_seq_id"] > 0)
    # all collectives (the usual case at scale): share the columns, copy none
    coll = df.copy(deep=False) if is_coll.all() else df[is_coll]
    coll = _collapse_coalesced(coll).rename(columns={"collective_seq_id": "seq"})
    coll["informative"] = _per_row(per_rank, ranks, coll["rank"].to_numpy())
    if len(ps) and bool((~coll["informative"] & coll["retired"].isna()).any()):
        coll = coll.merge(ps, on=["rank", "pg_name"], how="left")
        coll["completed"] = _completion(coll, use_pg_status=True)
        coll = coll.drop(columns=["ps_enqueued", "ps_completed"])
    else:  # every entry says itself whether it completed: pg_status is not needed per entry
        coll["completed"] = _completion(coll, use_pg_status=False)
    if len(ps) and len(coll):
        coll["completed"] = _settled_by_counters(coll, ps, trace)
    coll["sig"] = _signature_ids(coll)

    status = _status(coll, ps)

    p2p = _p2p_frame(df, trace)
    p2p["informative"] = _per_row(per_rank, ranks, p2p["rank"].to_numpy())
    p2p["completed"] = _completion(p2p, use_pg_status=False)
    if len(p2p):
        p2p["completed"] = _settled_by_batch(p2p, ps, trace)
    p2p = _pair_p2p(p2p, trace)

    return Alignment(
        collectives=coll.reset_index(drop=True),
        p2p=p2p.reset_index(drop=True),
        status=status,
        members=members,
        process_groups=dict(trace.process_groups),
        state_informative=state_informative,
        counters=ps,
    )


def _per_row(per_rank: np.ndarray, ranks: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Each row's value of ``per_rank`` (one per rank of ``ranks``, sorted, which holds every
    rank of ``rank``): by a table indexed by rank where ranks are 0..N as usual."""
    if len(rank) and len(ranks) and ranks[0] >= 0 and ranks[-1] < 4 * len(rank) + 1024:
        table = np.zeros(int(ranks[-1]) + 1, dtype=per_rank.dtype)
        table[ranks] = per_rank
        return table[rank]
    return per_rank[_rank_slots(rank, ranks)[0]]


def _rank_slots(rank: np.ndarray, ranks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's index into the sorted distinct ranks (given, or found here): a dense
    lookup table where ranks are 0..N as usual, a binary search only where they are not.
    The ranks' own int type indexes the table (no int64 copy of every row's rank)."""
    if not np.issubdtype(rank.dtype, np.integer):
        rank = rank.astype(np.int64)
    if not len(rank):
        return np.zeros(0, dtype=np.int64), (ranks if ranks is not None else rank)
    top, low = int(rank.max()), int(rank.min())
    dense = low >= 0 and top < 4 * len(rank) + 1024
    if ranks is None:
        if dense:
            seen = np.zeros(top + 1, dtype=bool)
            seen[rank] = True
            ranks = np.flatnonzero(seen)
        else:
            ranks = np.unique(rank)
    if dense and (not len(ranks) or ranks[-1] >= top):
        pos = np.zeros(
            int(ranks[-1]) + 1 if len(ranks) else 1,
            dtype=np.int32 if len(ranks) < 2**31 else np.int64,
        )
        pos[ranks] = np.arange(len(ranks))
        return pos[rank], ranks
    return np.searchsorted(ranks, rank), ranks


def category_codes(values: pd.Series, wide: bool = True) -> tuple[np.ndarray, pd.Index]:
    """int64 codes (-1 for missing) and the distinct values of a column; ``wide=False``: a
    categorical's own codes as they are (int8/int16: no copy of millions of rows)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        codes = values.cat.codes.to_numpy()
        return (codes.astype(np.int64) if wide else codes), values.cat.categories
    codes, uniques = pd.factorize(values)
    return codes.astype(np.int64), pd.Index(uniques)


def as_texts(values: pd.Series) -> np.ndarray:
    """``values.astype(str).to_numpy()``: an object array of str, NaN where missing. A
    categorical of text is taken by code from its categories, a column already of str is
    passed as it is: pandas 3 would build an Arrow string array row by row and convert
    it back (131,072 ranks: ~0.1 s a column, half a second a diagnosis)."""
    dtype = values.dtype
    if isinstance(dtype, pd.CategoricalDtype) and dtype.categories.inferred_type == "string":
        names = np.asarray(dtype.categories, dtype=object)
        return np.append(names, np.nan).take(values.cat.codes.to_numpy())
    if values.dtype == object:
        array = values.to_numpy()
        if set(map(type, array)) <= {str}:
            return array
    return values.astype(str).to_numpy()


def text_series(values: pd.Series) -> pd.Series:
    """``as_texts`` as a Series that keeps Python str objects, for a text column of a frame
    built to be merged or ``isin``-tested: pandas 3 would make it an Arrow string column,
    whose construction copies every row into Arrow and whose ``isin`` converts every value
    asked for one at a time (131,072 ranks: a set of ~400,000 group names, 0.07-0.09 s a
    call)."""
    return pd.Series(as_texts(values), dtype=object, copy=False)


def at_seqs(seq: pd.Series, wanted: Iterable[int]) -> np.ndarray:
    """Which rows of a seq column are at one of the ``wanted`` seqs: a flag per seq number
    (``among``), not ``Series.isin``'s hash look-up of every row (32.8 M rows: 1 s)."""
    return among(seq.to_numpy(), np.fromiter(wanted, dtype=np.int64))


_FAMILIES = {f: i + 1 for i, f in enumerate(OpFamily)}
# rows a step of a column-at-a-time pass works on: its temporaries stay a few MB
_BLOCK = 1 << 20


def _signature_ids(coll: pd.DataFrame) -> np.ndarray:
    """One int per distinct agreement key: the op's family, the family of each part of a
    coalesced unit, and each attribute the family requires to agree (0 where it may differ).
    The categorical codes are packed into one int64 (a 5-column group-by costs several times
    more on millions of units); per-row rules come from per-category lookups, so the cost
    does not depend on the op table, and one column is packed at a time (millions of rows:
    no second copy of every column)."""
    if not len(coll):
        return np.zeros(0, dtype=np.int64)
    op_codes, op_cats = category_codes(coll["op"])
    op_rules = [parts_must_agree(str(c)) for c in op_cats] + [frozenset()]
    # per op category (+ one slot for code -1): family id and the attributes it compares
    fam_of_cat = np.array([_FAMILIES[family_of(str(c))] for c in op_cats] + [0], dtype=np.int64)
    parts_key = None
    blocks = None
    parts = coll["parts"] if "parts" in coll.columns else None
    if parts is not None and parts.notna().any():
        block = parts.notna().to_numpy()
        uniq, inverse = np.unique(parts[block].astype(str).to_numpy(), return_inverse=True)
        # the parts' families, so that one block of all_gathers agrees with another
        fam_text = [";".join(family_of(p).value for p in t.split(";") if p) for t in uniq]
        _, fam_ids = np.unique(np.array(fam_text, dtype=object), return_inverse=True)
        parts_key = np.zeros(len(coll), dtype=np.int64)
        parts_key[block] = fam_ids[inverse] + 1
        blocks = (block, uniq, inverse)
    columns = [attr for attr in SIGNATURE_COLUMNS if attr != OP]
    sizes = [len(coll[attr].cat.categories) + 2 if isinstance(coll[attr].dtype, pd.CategoricalDtype)
             else int(coll[attr].nunique(dropna=False)) + 2 for attr in columns]  # fmt: skip
    radix_all = (len(_FAMILIES) + 1) * (1 if parts_key is None else int(parts_key.max()) + 1)
    for n in sizes:
        radix_all *= n
    if radix_all >= 2**62:  # too many distinct values to pack: number the tuples
        frame = pd.DataFrame({"f": fam_of_cat[op_codes]})
        if parts_key is not None:
            frame["p"] = parts_key
        for attr in columns:
            checked = _checked(attr, op_rules, op_codes, blocks)
            codes = category_codes(coll[attr])[0] + 1
            frame[attr] = codes if checked is None else np.where(checked, codes, 0)
        return frame.groupby(list(frame.columns), sort=False).ngroup().to_numpy(np.int64)
    narrow_ops = category_codes(coll["op"], wide=False)[0]
    key = fam_of_cat[narrow_ops]
    radix = len(_FAMILIES) + 1
    if parts_key is not None:
        key += parts_key * radix
        radix *= int(parts_key.max()) + 1
    for attr, n in zip(columns, sizes, strict=True):
        codes, _ = category_codes(coll[attr], wide=False)
        # code c adds (c + 1) * radix, code -1 (at the table's end) 0
        table = np.append(np.arange(1, n - 1, dtype=np.int64) * radix, 0)
        checked = _checked(attr, op_rules, narrow_ops, blocks)
        for start in range(0, len(key), _BLOCK):  # no int64 copy of every row's codes
            part = table[codes[start : start + _BLOCK]]
            if checked is not None:
                part[~checked[start : start + _BLOCK]] = 0
            key[start : start + _BLOCK] += part
        radix *= n
    return key  # equal iff the keys are: numbering them costs a 30 M-entry hash table


def _checked(attr: str, op_rules: list, op_codes: np.ndarray, blocks) -> np.ndarray | None:  # noqa: ANN001
    """Per row: whether the row's op (or coalesced block) requires ``attr`` to agree; None
    where every row's does (no mask of millions of rows to build and apply)."""
    rule = np.array([attr in rule for rule in op_rules], dtype=bool)
    if blocks is None and rule[:-1].all() and (not len(op_codes) or op_codes.min() >= 0):
        return None
    mask = rule[op_codes]
    if blocks is not None:
        block, uniq, inverse = blocks
        mask[block] = np.array([attr in parts_must_agree(t) for t in uniq], dtype=bool)[inverse]
    return mask


def on_nccl(
    names: pa.ChunkedArray | pa.Array, engines: tuple[str, ...] = NCCL_ENGINES
) -> np.ndarray:
    """Per row of a profiling-name column, whether an NCCL engine (of ``engines``) recorded
    it (worked on a dictionary's values, a few hundred, where the column has one)."""

    def starts(values: pa.Array) -> np.ndarray:
        hit = np.zeros(len(values), dtype=bool)
        for prefix in engines:
            hit |= pc.fill_null(pc.starts_with(values, prefix), False).to_numpy(
                zero_copy_only=False
            )
        return hit

    parts = []
    for chunk in names.chunks if isinstance(names, pa.ChunkedArray) else [names]:
        if pa.types.is_dictionary(chunk.type):
            hit = np.append(starts(chunk.dictionary), False)  # a null row reads the last
            idx = pc.fill_null(chunk.indices, len(chunk.dictionary)).to_numpy()
            parts.append(hit[idx])
        else:
            parts.append(starts(chunk))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _settled_by_batch(p2p: pd.DataFrame, ps: pd.DataFrame, trace: Trace) -> pd.Series:
    """P2P completion where an NCCL engine batched the ops (``batch_isend_irecv``): each op
    of a batch is recorded without events (ProcessGroupNCCL::pointToPoint while coalescing),
    so it stays ``scheduled`` and unretired for good, and a dump of the active ops keeps
    it until the ring overwrites it; the batch's own entry (op ``coalesced``, the same
    p2p_seq_id) carries the state. An op of a batch completed when that entry did, or, where
    the entry has left the record, when the group's ``last_completed`` counter passed it —
    read as a P2P counter only where it exceeds every collective seq the rank recorded on
    the group (the counter holds the seq of whichever work completed last), and only from
    ProcessGroupNCCL (``nccl:``: nccl2's hook counts op ids)."""
    done = p2p["completed"]
    batch = (p2p["op"] == "coalesced").to_numpy()
    pending = ~done.eq(True).fillna(False).to_numpy(dtype=bool)
    # a batch's ops never move, whatever the rank's other entries say (a dump of the whole
    # ring with timing); the counters only speak for ranks whose states say nothing
    open_ = pending & ~p2p["informative"].to_numpy(dtype=bool)
    if not open_.any() and not batch.any():
        return done
    names = _take_rows(trace.entries.column("profiling_name"), p2p.index.to_numpy(np.int64))
    nccl = on_nccl(names)
    open_ &= nccl
    out = done.copy()
    key = pd.DataFrame(
        {
            "rank": p2p["rank"].to_numpy(),
            "pg_name": text_series(p2p["pg_name"]).to_numpy(),
            "p2p_seq_id": p2p["p2p_seq_id"].to_numpy(),
        }
    )
    if batch.any():
        own = (
            key[batch]
            .assign(_batch=done[batch].to_numpy())
            .drop_duplicates(["rank", "pg_name", "p2p_seq_id"], keep="last")
        )
        hit = key.merge(own, how="left", on=["rank", "pg_name", "p2p_seq_id"])["_batch"]
        took = pending & nccl & ~batch & hit.eq(True).fillna(False).to_numpy(dtype=bool)
        out[took] = True
        open_ &= ~took
    open_ &= on_nccl(names, ("nccl:",))
    if open_.any() and len(ps):
        coll_seq = p2p["collective_seq_id"].to_numpy()
        per = key.assign(_c=coll_seq).groupby(["rank", "pg_name"], sort=False)["_c"].max()
        both = _completed_counters(ps).to_frame().join(per, how="inner")
        bound = both.loc[both["ps_completed"] > both["_c"], "ps_completed"]
        out[open_ & _at_or_below(key, key["p2p_seq_id"].to_numpy(), bound)] = True
    return out


def _completed_counters(ps: pd.DataFrame) -> pd.Series:
    """The known ``last_completed`` counters, by (rank, group name)."""
    counters = ps.assign(pg_name=ps["pg_name"].astype(str)).set_index(["rank", "pg_name"])
    return counters["ps_completed"].dropna()


def _at_or_below(key: pd.DataFrame, seq: np.ndarray, bound: pd.Series) -> np.ndarray:
    """Per row of ``key`` (rank, pg_name): its ``seq`` is at or below ``bound`` of its
    (rank, group); False where ``bound`` has none."""
    if not len(bound):
        return np.zeros(len(key), dtype=bool)
    at = key[["rank", "pg_name"]].merge(
        bound.astype("int64").rename("_bound").reset_index(), how="left", on=["rank", "pg_name"]
    )["_bound"]
    return seq <= at.fillna(-1).to_numpy()


def _settled_by_counters(coll: pd.DataFrame, ps: pd.DataFrame, trace: Trace) -> pd.Series:
    """Collectives of ProcessGroupNCCL without states of their own (no timing, unretired)
    at or below their group's ``last_completed`` counter completed. Such an entry in a dump
    of the active ops is an op of a ``_coalescing_manager`` block (recorded without events,
    ``scheduled`` for good); its block's own entry, which had the events, completed and left
    the dump. Only on a group whose entries show no P2P (each entry records the group's P2P
    count): the counter holds the seq of whichever work completed last."""
    done = coll["completed"]
    open_ = (
        ~coll["informative"].to_numpy(dtype=bool)
        & coll["retired"].notna().to_numpy(dtype=bool)
        & ~done.eq(True).fillna(False).to_numpy(dtype=bool)
    )
    if not open_.any():
        return done
    ranks = np.unique(coll["rank"].to_numpy()[open_])
    e = trace.entries
    mine = e.filter(
        pc.is_in(e["rank"], value_set=pa.array(ranks, type=e.schema.field("rank").type))
    )
    if not len(mine):
        return done
    per = (
        pd.DataFrame(
            {
                "rank": mine["rank"].to_numpy(),
                "pg_name": mine["pg_name"].cast(pa.string()).to_numpy(zero_copy_only=False),
                "_p2p": mine["p2p_seq_id"].fill_null(0).to_numpy()
                | mine["is_p2p"].fill_null(False).to_numpy(zero_copy_only=False),
                "_nccl": on_nccl(mine["profiling_name"], ("nccl:",)),
            }
        )
        .groupby(["rank", "pg_name"], sort=False)
        .agg(_p2p=("_p2p", "max"), _nccl=("_nccl", "all"))
    )
    ok = per[(per["_p2p"] == 0) & per["_nccl"]]
    bound = _completed_counters(ps)
    bound = bound[bound.index.isin(ok.index)]
    key = pd.DataFrame({"rank": coll["rank"].to_numpy(), "pg_name": as_texts(coll["pg_name"])})
    passed = open_ & _at_or_below(key, coll["seq"].to_numpy(), bound)
    if not passed.any():
        return done
    out = done.copy()
    out[passed] = True
    return out


def _completion(df: pd.DataFrame, use_pg_status: bool) -> pd.Series:
    """Nullable bool: True completed, False known not completed (a failed op, with its
    ``error``, is not completed whatever its state says), NA unknown."""
    if not len(df):
        return pd.Series(pd.array([], dtype="boolean"), index=df.index)
    failed = df["error"].notna()
    done = (df["state"] == "completed") | (df["retired"].fillna(False).astype(bool))
    done = done & ~failed
    known = df["informative"] | df["retired"].notna() | failed
    if use_pg_status:
        pc = df["ps_completed"]
        seq = df["seq"] if "seq" in df.columns else df["collective_seq_id"]
        by_status = (
            (~df["informative"]) & df["retired"].isna() & pc.notna() & (seq <= pc.fillna(-1))
        )
        done = done | (by_status.fillna(False).astype(bool) & ~failed)
        known = known | (pc.notna() & df["retired"].isna())
    d = done.to_numpy(dtype=bool)
    out = pd.arrays.BooleanArray(d, ~known.to_numpy(dtype=bool) & ~d)
    return pd.Series(out, index=df.index)


def _status(coll: pd.DataFrame, ps: pd.DataFrame) -> pd.DataFrame:
    if len(coll):
        # group by one int64 (rank, group code) key: a two-column group-by with a
        # categorical costs several times more on millions of units
        codes, cats = category_codes(coll["pg_name"], wide=False)
        rank = coll["rank"].to_numpy()
        # 32-bit where it fits (fresh memory is what costs, as in _duplicates_by_span)
        wide = (int(rank.max()) + 1) * (len(cats) + 1) >= 2**31
        key = rank.astype(np.int64 if wide else np.int32)
        key *= len(cats) + 1
        key += codes
        key += 1  # code -1 (no group) shifted to 0
        # one factorization, then the three reductions by index (pandas' group-by hashes the
        # 8 M keys once per group-by: 2.5x slower at 131,072 ranks)
        unit, k = _numbered(key, 4 * len(key) + 1024)
        del key
        seq = coll["seq"].to_numpy().astype(np.int64, copy=False)
        first = np.full(len(k), np.iinfo(np.int64).max)
        np.minimum.at(first, unit, seq)
        last = np.full(len(k), np.iinfo(np.int64).min)
        np.maximum.at(last, unit, seq)
        done = coll["completed"].to_numpy(dtype=bool, na_value=False)
        # over every row, a row not done counting as the lowest int (masking both arrays
        # first made this 5x slower at 131,072 ranks), a block of rows at a time
        lowest = np.iinfo(np.int64).min
        done_seq = np.full(len(k), lowest, dtype=np.int64)
        for start in range(0, len(seq), _BLOCK):
            rows = slice(start, start + _BLOCK)
            np.maximum.at(done_seq, unit[rows], np.where(done[rows], seq[rows], lowest))
        none_done = done_seq == lowest
        done_seq[none_done] = -1
        agg = pd.DataFrame(
            {
                "first_seq": first,
                "last_seq": last,
                "done_seq": pd.arrays.IntegerArray(done_seq, none_done),
            }
        )
        names = np.asarray([None, *cats], dtype=object).take(k % (len(cats) + 1))
        per = agg.set_axis(
            pd.MultiIndex.from_arrays([k // (len(cats) + 1), names], names=["rank", "pg_name"])
        )
    else:
        per = pd.DataFrame(
            columns=["first_seq", "last_seq", "done_seq"],
            index=pd.MultiIndex.from_arrays([[], []], names=["rank", "pg_name"]),
        )
    ps_idx = ps.set_index(["rank", "pg_name"])
    status = per.join(ps_idx, how="outer")
    # Recorded entries are the truth where they exist: on Gloo, unrecorded send/recv bump
    # pg_status' counters, so pg_status only fills in for groups without entries.
    has_entries = status["last_seq"].notna()
    last_issued = (
        status["last_seq"].astype("Int64").where(has_entries, status["ps_enqueued"].astype("Int64"))
    )
    last_completed = (
        status["done_seq"]
        .astype("Int64")
        .where(has_entries, status["ps_completed"].astype("Int64"))
    )
    out = pd.DataFrame(
        {
            "first_seq": status["first_seq"].astype("Int64"),
            "last_issued": last_issued.astype("Int64"),
            "last_completed": last_completed.astype("Int64"),
        },
        index=status.index,
    )
    return out.sort_index()


def _numbered(key: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize`` of non-negative int keys, numbered in sorted order: by a dense
    look-up table where the keys are below ``most`` (hashing 8 M keys cost 0.3 s here)."""
    got = dense_unique(key, most)
    if got is None:
        return pd.factorize(key)
    k, number = got
    return number, k


def _pair_p2p(p2p: pd.DataFrame, trace: Trace) -> pd.DataFrame:
    if not len(p2p):
        for col in ("sender", "receiver", "pair_index", "uncertain"):
            p2p[col] = pd.Series(dtype=object)
        return p2p
    is_send = p2p["op"].str.contains("send")
    peer = p2p["peer"].astype("Int64")
    p2p["sender"] = np.where(is_send, p2p["rank"], peer.fillna(-1).astype(np.int64))
    p2p["receiver"] = np.where(is_send, peer.fillna(-1).astype(np.int64), p2p["rank"])
    p2p["direction"] = np.where(is_send, "send", "recv")
    p2p = p2p.sort_values(["rank", "record_id"])
    p2p["pair_index"] = p2p.groupby(
        ["pg_name", "sender", "receiver", "direction"], sort=False
    ).cumcount()
    wrapped = {r for r, info in trace.ranks.items() if info.wrapped}
    p2p["uncertain"] = (
        p2p["sender"].isin(wrapped) | p2p["receiver"].isin(wrapped) | peer.isna().to_numpy()
    )
    return p2p
