"""The wait-for graph: built once from the aligned records and the job's facts, then only
read by the rules.

Each rank is blocked on its oldest op that did not complete (without any completion
information: on its latest op). It waits for the members of that op's group that never
issued it, have no record, issued something that disagrees where the op requires agreement,
issued it but are blocked in an older op of their own, or whose process ended after
issuing it. Ranks that are waited on but wait for nobody are the graph's roots; waiting
ranks from which no root is reachable sit in a cycle.

The graph is kept compressed: a rank points to the *point* it is blocked at (a group + seq,
or a P2P pair + index) and a point lists the ranks it waits for, so a world-sized collective
with half the world missing costs O(ranks), not O(ranks^2).

What counts as "completed" is ``completion.py``'s to say; the graph reads its answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from frtools.analyze.align import SIGNATURE_COLUMNS, at_seqs, text_series
from frtools.model.codes import among
from frtools.model.ops import OP, family_of, parts_must_agree, semantics

from .completion import effective_completion, quitters
from .facts import CompletionSource, JobFacts, counter_pair
from .model import MemberState, Point, PointKey, PointKind

# An op younger than this at its rank's dump time (when the dump says when it was taken)
# is in flight, not blocked: live dumps of healthy jobs are full of such ops. Not applied to
# a rank whose recorder marked a stall.
IN_FLIGHT_NS = 5 * 1_000_000_000


@dataclass(frozen=True)
class WaitForGraph:
    points: Mapping[PointKey, Point]
    blocked_at: Mapping[int, PointKey]
    blocked_known: frozenset[int]  # blocked ranks whose record says the op did not complete
    waiting: frozenset[int]  # blocked ranks that wait for somebody
    roots: frozenset[int]  # waited for, waiting for nobody
    cyclic: frozenset[int]  # waiting ranks from which no root is reachable
    stuck_roots: frozenset[int]  # roots blocked in an op every member issued, none completed
    unrecorded: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # ^ rank -> groups where pg_status counts an op that no entry shows and that did not
    #   complete (Gloo's FR records no send/recv)

    def point_of(self, rank: int) -> Point | None:
        key = self.blocked_at.get(rank)
        return None if key is None else self.points[key]

    def targets_of(self, rank: int) -> frozenset[int]:
        return _targets_at(self.point_of(rank), rank)


def _targets_at(point: Point | None, rank: int) -> frozenset[int]:
    """Whom ``rank``, blocked at ``point``, waits for (nobody if it is the one that
    disagrees there)."""
    if point is None or rank in point.minority:
        return frozenset()
    targets = point.targets
    return targets - {rank} if rank in targets else targets


def is_stuck(point: Point, trust_gloo: bool = False) -> bool:
    """Every member issued it with one signature and nobody completed it."""
    if not point.is_collective or point.targets or point.of(MemberState.UNKNOWN):
        return False
    rows = point.rows
    if rows is None or not len(rows) or not point.blockers or point.unseen:
        return False
    if point.completed or point.failed:
        return False
    if rows["completed"].isna().all():
        return False
    # Gloo marks completion from a callback that may lag the op's return, so "issued
    # everywhere, completed nowhere" alone is only trusted with real states.
    return trust_gloo or bool(rows["informative"].all())


def build_graph(facts: JobFacts) -> WaitForGraph:
    graph = _Builder(facts).build()
    failed_last = quitters(facts, graph.roots, graph.blocked_at)
    if failed_last:
        graph = _Builder(facts, failed_last).build()
    return graph


@dataclass
class _Draft:
    """A point while the builder fills it in."""

    key: PointKey
    op: str | None = None
    time_ns: int = 0
    rows: pd.DataFrame | None = None
    p2p_index: int | None = None
    members: dict[MemberState, list[int]] = field(default_factory=dict)
    blockers: list[int] = field(default_factory=list)
    mismatch_attrs: tuple[str, ...] = ()
    tie: bool = False
    unseen: int = 0
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    def add(self, state: MemberState, rank: int) -> None:
        self.members.setdefault(state, []).append(rank)

    def get(self, state: MemberState) -> list[int]:
        return self.members.get(state, [])

    def freeze(self) -> Point:
        return Point(
            key=self.key,
            op=self.op,
            time_ns=self.time_ns,
            members={s: tuple(sorted(set(v))) for s, v in self.members.items() if v},
            blockers=tuple(sorted(self.blockers)),
            rows=self.rows,
            p2p_index=self.p2p_index,
            mismatch_attrs=self.mismatch_attrs,
            tie=self.tie,
            unseen=self.unseen,
            completed=self.completed,
            failed=self.failed,
        )


class _Builder:
    def __init__(self, facts: JobFacts, failed_last: frozenset[int] = frozenset()) -> None:
        self.f = facts
        self.coll = facts.al.collectives
        self.p2p = facts.al.p2p
        self.drafts: dict[PointKey, _Draft] = {}
        self.blocked_at: dict[int, PointKey] = {}
        self.blocked_known: set[int] = set()
        self._pair_rows: dict[tuple, pd.DataFrame] = {}
        # ranks in failed_last: their latest op failed (see build_graph)
        self.done = effective_completion(facts, failed_last)

    # ----- where each rank is blocked ----------------------------------------------------

    def _blocked_ops(self) -> pd.DataFrame:
        """Per rank, where it is blocked: its oldest pending op where its record says which
        ops completed, else its latest op. Only those few rows leave the big frames."""
        cols = ["rank", "pg_name", "kind", "seq", "time_created_ns", "record_id", "completed"]
        frames = [("coll", self.coll, self.done)]
        if len(self.p2p):
            frames.append(("p2p", self.p2p, self.p2p["completed"]))
        # the ranks with any completion info (``among``: a flag per rank number, not a sort
        # of millions of rows and a search per row)
        informed = np.concatenate(
            [f["rank"].to_numpy()[done.notna().to_numpy(dtype=bool)] for _, f, done in frames]
        )
        parts = []
        for kind, f, done in frames:
            rank = f["rank"].to_numpy()
            has_info = among(rank, informed)
            pending = done.eq(False).fillna(False).to_numpy(dtype=bool)
            # ranks without completion info: only their latest op matters
            latest = np.zeros(len(f), dtype=bool)
            if not has_info.all():
                no_info = f[~has_info]
                order = no_info.sort_values(["time_created_ns", "record_id"])
                latest[f.index.get_indexer(order.drop_duplicates("rank", keep="last").index)] = True
            keep = (has_info & pending) | latest
            small = f[[c for c in cols if c in f.columns]][keep].assign(completed=done[keep])
            part = small.assign(kind=kind, rank_has_info=has_info[keep])
            if kind == "p2p":
                part = part.assign(seq=small.index.to_numpy())  # seq := row in al.p2p
            parts.append(part[cols + ["rank_has_info"]])
        ops = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)
        if not len(ops):
            return ops.assign(rank_has_info=pd.Series(dtype=bool))
        pending = (ops["completed"] == False) & ~self._completed_by_a_peer(ops)  # noqa: E712
        with_info = ops[ops["rank_has_info"] & pending]
        oldest = with_info.sort_values(["time_created_ns", "record_id"]).drop_duplicates("rank")
        no_info = ops[~ops["rank_has_info"]]
        latest = no_info.sort_values(["time_created_ns", "record_id"]).drop_duplicates(
            "rank", keep="last"
        )
        out = pd.concat([oldest, latest], ignore_index=True)
        if self.f.dump_ns and len(out):
            # An op issued moments before its rank's dump is in flight, not hung.
            age = out["rank"].map(self.f.dump_ns) - out["time_created_ns"]
            out = out[~(age.notna() & (age < IN_FLIGHT_NS))]
        self.blocked_known = set(int(r) for r in out.loc[out["rank_has_info"], "rank"])
        return out

    def _completed_by_a_peer(self, ops: pd.DataFrame) -> pd.Series:
        """Which of ``ops`` (pending ones) are collectives another member of a fully known
        group completed: a collective completes nowhere before every member entered it, so
        a member still showing it pending only lags in noticing.

        Only where that completion proves success and every member is accounted for: the
        group has no absent or unnamed member, and its membership is known complete (listed,
        or as large as its siblings) or its members' completion marks are real states.
        Gloo's FR retires an op that failed on a dead peer, and its dumps list no members:
        a member nobody saw may be the one missing.
        """
        lagging = pd.Series(False, index=ops.index)
        coll = (ops["kind"] == "coll").to_numpy()
        if not coll.any():
            return lagging
        f = self.f
        whole = {
            str(n)
            for n, ranks in f.membership.members.items()
            if not set(ranks) & f.absent
            and not f.membership.unseen.get(n)
            and (
                n in f.membership.complete
                or all(f.completion.get(r) is CompletionSource.STATES for r in ranks)
            )
        }
        keys = pd.DataFrame(
            {
                "pg_name": text_series(ops["pg_name"]),
                "seq": ops["seq"].to_numpy("int64"),
            }
        )
        asked = keys[coll & keys["pg_name"].isin(whole).to_numpy()].drop_duplicates()
        if not len(asked):
            return lagging
        # the completed rows at those (group, seq): filter the big frame by seq first
        c = self.coll
        done = self.done.eq(True).fillna(False).to_numpy(dtype=bool)
        at = at_seqs(c["seq"], asked["seq"].unique()) & done
        # the two columns of those rows, not every column (millions of rows at fleet scale)
        near = pd.DataFrame(
            {"pg_name": text_series(c["pg_name"][at]), "seq": c["seq"].to_numpy()[at]}
        )
        done = near.merge(asked, on=["pg_name", "seq"]).drop_duplicates()
        if not len(done):
            return lagging
        # a left merge keeps the left rows' order: one flag per op, no per-row Python
        hit = keys.merge(done.assign(_done=True), how="left", on=["pg_name", "seq"])["_done"]
        return pd.Series(coll & hit.eq(True).to_numpy(dtype=bool), index=ops.index)

    # ----- points ------------------------------------------------------------------------

    def build(self) -> WaitForGraph:
        blocked = self._blocked_ops()
        coll_blocked = blocked[blocked["kind"] == "coll"]
        if len(coll_blocked):
            keys = coll_blocked[["pg_name", "seq"]].drop_duplicates()
            near = at_seqs(self.coll["seq"], keys["seq"].unique())
            c = self.coll[near].assign(_done=self.done[near])
            rows = c.merge(keys, on=["pg_name", "seq"], how="inner")
            rows_by_point = dict(iter(rows.groupby(["pg_name", "seq"], sort=False, observed=True)))
            for (pg_name, seq), who in coll_blocked.groupby(
                ["pg_name", "seq"], sort=False, observed=True
            ):
                draft = self._collective_point(
                    str(pg_name), int(seq), rows_by_point.get((pg_name, seq))
                )
                draft.blockers = sorted(int(r) for r in who["rank"])
                for r in draft.blockers:
                    self.blocked_at[r] = draft.key
        p2p_blocked = blocked[blocked["kind"] == "p2p"]
        if len(p2p_blocked):
            # Only the pairs some rank is blocked on, split once.
            p2p = self.p2p
            mine = p2p.loc[p2p_blocked["seq"].to_numpy(), ["pg_name", "sender", "receiver"]]
            rows = p2p.merge(mine.drop_duplicates(), on=["pg_name", "sender", "receiver"])
            self._pair_rows = dict(
                iter(rows.groupby(["pg_name", "sender", "receiver", "direction"], observed=True))
            )
        for row in p2p_blocked.itertuples(index=False):
            draft = self._p2p_point(int(row.seq))
            if draft is None:
                continue
            draft.blockers.append(int(row.rank))
            self.blocked_at[int(row.rank)] = draft.key
        self._mark_busy_and_gone()
        points = {k: d.freeze() for k, d in self.drafts.items()}
        return _summarize(
            points, dict(self.blocked_at), frozenset(self.blocked_known), self._unrecorded()
        )

    def _mark_busy_and_gone(self) -> None:
        """Members that issued the op but are blocked in an older op of their own (ops run
        in order: NCCL streams, a CPU that ran ahead) cannot join it yet: they are waited
        for. So are members whose record does not reach back to the op (wrapped) but who
        are known to be blocked in another op now, and members whose process ended after
        issuing it."""
        f = self.f
        for draft in self.drafts.values():
            if not draft.blockers:
                continue
            pending: list[int] = list(draft.get(MemberState.UNKNOWN))
            if draft.rows is not None:
                rows = draft.rows
                pending += [int(m) for m in rows.loc[rows["_done"] == False, "rank"]]  # noqa: E712
            minority = set(draft.get(MemberState.MINORITY))
            busy = {
                m
                for m in pending
                if m in self.blocked_known
                and self.blocked_at.get(m, draft.key) != draft.key
                and m not in minority
            }
            blockers_alive = any(not f.gone(b) for b in draft.blockers)
            blockers = set(draft.blockers)  # a list: tested for every pending member
            gone = {
                m
                for m in pending
                if m not in busy
                and m not in minority
                and m not in blockers
                and (e := f.ending(m)) is not None
                and (e.abnormal or (e.gone and not e.victim and blockers_alive))
            }
            draft.members[MemberState.BUSY] = sorted(busy)
            draft.members[MemberState.GONE] = sorted(gone)
            draft.members[MemberState.UNKNOWN] = sorted(set(draft.get(MemberState.UNKNOWN)) - busy)
            if gone:
                draft.members[MemberState.ISSUED] = sorted(
                    set(draft.get(MemberState.ISSUED)) - gone
                )
            # A blocker whose process ended by its own failure cannot be waited for by the
            # others as "issued": it is the one they wait for.
            ended = [b for b in draft.blockers if (e := f.ending(b)) is not None and e.abnormal]
            if ended and len(ended) < len(draft.blockers):
                draft.blockers = [b for b in draft.blockers if b not in ended]
                draft.members[MemberState.GONE] = sorted(set(gone) | set(ended))
                draft.members[MemberState.ISSUED] = sorted(
                    set(draft.get(MemberState.ISSUED)) - set(ended)
                )
                for b in ended:
                    self.blocked_at.pop(b, None)

    def _collective_point(self, pg_name: str, seq: int, rows: pd.DataFrame | None) -> _Draft:
        draft = _collective_draft(self.f, pg_name, seq, rows)
        self.drafts[draft.key] = draft
        return draft

    def _p2p_point(self, idx: int) -> _Draft | None:
        p2p = self.p2p
        row = p2p.loc[idx]
        sender, receiver = int(row["sender"]), int(row["receiver"])
        if sender < 0 or receiver < 0:
            return None
        k = int(row["pair_index"])
        key = PointKey(
            PointKind.P2P, str(row["pg_name"]), sender=sender, receiver=receiver, index=k
        )
        if key in self.drafts:
            return self.drafts[key]
        draft = _Draft(
            key=key,
            op=str(row["op"]),
            time_ns=int(row["time_created_ns"]),
            p2p_index=int(row["p2p_seq_id"]) or None,
        )
        other_dir = "recv" if row["direction"] == "send" else "send"
        pair = self._pair_rows.get((row["pg_name"], sender, receiver, other_dir))
        if pair is None:
            pair = p2p.iloc[0:0]
        me = int(row["rank"])
        peer = receiver if me == sender else sender
        peer_known = (
            pair["completed"].notna().any()
            or self._has_info(peer)
            or self._idle_on(peer, str(row["pg_name"]))
        )
        known = pd.notna(row["completed"]) and not bool(row["completed"])
        if known and peer_known:
            # Ops of one pair complete in order: my oldest incomplete op matches the peer's
            # oldest incomplete counterpart, whatever either ring buffer dropped.
            match = pair[pair["completed"] == False].sort_values("record_id").head(1)  # noqa: E712
            uncertain = False
        else:
            match = pair[pair["pair_index"] == k]
            uncertain = bool(row["uncertain"]) or peer in self.f.wrapped
        rows = pd.concat([p2p.loc[[idx]], match])
        draft.rows = rows.assign(_done=rows["completed"])
        draft.add(MemberState.ISSUED, me)
        if peer in self.f.absent:
            draft.add(MemberState.ABSENT, peer)
        elif not len(match):
            draft.add(MemberState.UNKNOWN if uncertain else MemberState.MISSING, peer)
        else:
            other = match.iloc[0]
            attrs = tuple(
                col
                for col in ("input_sizes", "input_dtypes")
                if other[col] and row[col] and other[col] != row[col]
            )
            if attrs:
                draft.mismatch_attrs = attrs
                draft.members[MemberState.MINORITY] = sorted({me, peer})
                draft.members[MemberState.ISSUED] = []
            else:
                draft.add(MemberState.ISSUED, peer)
        draft.completed, draft.failed = _outcomes(draft.rows)
        self.drafts[key] = draft
        return draft

    def _idle_on(self, rank: int, pg_name: str) -> bool:
        """Whether ``rank``'s counters say every op it enqueued on the group completed (a
        dump of the active ops of a rank with none left holds no entry of the group): it
        holds no counterpart that could still be pending. A record without entries cannot
        say which of its counters is the group's (they are keyed by the process's own
        group ids): then every counter must say so."""
        info = self.f.trace.ranks.get(rank)
        if info is None or not info.pg_status:
            return False
        mine = counter_pair(info.pg_status.get(pg_name))
        if mine is not None:
            return mine[0] == mine[1]
        known = [c for c in map(counter_pair, info.pg_status.values()) if c is not None]
        return bool(known) and all(enq == comp for enq, comp in known)

    def _has_info(self, rank: int) -> bool:
        """Whether this rank's record says which of its ops completed."""
        if not hasattr(self, "_ranks_with_info"):
            known = set(int(r) for r in self.coll.loc[self.coll["completed"].notna(), "rank"])
            if len(self.p2p):
                p = self.p2p
                known |= set(int(r) for r in p.loc[p["completed"].notna(), "rank"])
            self._ranks_with_info = known
        return rank in self._ranks_with_info

    def _unrecorded(self) -> dict[int, tuple[str, ...]]:
        """Ranks whose pg_status counts an op past every entry of the group that did not
        complete, where that rank is blocked nowhere else: an unrecorded op (Gloo's FR
        records no send/recv) holds it."""
        out: dict[int, list[str]] = {}
        for rank, info in self.f.trace.ranks.items():
            if rank in self.blocked_at or self.f.completion.get(rank) is CompletionSource.STATES:
                continue
            for pg_name, st in info.pg_status.items():
                if not isinstance(st, dict):
                    continue
                enq = st.get("last_enqueued_collective")
                comp = st.get("last_completed_collective")
                if not isinstance(enq, int) or not isinstance(comp, int) or enq <= comp:
                    continue
                status = self.f.status.get((rank, str(pg_name)))
                last_entry = None if status is None else status[1]
                recorded = last_entry is not None and not pd.isna(last_entry)
                if recorded and int(last_entry) >= enq:
                    continue  # the pending op is an entry: the graph already judged it
                out.setdefault(int(rank), []).append(str(pg_name))
        return {r: tuple(g) for r, g in out.items()}


