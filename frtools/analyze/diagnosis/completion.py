"""What counts as completed: each collective's ``completed`` as the wait-for graph reads it.

A record's own marks are not the truth on every backend (docs/verdict.md "Completion"):

* an op that failed (its ``error``) did not complete;
* an op "completed" on some members while a member whose process is gone never issued it
  did not complete either: a collective cannot finish without every member, and Gloo
  records an op that failed on a dead peer as completed (invariant 1);
* an op pending on a rank completed when another member completed it and every member
  issued it, provided the completion proves success (real states, or membership listed):
  Gloo marks completion from a callback just after ``wait()`` returns (the graph asks this
  per blocked op);
* an op pending on a rank whose ops run in issue order on its CPU (Gloo) completed when a
  later op of the same rank completed (some Gloo works never report completion).

Worked examples (Gloo, one group of ranks 0, 1, 2)::

    rank 2's process is gone, its last entry is seq 4
    rank 0   seq 5 completed                 -> not completed (hollow: rank 2 never issued it)

    nobody gone
    rank 1   seq 5 pending, seq 6 completed  -> seq 5 completed (overtaken: its CPU runs ops
                                                in issue order)

``effective_completion`` applies these rules to the aligned collectives; ``quitters`` finds
the roots whose last op Gloo retired on a dead peer (the graph is then built again with
those ops read as failed).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import numpy as np
import pandas as pd

from frtools.analyze.align import as_texts, at_seqs, category_codes

from .facts import CompletionSource, JobFacts

__all__ = ["effective_completion", "quitters"]


def effective_completion(facts: JobFacts, failed_last: Iterable[int] = ()) -> pd.Series:
    """The collectives' ``completed``, corrected by the failure and order rules of the
    module docstring (only the few rows they concern are touched)."""
    c = facts.al.collectives
    done = c["completed"]
    if not len(c):
        return done
    hollow = _hollow_rows(facts)
    overtaken = np.union1d(_overtaken_rows(facts), _passed_rows(facts))
    if failed_last:
        hollow = np.union1d(hollow, _last_rows(c, set(failed_last)))
    if not len(hollow) and not len(overtaken):
        return done
    done = done.copy()
    if len(overtaken):
        done.iloc[overtaken] = True
    if len(hollow):
        done.iloc[hollow] = False
    return done


def _cpu_ranks(facts: JobFacts) -> set[int]:
    """Ranks whose collectives run on the CPU (Gloo): frtools on CPU, PyTorch's FR
    with Gloo's retired flags. Not an NCCL rank whose states say nothing (no timing, a dump
    of the active ops only): its groups' ops run on separate GPU streams, and one that
    every member issued stays pending while a member's GPU is stuck earlier on its own."""
    f = facts
    retired = {r for r, s in f.completion.items() if s is CompletionSource.RETIRED}
    return (set(f.in_order) | retired) - f.on_gpu_streams


def _passed_rows(facts: JobFacts) -> np.ndarray:
    """Positions of pending collectives of CPU ranks that every member of the (fully
    known) group issued, agreeing on what must agree. On Gloo such a collective
    completes — only a missing, disagreeing or dead member keeps one pending — whatever
    its Work reports (a Gloo reduce_scatter's never reports completion). Not when it is
    the last op of a member whose process is gone: that member may have died in it."""
    f, c = facts, facts.al.collectives
    cpu = _cpu_ranks(facts)
    if not cpu or not len(c):
        return np.zeros(0, dtype=np.int64)
    whole = {
        g
        for g, members in f.membership.members.items()
        if g in f.membership.complete and not set(members) & f.absent
    }
    if not whole:
        return np.zeros(0, dtype=np.int64)
    rank = c["rank"].to_numpy()
    pending = c["completed"].eq(False).fillna(False).to_numpy(dtype=bool)
    pending &= np.isin(rank, np.fromiter(cpu, dtype=np.int64, count=len(cpu)))
    pending &= c["pg_name"].isin(whole).to_numpy()
    if "error" in c.columns:
        pending &= c["error"].isna().to_numpy()
    if not pending.any():
        return np.zeros(0, dtype=np.int64)
    # the (group, seq) of those rows: every member recorded it, with one agreement key
    cand = c.loc[pending, ["pg_name", "seq"]].drop_duplicates()
    near = c[at_seqs(c["seq"], cand["seq"].unique())]
    rows = near.merge(cand, on=["pg_name", "seq"])
    stats = rows.groupby(["pg_name", "seq"], observed=True).agg(
        n=("rank", "nunique"), keys=("sig", "nunique"), t=("time_created_ns", "max")
    )
    size = np.asarray(
        stats.index.get_level_values(0).map(lambda g: len(f.members(str(g)))), dtype=np.int64
    )
    ok = stats[(stats["n"].to_numpy() == size) & (stats["keys"] == 1).to_numpy()]
    gone = [r for r, e in f.endings.items() if e.gone]
    if len(ok) and gone:
        last_t = c[c["rank"].isin(gone).to_numpy()].groupby("rank")["time_created_ns"].max()
        keep = []
        for (g, _seq), t in zip(ok.index, ok["t"], strict=True):
            members = set(f.members(str(g))) & set(gone)
            keep.append(all(int(last_t.get(m, 0)) > int(t) for m in members))
        ok = ok[np.asarray(keep, dtype=bool)]
    if not len(ok):
        return np.zeros(0, dtype=np.int64)
    keys = pd.DataFrame({"pg_name": as_texts(c["pg_name"]), "seq": c["seq"].to_numpy()})
    good = ok.reset_index()[["pg_name", "seq"]].assign(
        pg_name=lambda d: d["pg_name"].astype(str), _ok=True
    )
    hit = keys.merge(good, how="left", on=["pg_name", "seq"])["_ok"].eq(True).to_numpy()
    return np.flatnonzero(pending & hit)


