"""What the HTML report and the timeline draw, computed once from the Trace, the Alignment
and the Verdict: each rank's progress per process group, each rank's last ops as time
slices, where the hang began, and how late each rank enters collectives.

Nothing here re-judges the diagnosis: the Verdict says who is guilty and who waits; these
views only lay out the records around it. Everything is sized for 4,096+ ranks: the
entries are touched with numpy over whole columns, and per-rank detail is bounded by the
caller (``last`` ops per rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from frtools.analyze.align import Alignment
from frtools.analyze.verdict import Verdict
from frtools.model.ops import P2P_OPS
from frtools.model.trace import Trace

# progress of one member of one group, as the map colours it
DONE = "done"  # issued the group's latest op, and it completed
PENDING = "pending"  # issued the group's latest op, not completed
UNKNOWN = "unknown"  # issued the group's latest op; completion not recorded
BEHIND = "behind"  # never issued the group's latest op
NO_RECORD = "no record"  # no usable record of this rank

# an op slice's state, as the timeline colours it
COMPLETED = "completed"
NOT_COMPLETED = "not completed"
COMPLETION_UNKNOWN = "unknown"


@dataclass
class GroupProgress:
    """One process group: per member the last collective issued and completed."""

    name: str
    desc: str
    members: tuple[int, ...]
    last_issued: list[int | None]
    last_completed: list[int | None]
    states: list[str]

    @property
    def latest(self) -> int | None:
        issued = [s for s in self.last_issued if s is not None]
        return max(issued) if issued else None

    @property
    def in_step(self) -> bool:
        return all(s in (DONE, UNKNOWN) for s in self.states)


@dataclass
class MapRow:
    """One row of the group x rank map: groups of one kind (desc) whose members do not
    overlap, so each rank has at most one cell per row."""

    label: str
    desc: str
    groups: list[int]  # indices into ProgressMap.groups


@dataclass
class ProgressMap:
    ranks: list[int]  # every rank the job had, ascending
    groups: list[GroupProgress]
    rows: list[MapRow]


def progress_map(trace: Trace, alignment: Alignment) -> ProgressMap:
    """Every group's members with their last issued / last completed collective seq ids."""
    status = alignment.status
    by_key: dict[tuple[int, str], tuple[int | None, int | None]] = {}
    if len(status):
        ranks = status.index.get_level_values(0).to_numpy()
        names = status.index.get_level_values(1).astype(str)
        issued = status["last_issued"].to_numpy(dtype=object, na_value=None)
        done = status["last_completed"].to_numpy(dtype=object, na_value=None)
        for r, n, i, d in zip(ranks.tolist(), names, issued, done, strict=True):
            by_key[(int(r), str(n))] = (i, d)
    present = set(trace.ranks)
    informative = alignment.state_informative
    groups: list[GroupProgress] = []
    members = dict(alignment.members)
    for name, pg in trace.process_groups.items():
        if name not in members and pg.ranks:
            members[name] = tuple(pg.ranks)
    for name in sorted(members, key=_name_key):
        ranks_of = members[name]
        if not ranks_of:
            continue
        pg = alignment.process_groups.get(name) or trace.process_groups.get(name)
        issued_list: list[int | None] = []
        done_list: list[int | None] = []
        for r in ranks_of:
            i, d = by_key.get((r, name), (None, None))
            issued_list.append(None if i is None else int(i))
            done_list.append(None if d is None else int(d))
        known = [i for i in issued_list if i is not None]
        latest = max(known) if known else None
        states = []
        for r, i, d in zip(ranks_of, issued_list, done_list, strict=True):
            if r not in present:
                states.append(NO_RECORD)
            elif latest is not None and (i is None or i < latest):
                states.append(BEHIND)
            elif d is not None and i is not None and d >= i:
                states.append(DONE)
            elif d is not None or informative.get(r, False):
                states.append(PENDING)
            else:
                states.append(UNKNOWN)
        groups.append(
            GroupProgress(
                name=name,
                desc=(pg.desc if pg is not None else "") or "",
                members=tuple(ranks_of),
                last_issued=issued_list,
                last_completed=done_list,
                states=states,
            )
        )
    ranks = sorted(set(trace.expected_ranks) | present | {r for g in groups for r in g.members})
    return ProgressMap(ranks=ranks, groups=groups, rows=_rows(groups))


