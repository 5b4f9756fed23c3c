"""Stragglers: ranks that enter collectives late, well beyond the others, in a job that
does not hang.

Over collectives every member of the group issued (groups of >= 2), a rank's lateness is its
``time_created_ns`` minus the mean of the other members'. With T = max(``MIN_LATE_NS``,
``SPREAD_FACTOR`` x the typical jitter), a rank is a straggler when it is at least T late in
>= ``LAST_SHARE`` of at least ``MIN_COLLECTIVES`` collectives and its median lateness is
>= T. Two passes: candidates against every member (if none: ranks late by T in >= 15% with
a 90th-percentile lateness >= T), then every rank against the non-candidates, so two
stragglers in one pair do not hide each other (not when a quarter of the ranks or more are
candidates: that is a slow host or a loaded machine). When no rank passes, the collectives that
waited decide: a rank that is the late one in most of the collectives whose last member
arrived T late is a straggler too (a rank slow before a burst of collectives is late into
the first only: FSDP2 all-gathers each layer in a row); a run of such collectives issued back
to back with the same rank last counts once toward the five. A group's first collective is not counted: it
measures start-up, not pace.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from frtools.analyze.align import as_texts

from .facts import JobFacts

LAST_SHARE = 0.6
MIN_COLLECTIVES = 5
# the noise floor: on a loaded host a healthy rank can be ~10 ms late into most collectives
# (a 4-rank Gloo job on 2 busy cores: median 9.7 ms); a straggler worth naming is later
MIN_LATE_NS = 20_000_000
SPREAD_FACTOR = 3.0


def stragglers(facts: JobFacts) -> list[tuple[int, float, float, int]]:
    """(rank, late share, median lateness ns, collectives) of every straggler, by rank."""
    c = facts.al.collectives
    if not len(c):
        return []
    sizes = {g: len(m) for g, m in facts.al.members.items()}
    c = c[c["pg_name"].map(sizes).fillna(0) >= 2]
    if not len(c):
        return []
    grp = c.groupby(["pg_name", "seq"], sort=False, observed=True)
    counts = grp["rank"].transform("size")
    full = counts == c["pg_name"].map(sizes)
    c = c[full]
    if not len(c):
        return []
    # a group's first collective measures when the processes got there (start-up, imports,
    # rendezvous on a loaded host), not the pace of a rank
    c = c[c["seq"] != 1]
    c = c[["pg_name", "seq", "rank", "time_created_ns"]].reset_index(drop=True)
    if not len(c):
        return []
    candidates = set(_late(c, set())) or set(_late(c, set(), loose=True))
    ranks = int(c["rank"].nunique())
    if len(candidates) * 4 > ranks:
        # a quarter of the job or more is late: a slow host or group, a loaded machine,
        # not a rank that enters last
        candidates = set()
    found = _late(c, candidates) if candidates else {}
    if not found:
        found = _last_in(c)
    found = {r: v for r, v in found.items() if r not in _schedule_ranks(c, set(found))}
    return [(r, *found[r]) for r in sorted(found)]


# A group's members arrive in one fixed order this often for the order to be a schedule.
SCHEDULE_SHARE = 0.8
# The groups looked at for a schedule (the ones the late ranks are in; bounded work).
SCHEDULE_GROUPS = 64


def _schedule_ranks(c: pd.DataFrame, late: set[int]) -> set[int]:
    """Late ranks whose lateness is a pipeline schedule: in a group of >= 3 members the
    members reach its collectives in one fixed order, every member a step later than the
    one before (a staircase), in >= ``SCHEDULE_SHARE`` of the collectives. A 1F1B or GPipe
    schedule drains stage by stage before a per-step collective (a loss broadcast): stage
    order, every step. One slow rank is late alone while the others arrive in any order.

    Worked example (a healthy 4-stage 1F1B job, the per-step loss broadcast):

        arrival after the first, per step: rank 3 0 ms, rank 2 17, rank 1 35, rank 0 50
        every step the same order, each rank later than the one before -> the schedule
        (ranks 0 and 1 are "late", but nobody is slow)
    """
    if not late:
        return set()
    groups = c.loc[c["rank"].isin(late).to_numpy(), "pg_name"].unique().tolist()
    out: set[int] = set()
    for pg_name in groups[:SCHEDULE_GROUPS]:
        mine = c[(c["pg_name"] == pg_name).to_numpy()]
        t = mine.pivot_table(
            index="seq", columns="rank", values="time_created_ns", aggfunc="min", observed=True
        ).dropna()
        if t.shape[1] < 3 or len(t) < MIN_COLLECTIVES:
            continue
        rel = t.to_numpy(dtype=np.float64, copy=True)
        rel -= rel.min(axis=1, keepdims=True)
        order = np.argsort(np.median(rel, axis=0), kind="stable")
        steps = np.diff(rel[:, order], axis=1)  # each member after the one before it
        jitter = float(np.median(np.abs(steps))) if steps.size else 0.0
        floor = max(MIN_LATE_NS, SPREAD_FACTOR * jitter) / 4
        staircase = (steps >= floor).all(axis=1)
        if staircase.mean() >= SCHEDULE_SHARE:
            out |= {int(r) for r in t.columns} & late
    return out


def _last_in(c: pd.DataFrame) -> dict[int, tuple[float, float, int]]:
    """Stragglers by the collectives that wait: a rank slow before a *burst* of collectives
    (FSDP's per-layer all-gathers, a bucket of all-reduces) is late into the first one only
    and in step after it, so it is late in few of its collectives. Among the collectives
    whose last member arrived at least T after the others, a rank that is that last member
    in >= LAST_SHARE of them (>= 10% of its own collectives, and in >= MIN_COLLECTIVES
    separate delays: collectives issued back to back with the same rank last are one) is a
    straggler."""
    t = c["time_created_ns"].to_numpy(dtype=np.float64)
    keys = [c["pg_name"], c["seq"]]
    total = pd.Series(t).groupby(keys, observed=True).transform("sum").to_numpy()
    n = pd.Series(np.ones(len(t))).groupby(keys, observed=True).transform("sum").to_numpy()
    ok = n > 1
    late = np.full(len(t), -np.inf)
    late[ok] = t[ok] - (total[ok] - t[ok]) / (n[ok] - 1)
    normal = np.clip(late[ok], 0, None)
    jitter = float(np.median(normal)) if len(normal) else 0.0
    threshold = max(MIN_LATE_NS, SPREAD_FACTOR * jitter)
    frame = pd.DataFrame(
        {
            "rank": c["rank"].to_numpy(),
            "late": late,
            "key": c["pg_name"].astype(str) + "#" + c["seq"].astype(str),
        }
    )
    worst = frame.loc[frame.groupby("key", sort=False)["late"].idxmax()]
    events = worst[worst["late"] >= threshold]
    if len(events) < MIN_COLLECTIVES:
        return {}
    delays = _first_of_runs(events, c)["rank"].value_counts()
    per_rank = frame.groupby("rank").size()
    found = {}
    for rank, mine in events.groupby("rank"):
        share = len(mine) / len(events)
        if (
            share >= LAST_SHARE
            and delays.get(rank, 0) >= MIN_COLLECTIVES
            and len(mine) >= 0.1 * per_rank[rank]
        ):
            found[int(rank)] = (
                len(mine) / per_rank[rank],
                float(mine["late"].median()),
                int(per_rank[rank]),
            )
    return found


def _first_of_runs(events: pd.DataFrame, c: pd.DataFrame) -> pd.DataFrame:
    """One wait per run: collectives of a group issued back to back (seq n, n+1, ...) with
    the same rank last are one delay (the ops behind the first inherit it: DDP's buckets of
    one backward, a chain of broadcasts), not several pieces of evidence."""
    if len(events) < 2:
        return events
    idx = events.index.to_numpy()
    pg = as_texts(c["pg_name"])[idx]
    seq = c["seq"].to_numpy(dtype=np.int64)[idx]
    rank = events["rank"].to_numpy()
    order = np.lexsort((seq, pg))
    pg, seq, rank = pg[order], seq[order], rank[order]
    follows = np.zeros(len(order), dtype=bool)
    follows[1:] = (pg[1:] == pg[:-1]) & (seq[1:] == seq[:-1] + 1) & (rank[1:] == rank[:-1])
    return events.iloc[order[~follows]]


def _late(
    c: pd.DataFrame, candidates: set[int], loose: bool = False
) -> dict[int, tuple[float, float, int]]:
    """rank -> (late share, median lateness ns, collectives) for ranks that pass the rule,
    with lateness measured against the mean of the other members not in ``candidates``;
    ``loose``: the candidate pass (late in >= 15%, 90th percentile lateness >= T)."""
    t = c["time_created_ns"].to_numpy(dtype=np.float64)
    ref = ~c["rank"].isin(candidates).to_numpy()
    keys = [c["pg_name"], c["seq"]]
    ref_sum = pd.Series(np.where(ref, t, 0.0)).groupby(keys, observed=True).transform("sum")
    ref_n = pd.Series(ref.astype(np.float64)).groupby(keys, observed=True).transform("sum")
    ref_sum = ref_sum.to_numpy() - np.where(ref, t, 0.0)
    ref_n = ref_n.to_numpy() - ref
    ok = ref_n > 0
    late = t[ok] - ref_sum[ok] / ref_n[ok]
    ranks = c["rank"].to_numpy()[ok]
    if not len(late):
        return {}
    normal = late[~np.isin(ranks, list(candidates))]
    jitter = float(np.median(np.clip(normal, 0, None))) if len(normal) else 0.0
    threshold = max(MIN_LATE_NS, SPREAD_FACTOR * jitter)
    per = pd.DataFrame({"rank": ranks, "late": late, "flag": late >= threshold}).groupby("rank")
    share, n, med = per["flag"].mean(), per["flag"].size(), per["late"].median()
    if loose:
        # Candidates: clearly late in some collectives (a group made only of stragglers
        # shows them on time, so the share and the median are not asked for yet).
        q90 = per["late"].quantile(0.9)
        hit = (share >= 0.15) & (n >= MIN_COLLECTIVES) & (q90 >= threshold)
    else:
        hit = (share >= LAST_SHARE) & (n >= MIN_COLLECTIVES) & (med >= threshold)
    return {int(r): (float(share[r]), float(med[r]), int(n[r])) for r in share.index[hit]}