def collective_point(facts: JobFacts, pg_name: str, seq: int, rows: pd.DataFrame | None) -> Point:
    """One collective's point outside the graph (nobody blocked there): what each member
    did at (group, seq)."""
    if rows is not None and "_done" not in rows.columns:
        rows = rows.assign(_done=rows["completed"])
    return _collective_draft(facts, pg_name, seq, rows).freeze()


def _collective_draft(facts: JobFacts, pg_name: str, seq: int, rows: pd.DataFrame | None) -> _Draft:
    key = PointKey(PointKind.COLLECTIVE, pg_name, seq=seq)
    draft = _Draft(key=key, rows=rows)
    members = set(facts.members(pg_name))
    recorded = set() if rows is None else set(int(r) for r in rows["rank"])
    members |= recorded
    time_ns = int(rows["time_created_ns"].min()) if rows is not None and len(rows) else None
    for m in sorted(members - recorded):
        draft.add(_member_state(facts, m, pg_name, seq, time_ns), m)
    draft.unseen = int(facts.membership.unseen.get(pg_name, 0))
    if rows is not None and len(rows):
        majority_sig, minority, tie = _majority(facts, rows, pg_name, seq)
        draft.tie = tie
        draft.members[MemberState.MINORITY] = sorted(minority)
        draft.members[MemberState.ISSUED] = sorted(
            set(draft.get(MemberState.ISSUED)) | (recorded - set(minority))
        )
        major = rows[rows["sig"] == majority_sig]
        draft.op = str(major["op"].iloc[0])
        draft.time_ns = int(major["time_created_ns"].min())
        if minority:
            odd = rows[rows["rank"].isin(minority)]
            draft.mismatch_attrs = disagreement(major.iloc[0], odd)
        elif draft.get(MemberState.ABSENT) or draft.unseen:
            # The member that could disagree left no record: the sibling groups at this seq
            # say what the op's dtype should be.
            attrs = _odd_dtype(facts, major.iloc[0], pg_name, seq)
            if attrs:
                draft.members[MemberState.MINORITY] = sorted(recorded)
                draft.members[MemberState.ISSUED] = sorted(
                    set(draft.get(MemberState.ISSUED)) - recorded
                )
                draft.mismatch_attrs = attrs
        draft.completed, draft.failed = _outcomes(rows)
    absent = draft.get(MemberState.ABSENT)
    if absent and (draft.get(MemberState.MISSING) or draft.get(MemberState.MINORITY)):
        # A present rank already explains the wait; whether the absent one got here is
        # unknown (its dump is missing), so it is not blamed for it.
        draft.members[MemberState.NO_RECORD] = sorted(absent)
        draft.members[MemberState.ABSENT] = []
    return draft


