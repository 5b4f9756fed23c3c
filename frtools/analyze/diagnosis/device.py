"""What PyTorch's NCCL counters say about a rank's own GPU and its NCCL host calls
(docs/op-semantics.md "PyTorch's NCCL records").

**A stopped device.** A collective in which every member contributes data (all_reduce,
all_gather, reduce_scatter, all_to_all, barrier) completes on no member before every
member's kernel ran it. The watchdog of ProcessGroupNCCL counts a completion
(``pg_status.last_completed_collective``) when it finds the op's end event done. So in a
hung job, a member whose counter stays below a peer's on the same group ran those kernels
and cannot see them end: its CUDA context is poisoned (a device-side assert, an Xid) or its
device stopped. Its peers block on the next op it never runs: they are its victims, however
many groups show them waiting.

Worked example (a real 16-rank Megatron MoE job on H100s, a GPU error on ranks 12 and 14)::

    group 41, tensor parallel [12, 13]: rank 12 completed 42805, rank 13 completed 42817
    group 42, tensor parallel [14, 15]: rank 14 completed 42805, rank 15 completed 42818
    op 42806 is an _all_gather_base: rank 13 finished it, so rank 12's kernel ran it, and
    rank 12 never saw it end -> rank 12's device stopped; rank 14's on group 42 the same.

The counters of a group that also carries send/recv count P2P work too (``seq_`` is the
P2P counter for P2P work): such groups, and groups whose counters disagree with the
entries, are not compared.

**Inside the NCCL host call.** ``collective()`` records the entry before the NCCL call and
sets ``last_enqueued`` after it returns: a rank whose entry for a group is past its
``last_enqueued`` there is still inside the call (a thread spinning in
``ncclLocalOpAppend``, a wedged communicator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from frtools.analyze.align import Alignment, at_seqs, on_nccl, text_series
from frtools.model.codes import among
from frtools.model.ops import OpFamily, family_of
from frtools.model.trace import Trace

# Ops whose completion on one member proves every member's kernel ran them.
ALL_CONTRIBUTE = frozenset(
    {
        OpFamily.ALL_REDUCE,
        OpFamily.ALL_GATHER,
        OpFamily.REDUCE_SCATTER,
        OpFamily.ALL_TO_ALL,
        OpFamily.BARRIER,
    }
)


@dataclass(frozen=True, kw_only=True)
class DeviceLag:
    """On ``pg_name``, ``rank`` completed only up to ``completed`` while ``peer`` completed
    ``peer_completed``; ``op`` is the collective at ``completed + 1`` (an all-member op)."""

    rank: int
    pg_name: str
    completed: int
    peer: int
    peer_completed: int
    op: str | None


@dataclass(frozen=True, kw_only=True)
class HostCall:
    """``rank`` recorded collective ``seq`` of ``pg_name`` (``op``) but its
    ``last_enqueued`` there is ``enqueued`` < ``seq``: the NCCL call never returned."""

    rank: int
    pg_name: str
    seq: int
    enqueued: int
    op: str | None


def _on_nccl(entries: pa.Table, pairs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Of (rank, group) ``pairs``, those whose entries were recorded by an NCCL engine: a
    rank may hold records of several recorders (Gloo on one group, nccl2 on another)."""
    if not pairs or "profiling_name" not in entries.column_names:
        return set()
    ranks = pa.array(sorted({r for r, _ in pairs}), type=entries.schema.field("rank").type)
    mine = entries.filter(pc.is_in(entries["rank"], value_set=ranks))
    mine = mine.filter(pa.array(on_nccl(mine["profiling_name"])))
    seen = {
        (int(r), str(g))
        for r, g in zip(mine["rank"].to_pylist(), mine["pg_name"].to_pylist(), strict=True)
    }
    return pairs & seen


def nccl_ranks(entries: pa.Table, ranks: set[int]) -> frozenset[int]:
    """Of ``ranks``, those with an entry an NCCL engine recorded: their collectives run on
    GPU streams, one per group, not one after another on the CPU as Gloo's do."""
    if not ranks or "profiling_name" not in entries.column_names or not len(entries):
        return frozenset()
    rank = entries["rank"].to_numpy()[on_nccl(entries["profiling_name"])]
    return frozenset(int(r) for r in np.unique(rank).tolist() if int(r) in ranks)


