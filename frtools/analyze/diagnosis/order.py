"""Which ranks of a wait cycle issued their collectives in an order no peer shares.

Tokens are (group kind, op), run-length encoded (four DP bucket all_reduces in a row are one
run of 4). At every position of every rank's recent history (the last ``HISTORY`` ops) the
last ``CONTEXT`` runs up to that op form a gram. A cycle rank is deviant when its gram at
the blocked op is new for it (not a habit from earlier steps) and at most ``RARE_SHARE`` of
the other ranks that issued that token ever produced it. A gram that differs from a peer's
only by one run being one shorter reads as a skipped collective; anything else as a
reordering. When every cycle rank is deviant, none is singled out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .facts import JobFacts
from .graph import WaitForGraph

# Tokens of context when comparing a rank's recent order of ops with its peers'.
CONTEXT = 4
# A rank's recent order is unusual when at most this share of its peers ever produced it.
RARE_SHARE = 0.25
# Ops per rank (the most recent) whose order is compared.
HISTORY = 256

SKIP = "skip"
REORDER = "order"


def order_deviants(facts: JobFacts, graph: WaitForGraph, core: set[int]) -> dict[int, str]:
    """Cycle ranks whose recent order of ops no peer ever produced: rank -> SKIP/REORDER."""
    coll = facts.al.collectives
    if not len(coll):
        return {}
    kinds = {g: facts.kind_of_group(g) for g in facts.membership.members}
    cols = ["rank", "time_created_ns", "record_id", "pg_name", "op"]
    c = coll[cols + ["seq"]].assign(pg_name=coll["pg_name"].astype(str), op=coll["op"].astype(str))
    c["token"] = c["pg_name"].map(kinds).astype(str) + "|" + c["op"]
    p2p = facts.al.p2p
    if len(p2p):
        # P2P ops as tokens too, their peer relative to the rank (a pipeline stage sends
        # to the next and receives from the previous, whatever its own number)
        side = np.where(p2p["peer"].astype("float64").to_numpy() > p2p["rank"].to_numpy(),
                        "next", "prev")  # fmt: skip
        pp = p2p[cols].assign(pg_name=p2p["pg_name"].astype(str), op=p2p["op"].astype(str))
        pp["seq"] = -p2p["record_id"].to_numpy() - 1  # P2P: keyed by record, not seq
        pp["token"] = pp["pg_name"].map(kinds).astype(str) + "|" + pp["op"] + "|" + side
        c = pd.concat([c, pp], ignore_index=True)
    c = c.sort_values(["rank", "time_created_ns", "record_id"])
    c = c.groupby("rank", sort=False).tail(HISTORY)
    token = c["token"].to_numpy()
    ranks = c["rank"].to_numpy()
    pgs = c["pg_name"].to_numpy()
    seqs = c["seq"].to_numpy()
    grams: dict[tuple, set[int]] = {}
    habit: dict[tuple, int] = {}
    with_token: dict[str, set[int]] = {}
    mine: dict[tuple, tuple] = {}
    wanted = set()
    for r in core:
        point = graph.point_of(r)
        if point is None:
            continue
        if point.is_collective:
            wanted.add((r, point.pg_name, point.seq))
        elif point.rows is not None:
            own = point.rows[point.rows["rank"] == r]
            if len(own):
                wanted.add((r, point.pg_name, -int(own["record_id"].iloc[0]) - 1))
    bounds = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        r = int(ranks[a])
        runs: list[tuple[str, int]] = [("<start>", 1)] * CONTEXT
        for i in range(a, b):
            tok = token[i]
            if runs[-1][0] == tok:
                runs[-1] = (tok, runs[-1][1] + 1)
            else:
                runs.append((tok, 1))
            gram = tuple(runs[-CONTEXT:])
            grams.setdefault(gram, set()).add(r)
            habit[(r, gram)] = habit.get((r, gram), 0) + 1
            with_token.setdefault(tok, set()).add(r)
            key = (r, str(pgs[i]), int(seqs[i]))
            if key in wanted:
                mine[key] = gram
    deviants: dict[int, str] = {}
    for r, pg_name, seq in sorted(wanted):
        gram = mine.get((r, pg_name, seq))
        if gram is None:
            continue
        tok = gram[-1][0]
        if habit.get((r, gram), 0) > 1:
            continue  # the rank did exactly this in earlier steps: its usual order
        others = len(with_token.get(tok, set()) - {r})
        seen = len(grams.get(gram, set()) - {r})
        if others and seen > RARE_SHARE * others:
            continue
        skip = any(
            len(other) == len(gram)
            and [t for t, _ in other] == [t for t, _ in gram]
            and sum(abs(x - y) for (_, x), (_, y) in zip(other, gram, strict=True)) == 1
            and grams[other] - {r}
            for other in grams
            if other[-1][0] == tok
        )
        deviants[r] = SKIP if skip else REORDER
    if len(deviants) == len(core):
        return {}
    return deviants