def _name_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _rows(groups: list[GroupProgress]) -> list[MapRow]:
    """Pack the groups of each kind into rows where no rank appears twice (Megatron's
    tensor-parallel groups: one row; several overlapping groups of one kind: a few)."""
    by_desc: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_desc.setdefault(g.desc, []).append(i)
    # the world group first, then the kinds with the largest groups (data parallel before
    # tensor parallel): the order a reader scans from coarse to fine
    order = sorted(
        by_desc, key=lambda d: (d != "default_pg", -max(len(groups[i].members) for i in by_desc[d]))
    )
    rows: list[MapRow] = []
    for desc in order:
        packed: list[tuple[set[int], list[int]]] = []
        for i in by_desc[desc]:
            members = set(groups[i].members)
            for taken, idx in packed:
                if not (taken & members):
                    taken |= members
                    idx.append(i)
                    break
            else:
                packed.append((set(members), [i]))
        for k, (_, idx) in enumerate(packed):
            label = desc or "(no description)"
            rows.append(MapRow(f"{label} ({k + 1})" if len(packed) > 1 else label, desc, idx))
    return rows


@dataclass
class HangPoint:
    """When and where the hang began, and the moment the records end."""

    end_ns: int  # the dumps' time, or the newest time any record holds
    end_is_dump_time: bool
    hang_ns: int | None  # when the first rank entered the verdict's op (None: no hang)
    label: str | None


def hang_point(trace: Trace, alignment: Alignment, verdict: Verdict) -> HangPoint:
    dump_times = [i.dump_time_ns for i in trace.ranks.values() if i.dump_time_ns]
    if dump_times:
        end, exact = int(max(dump_times)), True
    else:
        end, exact = _newest_time(trace.entries), False
    hang_ns = None
    label = None
    pg = verdict.process_group
    if verdict.kind != "healthy" and pg is not None:
        coll = alignment.collectives
        if verdict.collective_seq_id is not None and len(coll):
            at = coll[(coll["pg_name"] == pg.name) & (coll["seq"] == verdict.collective_seq_id)]
            if len(at):
                hang_ns = int(at["time_created_ns"].min())
        elif verdict.p2p_seq_id is not None and len(alignment.p2p):
            p2p = alignment.p2p
            at = p2p[(p2p["pg_name"] == pg.name) & (p2p["p2p_seq_id"] == verdict.p2p_seq_id)]
            if len(at):
                hang_ns = int(at["time_created_ns"].min())
        where = f"{verdict.op or 'op'}"
        if verdict.collective_seq_id is not None:
            where += f" #{verdict.collective_seq_id}"
        label = f"hang: {where} on group {pg.name}" + (f" ({pg.desc})" if pg.desc else "")
    return HangPoint(end, exact, hang_ns, label)


def _newest_time(entries: pa.Table) -> int:
    newest = 0
    for name in ("time_created_ns", "time_started_ns", "time_completed_ns"):
        col = entries.column(name)
        if col.null_count < len(col):
            value = pa.compute.max(col).as_py()
            if value is not None:
                newest = max(newest, int(value))
    return newest


_OP_COLUMNS = (
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
    "state",
    "time_created_ns",
    "time_started_ns",
    "time_completed_ns",
    "duration_ms",
    "call_site",
)