def _outcomes(rows: pd.DataFrame) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks whose entry completed, and those whose entry failed (an error, or a
    "completion" the graph does not believe)."""
    ranks = rows["rank"].to_numpy()
    done = rows["_done"].eq(True).fillna(False).to_numpy(dtype=bool)
    marked = rows["completed"].eq(True).fillna(False).to_numpy(dtype=bool)
    failed = (marked & ~done) | rows["error"].notna().to_numpy()
    return tuple(sorted(int(r) for r in ranks[done])), tuple(sorted(int(r) for r in ranks[failed]))


def _member_state(
    facts: JobFacts, m: int, pg_name: str, seq: int, time_ns: int | None
) -> MemberState:
    if m in facts.absent:
        return MemberState.ABSENT
    st = facts.status.get((m, pg_name))
    last = None if st is None else st[1]
    if last is None or pd.isna(last):
        if m not in facts.wrapped:
            return MemberState.MISSING
        # A wrapped record without this group: it still covers the op's time if its
        # oldest entry is older, and then the op is simply not in it.
        oldest = facts.oldest_ns.get(m)
        if time_ns is not None and oldest is not None and oldest < time_ns:
            return MemberState.MISSING
        return MemberState.UNKNOWN
    return MemberState.ISSUED if int(last) >= seq else MemberState.MISSING


def _majority(
    facts: JobFacts, rows: pd.DataFrame, pg_name: str, seq: int
) -> tuple[int, list[int], bool]:
    counts = rows["sig"].value_counts()
    top = counts[counts == counts.max()].index.tolist()
    tie = len(top) > 1
    if tie:
        top = _tie_break(facts, top, pg_name, seq) or top[:1]
    majority = int(top[0])
    minority = [int(r) for r in rows.loc[rows["sig"] != majority, "rank"]]
    return majority, minority, tie


def _odd_dtype(facts: JobFacts, major: pd.Series, pg_name: str, seq: int) -> tuple[str, ...]:
    """The dtype attributes in which this group's op differs from what every sibling group
    (same kind) recorded for the same op at the same seq. Only dtypes: sibling groups may
    legitimately move different sizes (pipeline stages' data-parallel buckets)."""
    kind = facts.kind_of_group(pg_name)
    same_kind = [
        g for g in facts.membership.members if g != pg_name and facts.kind_of_group(g) == kind
    ]
    if not same_kind:
        return ()
    coll = facts.al.collectives
    peers = coll[(coll["seq"] == seq).to_numpy() & coll["pg_name"].isin(same_kind).to_numpy()]
    family = family_of(str(major[OP]))  # per row in Python: pandas 3 maps strings to strings
    peers = peers[np.fromiter((family_of(str(o)) == family for o in peers["op"]), bool, len(peers))]
    if len(peers) < 2:
        return ()
    rule = semantics(str(major[OP]))
    attrs = []
    for col in ("input_dtypes", "output_dtypes"):
        values = peers[col].astype(str).unique()
        if rule.checks(col) and len(values) == 1 and values[0] != str(major[col]):
            attrs.append(col)
    return tuple(attrs)


def _tie_break(facts: JobFacts, sigs: list[int], pg_name: str, seq: int) -> list[int]:
    """Equal counts inside the group: ask the groups of the same kind at the same seq."""
    kind = facts.kind_of_group(pg_name)
    same_kind = [
        g for g in facts.membership.members if g != pg_name and facts.kind_of_group(g) == kind
    ]
    if not same_kind:
        return []
    coll = facts.al.collectives
    peers = coll[(coll["seq"] == seq) & coll["pg_name"].isin(same_kind)]
    counts = peers["sig"].value_counts()
    counts = counts[counts.index.isin(sigs)]
    if not len(counts) or (counts == counts.max()).sum() > 1:
        return []
    return [int(counts.idxmax())]


def disagreement(major: pd.Series, odd: pd.DataFrame) -> tuple[str, ...]:
    """The attributes that must agree (for the majority's op) where ``odd`` differs; ``op``
    when the op families (or a coalesced block's part families) differ."""
    parts = major.get("parts")
    rule = parts_must_agree(parts if isinstance(parts, str) else str(major[OP]))
    want = _families(major)
    attrs = [OP] if any(_families(row) != want for _, row in odd.iterrows()) else []
    for col in SIGNATURE_COLUMNS:
        if col != OP and col in rule and (odd[col] != major[col]).any():
            attrs.append(col)
    return tuple(attrs)


def _families(row: pd.Series) -> tuple:
    parts = row.get("parts")
    if isinstance(parts, str):
        return tuple(family_of(p) for p in parts.split(";") if p)
    return (family_of(str(row[OP])),)


def _summarize(
    points: dict[PointKey, Point],
    blocked_at: dict[int, PointKey],
    blocked_known: frozenset[int],
    unrecorded: dict[int, tuple[str, ...]],
) -> WaitForGraph:
    """Roots, waiting ranks and cycles of the graph (a fixpoint over the functional
    rank -> point map)."""
    # each blocked rank's targets, once (131,072 ranks: the fixpoint below asks again);
    # ranks blocked at one point share its key object: its point is looked up once, and
    # they share its target set object (unless a rank is among its own targets)
    targets: dict[int, frozenset[int]] = {}
    point_by_key: dict[int, Point] = {}
    # a rank blocked in an op it issued against what the op requires is a root too, even
    # when the member it disagrees with left no record to wait for it
    targeted: set[int] = set()
    for r, key in blocked_at.items():
        point = point_by_key.get(id(key))
        if point is None:
            point = point_by_key[id(key)] = points[key]
        targets[r] = _targets_at(point, r)
        if r in point.minority:
            targeted.add(r)
    waiting = {r for r, t in targets.items() if t}
    for t in {id(t): t for r, t in targets.items() if t}.values():
        targeted |= t
    # A rank without a record that is a member of an op whose wait a present rank's
    # disagreement explains may well be blocked in that op too (or aborted by Gloo on the
    # mismatched data): it is not a root of its own. (Not for a missing member: a dead
    # rank is absent from every op after its death, and is the root.)
    unjudged = {
        r
        for p in points.values()
        if p.of(MemberState.MINORITY)
        for r in p.of(MemberState.NO_RECORD)
    }
    silent = targeted & unjudged
    roots = targeted - waiting - silent
    reaches: dict[int, bool] = {r: False for r in waiting}
    # whether a target set reaches a root, per set object, within a pass (a False may go
    # stale when a later rank of the pass reaches: the pass is then repeated, and the last
    # one, which changes nothing, found every False afresh)
    reach_of: dict[int, bool] = {}
    changed = True
    while changed:
        changed = False
        reach_of.clear()
        for r in waiting:
            if reaches[r]:
                continue
            t = targets[r]
            got = reach_of.get(id(t))
            if got is None:
                got = reach_of[id(t)] = any(x in roots or reaches.get(x, False) for x in t)
            if got:
                reaches[r] = True
                changed = True
    cyclic = {r for r, ok in reaches.items() if not ok}
    # A root that is itself known to be blocked in an op every member issued and nobody
    # completed is not elsewhere: that op is stuck, and its waiters are victims.
    stuck_roots = {
        r
        for r in roots
        if r in blocked_known and r in blocked_at and is_stuck(points[blocked_at[r]], True)
    }
    return WaitForGraph(
        points=points,
        blocked_at=blocked_at,
        blocked_known=blocked_known,
        waiting=frozenset(waiting | silent),
        roots=frozenset(roots),
        cyclic=frozenset(cyclic),
        stuck_roots=frozenset(stuck_roots),
        unrecorded=unrecorded,
    )


def sink_core(nodes: Iterable[int], targets_of) -> set[int]:  # noqa: ANN001
    """Ranks of the sink strongly connected components of the wait-for subgraph on ``nodes``."""
    nodes = set(nodes)
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    comps: list[set[int]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(targets_of(start) & nodes)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(targets_of(w) & nodes))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                comps.append(comp)
    comp_of = {r: i for i, comp in enumerate(comps) for r in comp}
    core: set[int] = set()
    for i, comp in enumerate(comps):
        leaves = all(comp_of[t] == i for r in comp for t in targets_of(r) & nodes)
        if leaves and len(comp) > 1:
            core |= comp
    return core or set(nodes)