def counters(al: Alignment) -> pd.DataFrame:
    """(rank, group, last enqueued, last completed) where pg_status gives both."""
    ps = al.counters
    if ps is None or not len(ps):
        return pd.DataFrame({"rank": [], "pg_name": [], "enqueued": [], "completed": []})
    known = (ps["ps_enqueued"].notna() & ps["ps_completed"].notna()).to_numpy(dtype=bool)
    ps = ps[known]
    return pd.DataFrame(
        {
            "rank": ps["rank"].to_numpy(dtype=np.int64),
            "pg_name": text_series(ps["pg_name"]),
            "enqueued": ps["ps_enqueued"].to_numpy(dtype=np.int64),
            "completed": ps["ps_completed"].to_numpy(dtype=np.int64),
        }
    )


def _comparable(al: Alignment, counters: pd.DataFrame) -> pd.DataFrame:
    """The counters of groups that count collectives only: no send/recv recorded on the
    group, and no rank's entries past its own counter by more than the one op a host call
    may hold. A rank's highest recorded seq on a group is its ``al.status`` ``last_issued``
    where it has entries there (the alignment's own per-group maximum: no pass over the
    millions of units)."""
    if not len(counters):
        return counters
    groups = set(counters["pg_name"].unique().tolist())  # not row by row: a row per rank
    p2p = al.p2p
    if len(p2p):
        groups -= set(p2p["pg_name"].astype(str).unique().tolist())
    keep = counters[counters["pg_name"].isin(groups).to_numpy()]
    if not len(keep) or not len(al.collectives):
        return keep
    st = al.status
    names = st.index.get_level_values(1)
    recorded = st["first_seq"].notna().to_numpy() & pd.notna(names)
    top = pd.Series(
        st["last_issued"].to_numpy(dtype="float64", na_value=np.nan)[recorded],
        index=pd.MultiIndex.from_arrays(
            [
                st.index.get_level_values(0)[recorded].astype(np.int64),
                names[recorded].astype(str),
            ],
            names=["rank", "pg_name"],
        ),
        name="top_seq",
    )
    top = top[~top.index.duplicated(keep="last")]
    joined = keep.join(top, on=["rank", "pg_name"])
    bad = joined["top_seq"].notna() & (joined["top_seq"] > joined["enqueued"] + 1)
    bad_groups = set(joined.loc[bad, "pg_name"])
    return keep[~keep["pg_name"].isin(bad_groups).to_numpy()]


def _completed_at(coll: pd.DataFrame, keys: set[tuple[int, str, int]]) -> set[tuple[int, str, int]]:
    """Of (rank, group, seq) ``keys``, those whose own entry is marked completed: its end
    event was found done at the dump, while the rank's counter waits for the watchdog's
    next poll (a live dump of a healthy job)."""
    if not keys or not len(coll):
        return set()
    at = at_seqs(coll["seq"], {s for _, _, s in keys}) & coll["completed"].eq(True).fillna(
        False
    ).to_numpy(dtype=bool)
    rows = coll[at]
    names = text_series(rows["pg_name"]).tolist()
    found = zip(rows["rank"].tolist(), names, rows["seq"].tolist(), strict=True)
    return {(int(r), str(g), int(q)) for r, g, q in found} & keys


def _ops_at(coll: pd.DataFrame, keys: set[tuple[str, int]]) -> dict[tuple[str, int], str]:
    if not keys or not len(coll):
        return {}
    seqs = {s for _, s in keys}
    near = coll[at_seqs(coll["seq"], seqs)]
    out: dict[tuple[str, int], str] = {}
    for name, seq, op in zip(
        near["pg_name"].astype(str), near["seq"].tolist(), near["op"].tolist(), strict=True
    ):
        key = (name, int(seq))
        if key in keys and key not in out:
            out[key] = str(op)
    return out