def recent_ops(
    trace: Trace,
    alignment: Alignment,
    last: int | Mapping[int, int],
    end_ns: int,
    ranks: set[int] | None = None,
) -> pd.DataFrame:
    """Each rank's last ``last`` recorded ops (a number for every rank, or rank -> number)
    as time slices, oldest first per rank.

    Columns: the entries' own (``rank``, ``pg_name``, ``op``, sizes, ``call_site`` …) plus
    ``start_ns`` (enqueued), ``end_ns``, ``end_known`` (False where the record has no
    completion time: a completed op then ends where the rank's next op was enqueued, or at
    once when it is the rank's newest; an unfinished one at ``end_ns``, the dumps' time), ``completion`` (``COMPLETED``,
    ``NOT_COMPLETED`` or ``COMPLETION_UNKNOWN``, as the alignment judged it) and ``seq``
    (the collective or P2P sequence id)."""
    table = trace.entries
    if not table.num_rows:
        return _empty_ops()
    rank = table.column("rank").to_numpy()
    record = table.column("record_id").fill_null(-1).to_numpy()
    order = _rank_record_order(rank, record)
    rank_sorted = rank[order]
    # position of every row from its rank's end (0 = newest)
    bounds = np.flatnonzero(np.diff(rank_sorted)) + 1
    ends = np.r_[bounds, len(rank_sorted)]
    starts = np.r_[0, bounds]
    run_end = np.repeat(ends, ends - starts)
    from_end = run_end - np.arange(len(rank_sorted)) - 1
    if isinstance(last, Mapping):
        top = int(rank_sorted.max()) + 1 if len(rank_sorted) else 1
        limit = np.zeros(max(top, 1), dtype=np.int64)
        for r, n in last.items():
            if 0 <= r < top:
                limit[r] = n
        keep = from_end < limit[rank_sorted]
    else:
        keep = from_end < int(last)
    if ranks is not None:
        keep &= np.isin(rank_sorted, np.fromiter(ranks, dtype=np.int64, count=len(ranks)))
    picked = order[keep]
    sub = table.select(list(_OP_COLUMNS)).take(pa.array(picked))
    df = _to_plain_frame(sub)
    if not len(df):
        return _empty_ops()
    df["seq"] = np.where(df["is_p2p"], df["p2p_seq_id"], df["collective_seq_id"])
    df["completion"] = _completion(df, alignment)
    df["start_ns"] = df["time_created_ns"]
    df = df[df["start_ns"].notna()].copy()
    df["start_ns"] = df["start_ns"].astype(np.int64)
    end = df["time_completed_ns"].astype("Float64")
    by_duration = (
        df["time_started_ns"].fillna(df["start_ns"]).astype("Float64")
        + df["duration_ms"].astype("Float64") * 1e6
    )
    end = end.fillna(by_duration.where(df["completion"] == COMPLETED))
    df["end_known"] = end.notna().to_numpy()
    # a completed op without an end ran at most until the rank's next op was enqueued
    # (the newest one: no length known); an unfinished one is still open at the dumps' time
    next_start = df.groupby("rank", sort=False)["start_ns"].shift(-1)
    done = df["completion"] == COMPLETED
    fallback = np.where(
        done.to_numpy(),
        next_start.fillna(df["start_ns"]).to_numpy(dtype=np.float64),
        float(end_ns),
    )
    end_values = end.fillna(np.nan).to_numpy(dtype=np.float64, na_value=np.nan)
    end_values = np.where(np.isnan(end_values), fallback, end_values)
    df["end_ns"] = np.maximum(end_values, df["start_ns"].to_numpy(dtype=np.float64)).astype(
        np.int64
    )
    return df.reset_index(drop=True)


def _rank_record_order(rank: np.ndarray, record: np.ndarray) -> np.ndarray:
    """Row order by (rank, record id): the loader's order already, almost always."""
    n = len(rank)
    if n < 2:
        return np.arange(n)
    dr = np.diff(rank)
    if (dr >= 0).all() and (np.diff(record)[dr == 0] > 0).all():
        return np.arange(n)
    return np.lexsort((record, rank))


def _to_plain_frame(sub: pa.Table) -> pd.DataFrame:
    data = {}
    for name in sub.column_names:
        col = sub.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(pa.string())
        if name in ("time_created_ns", "time_started_ns", "time_completed_ns"):
            data[name] = col.to_pandas().astype("Int64")
        elif name in ("collective_seq_id", "p2p_seq_id", "record_id"):
            data[name] = col.fill_null(0).to_numpy().astype(np.int64)
        elif name == "is_p2p":
            data[name] = col.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        elif name == "peer":  # -1: no peer
            data[name] = col.fill_null(-1).to_numpy().astype(np.int64)
        elif name == "rank":
            data[name] = col.to_numpy().astype(np.int64)
        else:
            data[name] = col.to_pandas()
    df = pd.DataFrame(data)
    for name in ("pg_name", "op", "state", "input_sizes", "output_sizes", "input_dtypes"):
        df[name] = df[name].fillna("")
    df["is_p2p"] = df["is_p2p"] | df["op"].isin(list(P2P_OPS))
    return df