def _last_rows(coll: pd.DataFrame, ranks: set[int]) -> np.ndarray:
    """Positions of the latest collective of each of ``ranks``."""
    c = coll
    mine = c[c["rank"].isin(list(ranks)).to_numpy()]
    if not len(mine):
        return np.zeros(0, dtype=np.int64)
    last = mine.sort_values(["time_created_ns", "record_id"]).drop_duplicates("rank", keep="last")
    return c.index.get_indexer(last.index)


def _hollow_rows(facts: JobFacts) -> np.ndarray:
    """Positions of collectives marked completed although a member whose process is
    gone (or whose record is stale) never issued them: failures (invariant 1)."""
    f = facts
    lagging = {r for r, e in f.endings.items() if e.gone} | set(f.stale)
    lagging &= set(f.present) - set(f.wrapped)
    if not lagging:
        return np.zeros(0, dtype=np.int64)
    bound: dict[str, int] = {}
    for pg_name, members in f.membership.members.items():
        for m in set(members) & lagging:
            st = f.status.get((m, pg_name))
            last = 0 if st is None or pd.isna(st[1]) else int(st[1])
            bound[pg_name] = min(bound.get(pg_name, last), last)
    if not bound:
        return np.zeros(0, dtype=np.int64)
    c = facts.al.collectives
    codes, names = category_codes(c["pg_name"])
    per_code = np.array([bound.get(str(n), np.nan) for n in names] + [np.nan])
    limit = per_code[codes]  # code -1 (no group) reads the trailing NaN
    seq = c["seq"].to_numpy()
    done = c["completed"].fillna(False).to_numpy(dtype=bool)
    hit = done & ~np.isnan(limit) & (seq > np.nan_to_num(limit, nan=np.inf))
    return np.flatnonzero(hit)


def _overtaken_rows(facts: JobFacts) -> np.ndarray:
    """Positions of pending collectives of ranks whose ops complete in issue order on
    their CPU, issued before an op of the same rank that completed."""
    ranks = _cpu_ranks(facts)
    c = facts.al.collectives
    if not ranks or not len(c):
        return np.zeros(0, dtype=np.int64)
    rank = c["rank"].to_numpy()
    mine = np.isin(rank, np.fromiter(ranks, dtype=np.int64, count=len(ranks)))
    if not mine.any():
        return np.zeros(0, dtype=np.int64)
    completed = c["completed"]
    done = completed.eq(True).fillna(False).to_numpy(dtype=bool) & mine
    pending = completed.eq(False).fillna(False).to_numpy(dtype=bool) & mine
    if "error" in c.columns:
        pending &= c["error"].isna().to_numpy()
    if not pending.any() or not done.any():
        return np.zeros(0, dtype=np.int64)
    t = c["time_created_ns"].to_numpy()
    last_done = pd.Series(t[done]).groupby(rank[done]).max()
    limit = pd.Series(rank[pending]).map(last_done).to_numpy(dtype=np.float64)
    over = t[pending] < np.nan_to_num(limit, nan=-np.inf)
    return np.flatnonzero(pending)[over]


def quitters(facts: JobFacts, roots: Iterable[int], blocked_at: Container[int]) -> frozenset[int]:
    """Roots whose record stops at an op Gloo retired on a group with a member that left no
    record. Gloo retires an op that failed on a dead peer, and a rank whose collective
    failed raises and issues nothing more: its peers then wait for it in vain. Such a root
    is the dead member's victim; its last op is read as failed (the graph is built again)."""
    out = set()
    coll = facts.al.collectives
    for r in roots:
        if facts.completion.get(r) is not CompletionSource.RETIRED or r in blocked_at:
            continue
        mine = coll[(coll["rank"] == r).to_numpy()]
        if not len(mine):
            continue
        last = mine.sort_values(["time_created_ns", "record_id"]).iloc[-1]
        done = last["completed"]
        if pd.isna(done) or not bool(done):
            continue
        pg_name, seq = str(last["pg_name"]), int(last["seq"])
        members = set(facts.members(pg_name))
        if not (members & facts.absent or facts.membership.unseen.get(pg_name)):
            continue
        # A failure raises on every member that took part: none of them goes on. A member
        # that went past the op saw it succeed.
        if all(_stops_at(coll, m, pg_name, seq) for m in members & facts.present):
            out.add(int(r))
    return frozenset(out)


def _stops_at(coll: pd.DataFrame, rank: int, pg_name: str, seq: int) -> bool:
    """Whether ``rank``'s record ends with its entry at (group, seq) (or lacks it)."""
    mine = coll[(coll["rank"] == rank).to_numpy()]
    if not len(mine):
        return True
    at = mine[(mine["pg_name"].astype(str) == pg_name).to_numpy() & (mine["seq"] == seq).to_numpy()]
    if not len(at):
        return True
    return int(mine["time_created_ns"].max()) <= int(at["time_created_ns"].max())
