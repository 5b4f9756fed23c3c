"""Skipped collectives, told by where each member called them from.

PyTorch counts ``collective_seq_id`` per group on every member, so a rank that skips a call
issues its *next* call of that group at the skipped seq. Sizes cannot always tell (an
all_to_all's differ per rank anyway); the call site can: at seq s the skipper's entry comes
from the line its peers reach at s + 1. The reference call site at a seq is the strict
majority of the group's recorded members, else of its sibling groups (same kind) at that seq.
Only the few seqs before each point where ranks are blocked are looked at.
"""

from __future__ import annotations

import numpy as np

from frtools.analyze.align import at_seqs, category_codes

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
    near = coll[at_seqs(coll["seq"], seqs) & coll["call_site"].notna().to_numpy()]
    if not len(near):
        return {}
    # columns as codes and plain ints (131,072 ranks: ~10^6 rows, not one string each)
    group_codes, group_names = category_codes(near["pg_name"])
    site_codes, site_texts = category_codes(near["call_site"])
    names = [str(g) for g in group_names]
    texts = [str(t) for t in site_texts]
    seq_of = near["seq"].to_numpy()
    code_of = {n: c for c, n in enumerate(names)}
    # the wanted groups' rows, per (group, seq) its ranks and their sites' codes (a rank
    # recorded twice there: its last row); their siblings' only counted, for a tie
    mine = np.flatnonzero(np.isin(group_codes, [code_of[g] for g in wanted if g in code_of]))
    ranks = near["rank"].to_numpy()
    order = mine[np.lexsort((ranks[mine], seq_of[mine], group_codes[mine]))]
    sites: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    if len(order):
        g_o, s_o, r_o = group_codes[order], seq_of[order], ranks[order]
        # lexsort is stable: of a rank's rows at one (group, seq) the last is its last
        last = np.ones(len(order), dtype=bool)
        last[:-1] = (g_o[1:] != g_o[:-1]) | (s_o[1:] != s_o[:-1]) | (r_o[1:] != r_o[:-1])
        order, g_o, s_o, r_o = order[last], g_o[last], s_o[last], r_o[last]
        cut = np.flatnonzero((g_o[1:] != g_o[:-1]) | (s_o[1:] != s_o[:-1])) + 1
        for lo, hi in zip([0, *cut.tolist()], [*cut.tolist(), len(order)], strict=True):
            key = (names[int(g_o[lo])], int(s_o[lo]))
            sites[key] = (r_o[lo:hi], site_codes[order[lo:hi]])
    siblings = _Siblings(facts, group_codes, code_of, seq_of, site_codes, texts)
    code_of_text = {t: c for c, t in enumerate(texts)}
    found: dict[int, tuple[str, int]] = {}
    for pg_name, window in wanted.items():
        for seq in sorted(window):
            ref = _reference(sites, siblings, pg_name, seq)
            after = _reference(sites, siblings, pg_name, seq + 1)
            here = sites.get((pg_name, seq))
            if ref is None or after is None or ref == after or here is None:
                continue
            rank_at, site_at = here
            for rank in rank_at[site_at == code_of_text[after]].tolist():
                if rank not in found:
                    found[rank] = (pg_name, seq)
    return found


def _reference(
    sites: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]],
    siblings: _Siblings,
    pg_name: str,
    seq: int,
) -> str | None:
    """The call site most members reach at this seq: the group's strict majority, else its
    siblings'."""
    here = sites.get((pg_name, seq))
    own = None if here is None else siblings.top(here[1])
    return own if own is not None else siblings.majority(pg_name, seq)


class _Siblings:
    """The call site most members of a group's siblings (its other groups of one kind) reach
    at a seq: what breaks a tie inside the group. Counted over code arrays, a kind's groups
    found once (16,384 groups of a kind at 131,072 ranks)."""

    def __init__(
        self,
        facts: JobFacts,
        group_codes: np.ndarray,
        code_of: dict[str, int],
        seq_of: np.ndarray,
        site_codes: np.ndarray,
        texts: list[str],
    ) -> None:
        self.facts = facts
        self.group_codes, self.code_of = group_codes, code_of
        self.seq_of, self.site_codes, self.texts = seq_of, site_codes, texts
        self.kinds: dict[str, list[str]] | None = None
        # per kind, which group codes are of it (the last slot: code -1, no group); per seq,
        # its rows: a question is then a look-up over one seq's rows, not a pass over all
        self._of_kind: dict[str, np.ndarray] = {}
        self._at: dict[int, np.ndarray] = {}

    def majority(self, pg_name: str, seq: int) -> str | None:
        if self.kinds is None:
            self.kinds = {}
            for g in self.facts.membership.members:
                self.kinds.setdefault(self.facts.kind_of_group(g), []).append(g)
        kind = self.facts.kind_of_group(pg_name)
        of_kind = self._of_kind.get(kind)
        if of_kind is None:
            of_kind = self._of_kind[kind] = np.zeros(len(self.code_of) + 1, dtype=bool)
            of_kind[[self.code_of[g] for g in self.kinds.get(kind, ()) if g in self.code_of]] = True
        at = self._at.get(seq)
        if at is None:
            at = self._at[seq] = np.flatnonzero(self.seq_of == seq)
        groups = self.group_codes[at]
        rows = at[of_kind[groups] & (groups != self.code_of.get(pg_name, -2))]
        return self.top(self.site_codes[rows])

    def top(self, codes: np.ndarray) -> str | None:
        """The call site most of ``codes`` name, if a strict majority of two or more does."""
        counts = np.bincount(codes, minlength=len(self.texts))
        if not counts.any():
            return None
        top = int(counts.argmax())
        return _strict_majority(self.texts[top], int(counts[top]), int(counts.sum()))


def _strict_majority(top: str | None, n: int, total: int) -> str | None:
    """The most common value, if more than half of at least two values are it."""
    return top if n * 2 > total and total >= 2 else None