def _completion(df: pd.DataFrame, alignment: Alignment) -> np.ndarray:
    """The alignment's judgement per op: collectives through each rank's last completed
    seq on the group (ops of a group complete in order), P2P ops by their own row."""
    out = np.full(len(df), COMPLETION_UNKNOWN, dtype=object)
    status = alignment.status
    informative = alignment.state_informative
    coll = (~df["is_p2p"].to_numpy()) & (df["collective_seq_id"].to_numpy() > 0)
    if coll.any() and len(status):
        keys = pd.MultiIndex.from_arrays(
            [df["rank"].to_numpy()[coll], df["pg_name"].to_numpy()[coll].astype(str)]
        )
        flat = status.set_axis(
            pd.MultiIndex.from_arrays(
                [
                    status.index.get_level_values(0).astype(np.int64),
                    status.index.get_level_values(1).astype(str),
                ]
            )
        )
        flat = flat[~flat.index.duplicated()]
        done_seq = flat["last_completed"].reindex(keys).to_numpy(dtype=np.float64, na_value=np.nan)
        seq = df["collective_seq_id"].to_numpy()[coll].astype(np.float64)
        rank_info = np.array(
            [informative.get(int(r), False) for r in df["rank"].to_numpy()[coll]], dtype=bool
        )
        known = ~np.isnan(done_seq) | rank_info
        done = ~np.isnan(done_seq) & (seq <= np.nan_to_num(done_seq, nan=-1))
        sub = np.where(done, COMPLETED, np.where(known, NOT_COMPLETED, COMPLETION_UNKNOWN))
        out[coll] = sub
    p2p = df["is_p2p"].to_numpy()
    if p2p.any() and len(alignment.p2p):
        a = alignment.p2p
        akey = a["rank"].to_numpy().astype(np.int64) << 40 | a["record_id"].to_numpy().astype(
            np.int64
        ) & ((1 << 40) - 1)
        want = df["rank"].to_numpy()[p2p].astype(np.int64) << 40 | df["record_id"].to_numpy()[
            p2p
        ].astype(np.int64) & ((1 << 40) - 1)
        hit = np.isin(akey, want)
        judged = pd.Series(
            a["completed"].to_numpy(dtype=object, na_value=None)[hit], index=akey[hit]
        )
        judged = judged[~judged.index.duplicated()]
        values = judged.reindex(want).to_numpy(dtype=object)
        out[p2p] = [
            COMPLETION_UNKNOWN if v is None or v is pd.NA else (COMPLETED if v else NOT_COMPLETED)
            for v in values
        ]
    return out


def _empty_ops() -> pd.DataFrame:
    cols = [*_OP_COLUMNS, "seq", "completion", "start_ns", "end_ns", "end_known"]
    return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})


@dataclass
class Lateness:
    """Per rank, how late it enters collectives that every member issued: its
    ``time_created_ns`` minus the mean of the other members' (the straggler rule's
    measure; docs/verdict.md)."""

    ranks: list[int] = field(default_factory=list)
    median_ms: list[float] = field(default_factory=list)
    p90_ms: list[float] = field(default_factory=list)
    collectives: list[int] = field(default_factory=list)


def lateness(alignment: Alignment, last_seqs: int = 256) -> Lateness:
    """Enqueue lateness per rank over each group's last ``last_seqs`` collectives."""
    c = alignment.collectives
    if not len(c):
        return Lateness()
    sizes = {g: len(m) for g, m in alignment.members.items()}
    size = c["pg_name"].map(sizes).astype("float64").fillna(0).to_numpy()
    top = c.groupby("pg_name", observed=True, sort=False)["seq"].transform("max").to_numpy()
    keep = (size >= 2) & (c["seq"].to_numpy() > top - last_seqs)
    c = c.loc[keep, ["pg_name", "seq", "rank", "time_created_ns"]]
    if not len(c):
        return Lateness()
    keys = [c["pg_name"], c["seq"]]
    t = c["time_created_ns"].to_numpy(dtype=np.float64)
    n = c.groupby(keys, observed=True, sort=False)["rank"].transform("size").to_numpy()
    full = n == c["pg_name"].map(sizes).to_numpy()
    total = pd.Series(t, index=c.index).groupby(keys, observed=True, sort=False).transform("sum")
    ok = full & (n >= 2)
    late = (t - (total.to_numpy() - t) / np.maximum(n - 1, 1))[ok]
    frame = pd.DataFrame({"rank": c["rank"].to_numpy()[ok], "late": late / 1e6})
    if not len(frame):
        return Lateness()
    per = frame.groupby("rank")["late"]
    med, p90, cnt = per.median(), per.quantile(0.9), per.size()
    return Lateness(
        ranks=[int(r) for r in med.index],
        median_ms=[round(float(x), 3) for x in med.to_numpy()],
        p90_ms=[round(float(x), 3) for x in p90.to_numpy()],
        collectives=[int(x) for x in cnt.to_numpy()],
    )


def hosts_of(trace: Trace, ranks: list[int]) -> dict[int, str | None]:
    return {r: (trace.ranks[r].host if r in trace.ranks else None) for r in ranks}