def device_lags(
    trace: Trace, al: Alignment, counted: pd.DataFrame
) -> dict[int, tuple[DeviceLag, ...]]:
    """Per rank, the groups where a peer completed an all-member collective that the rank
    never saw complete (see the module docstring)."""
    coll = al.collectives
    counters = _comparable(al, counted)
    if len(counters) < 2:
        return {}
    best = counters.groupby("pg_name")["completed"].transform("max")
    behind = counters[(counters["completed"] < best).to_numpy()]
    if not len(behind):
        return {}
    leader = counters.loc[
        counters.groupby("pg_name")["completed"].idxmax(), ["pg_name", "rank", "completed"]
    ].set_index("pg_name")
    keys = {
        (str(g), int(c) + 1) for g, c in zip(behind["pg_name"], behind["completed"], strict=True)
    }
    ops = _ops_at(coll, keys)
    pairs = {(int(r), str(g)) for r, g in zip(behind["rank"], behind["pg_name"], strict=True)}
    pairs |= {(int(leader.loc[g, "rank"]), str(g)) for _, g in pairs}
    nccl = _on_nccl(trace.entries, pairs)
    seen_done = _completed_at(coll, {(int(r), str(g), int(c) + 1) for r, g, c in zip(
        behind["rank"], behind["pg_name"], behind["completed"], strict=True)})  # fmt: skip
    out: dict[int, list[DeviceLag]] = {}
    for r, g, c in zip(behind["rank"], behind["pg_name"], behind["completed"], strict=True):
        op = ops.get((str(g), int(c) + 1))
        if op is None or family_of(op) not in ALL_CONTRIBUTE:
            continue
        if (int(r), str(g), int(c) + 1) in seen_done:
            continue  # its own entry says the op completed: the watchdog had not polled yet
        peer, peer_done = leader.loc[g, "rank"], leader.loc[g, "completed"]
        if (int(r), str(g)) not in nccl or (int(peer), str(g)) not in nccl:
            continue
        out.setdefault(int(r), []).append(
            DeviceLag(
                rank=int(r),
                pg_name=str(g),
                completed=int(c),
                peer=int(peer),
                peer_completed=int(peer_done),
                op=op,
            )
        )
    return {r: tuple(v) for r, v in out.items()}


def host_calls(trace: Trace, al: Alignment, counted: pd.DataFrame) -> dict[int, HostCall]:
    """Per rank, a collective an NCCL engine recorded past the rank's ``last_enqueued``
    on that group (the earliest, where several)."""
    coll = al.collectives
    counters = counted
    if not len(counters) or not len(coll):
        return {}
    # only units at some counter's last_enqueued + 1 can be one past their own: a table
    # look-up per unit on the seq (a small range) before anything per unit is built
    wanted = np.unique(counters["enqueued"].to_numpy(dtype=np.int64) + 1)
    near = among(coll["seq"].to_numpy(), wanted)
    near &= among(coll["rank"].to_numpy(), counters["rank"].unique())
    rows = np.flatnonzero(near)
    if not len(rows):
        return {}
    # the five columns at those rows, not every column of the frame (millions of rows)
    keyed = pd.DataFrame(
        {
            "rank": coll["rank"].take(rows).to_numpy(dtype=np.int64),
            "pg_name": text_series(coll["pg_name"].take(rows)),
            "seq": coll["seq"].take(rows).to_numpy(dtype=np.int64),
            "op": text_series(coll["op"].take(rows)),
            "t": coll["time_created_ns"].take(rows).to_numpy(dtype=np.int64),
        }
    ).merge(counters, on=["rank", "pg_name"])
    # exactly one past: the entry of the call in progress (more means other counters)
    past = keyed[(keyed["seq"] == keyed["enqueued"] + 1).to_numpy()]
    past = past[past["seq"] > past["completed"]]
    nccl = _on_nccl(trace.entries, set(zip(past["rank"].tolist(), past["pg_name"], strict=True)))
    out: dict[int, HostCall] = {}
    for row in past.sort_values("t").itertuples(index=False):
        if (int(row.rank), str(row.pg_name)) not in nccl:
            continue
        out.setdefault(
            int(row.rank),
            HostCall(
                rank=int(row.rank),
                pg_name=str(row.pg_name),
                seq=int(row.seq),
                enqueued=int(row.enqueued),
                op=str(row.op),
            ),
        )
    return out
