"""Skipped collectives, told by where each member called them from.

PyTorch counts ``collective_seq_id`` per group on every member, so a rank that skips a call
issues its *next* call of that group at the skipped seq. Sizes cannot always tell (an
all_to_all's differ per rank anyway); the call site can: at seq s the skipper's entry comes
from the line its peers reach at s + 1. The reference call site at a seq is the strict
majority of the group's recorded members, else of its sibling groups (same kind) at that seq.
Only the few seqs before each point where ranks are blocked are looked at.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd

from frtools.analyze.align import _codes

from .facts import JobFacts
from .graph import WaitForGraph

# Seqs before a blocked point in which a skip is looked for.
LOOKBACK = 3


def skipped(facts: JobFacts, graph: WaitForGraph) -> dict[int, tuple[str, int]]:
    """rank -> (group, seq) of the collective it skipped, for ranks whose entry at that
    seq comes from the call site their peers reach one collective later."""
    coll = facts.al.collectives
    wanted: dict[str, set[int]] = {}
    for p in graph.points.values():
        if p.is_collective and p.blockers and p.seq is not None:
            wanted.setdefault(p.pg_name, set()).update(range(max(1, p.seq - LOOKBACK), p.seq + 1))
    if not wanted or "call_site" not in coll.columns:
        return {}
    seqs = sorted(
        {s for v in wanted.values() for s in v} | {s + 1 for v in wanted.values() for s in v}
    )
    near = coll[coll["seq"].isin(seqs).to_numpy() & coll["call_site"].notna().to_numpy()]
    if not len(near):
        return {}
    # columns as codes and plain ints (131,072 ranks: ~10^6 rows, not one string each)
    group_codes, group_names = _codes(near["pg_name"])
    site_codes, site_texts = _codes(near["call_site"])
    names = [str(g) for g in group_names]
    texts = [str(t) for t in site_texts]
    sites: dict[tuple[str, int], dict[int, str]] = {}
    for g, seq, rank, site in zip(
        group_codes.tolist(),
        near["seq"].to_numpy().tolist(),
        near["rank"].to_numpy().tolist(),
        site_codes.tolist(),
        strict=True,
    ):
        if g >= 0:
            sites.setdefault((names[g], seq), {})[rank] = texts[site]
    # groups by kind, once: a tie is broken by the siblings (16,384 groups of a kind at
    # 131,072 ranks: not a scan of every group per seq)
    by_kind: dict[str, list[str]] = {}
    for g in facts.membership.members:
        by_kind.setdefault(facts.kind_of_group(g), []).append(g)
    found: dict[int, tuple[str, int]] = {}
    for pg_name, window in wanted.items():
        for seq in sorted(window):
            here = sites.get((pg_name, seq), {})
            ref = _reference(facts, sites, pg_name, seq, by_kind)
            after = _reference(facts, sites, pg_name, seq + 1, by_kind)
            if ref is None or after is None or ref == after:
                continue
            for rank, site in here.items():
                if site == after and site != ref and rank not in found:
                    found[rank] = (pg_name, seq)
    return found


def _reference(
    facts: JobFacts,
    sites: dict[tuple[str, int], dict[int, str]],
    pg_name: str,
    seq: int,
    by_kind: dict[str, list[str]],
) -> str | None:
    """The call site most members reach at this seq: the group's strict majority, else its
    siblings' (``by_kind``: the groups of each kind, in membership order)."""
    own = _majority(sites.get((pg_name, seq), {}).values())
    if own is not None:
        return own
    others: list[str] = []
    for g in by_kind.get(facts.kind_of_group(pg_name), ()):
        if g != pg_name:
            others += list(sites.get((g, seq), {}).values())
    return _majority(others)


def _majority(values) -> str | None:  # noqa: ANN001
    counts = Counter(v for v in values if isinstance(v, str) and not pd.isna(v))
    if not counts:
        return None
    (top, n), *rest = counts.most_common()
    total = sum(counts.values())
    return top if n * 2 > total and total >= 2 else None
