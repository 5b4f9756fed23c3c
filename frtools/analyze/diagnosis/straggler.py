"""Stragglers: ranks that enter collectives late, well beyond the others, in a job that
does not hang.

Over collectives every member of the group issued (groups of >= 2), a rank's lateness is its
``time_created_ns`` minus the mean of the other members'. With T = max(``MIN_LATE_NS``,
``SPREAD_FACTOR`` x the typical jitter), a rank is a straggler when it is at least T late in
>= ``LAST_SHARE`` of at least ``MIN_COLLECTIVES`` collectives and its median lateness is
>= T. Two passes: candidates against every member (if none: ranks late by T in >= 15% with
a 90th-percentile lateness >= T), then every rank against the non-candidates, so two
stragglers in one pair do not hide each other.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .facts import JobFacts

LAST_SHARE = 0.6
MIN_COLLECTIVES = 5
MIN_LATE_NS = 5_000_000
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
    c = c[["pg_name", "seq", "rank", "time_created_ns"]].reset_index(drop=True)
    candidates = set(_late(c, set())) or set(_late(c, set(), loose=True))
    found = _late(c, candidates) if candidates else {}
    return [(r, *found[r]) for r in sorted(found)]


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
