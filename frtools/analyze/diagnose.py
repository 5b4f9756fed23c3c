"""Diagnosis: from an aligned Trace to exactly one Verdict.

The core is a *wait-for graph*. Each rank is blocked on its oldest op that did not complete
(without any completion information: on its latest op). It waits for the members of that
op's group that never issued the op, have no record at all, or issued something different
at that seq (the minority of a mismatch). Ranks that are waited on but wait for nobody are
the root cause (``guilty``); ranks that wait are victims (``waiting``), however many groups
show them as missing. Waiting ranks that reach no root sit in a cycle: a cross-group
deadlock (``order``).

The graph is kept compressed: a rank points to the *point* it is blocked at (a group + seq,
or a P2P pair + index) and a point points to the ranks it waits for, so a world-sized
collective with half the world missing costs O(ranks), not O(ranks^2).

Priority when several things are wrong (docs/verdict.md): roots of the graph first
(``dead`` > ``mismatch`` > ``missing`` by the reasons of the guilty ranks), then cycles
(``order``), then ops every member issued and nobody completed (``stuck``), then
inconsistent collectives that did not hang (``mismatch``), then ``straggler``, else
``healthy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from frtools.analyze.align import SIGNATURE_COLUMNS, Alignment, align
from frtools.analyze.stacks import main_thread_call_site, stacks_summary
from frtools.analyze.verdict import GuiltyRank, RankGroup, Verdict
from frtools.model.ranks import format_ranks
from frtools.model.trace import ProcessGroup, Trace

# A guilty rank whose dump was written this much earlier than the others' is a stale
# record of a process that was already gone.
STALE_DUMP_NS = 60 * 1_000_000_000

# An op younger than this at its rank's dump time (when the dump says when it was taken)
# is in flight, not blocked: live dumps of healthy jobs are full of such ops. Not applied to
# a rank whose recorder marked a stall.
IN_FLIGHT_NS = 5 * 1_000_000_000

# Straggler rule: with T = max(STRAGGLER_MIN_LATE_NS, STRAGGLER_SPREAD_FACTOR x the typical
# jitter), at least T behind the other members' mean in >= STRAGGLER_LAST_SHARE of the
# (>= STRAGGLER_MIN_COLLECTIVES) matched collectives it took part in, median lateness >= T.
STRAGGLER_LAST_SHARE = 0.6
STRAGGLER_MIN_COLLECTIVES = 5
STRAGGLER_MIN_LATE_NS = 5_000_000
STRAGGLER_SPREAD_FACTOR = 3.0

# Tokens of context when comparing a rank's recent order of ops with its peers'.
_CONTEXT = 4
# A rank's recent order is unusual when at most this share of its peers ever produced it.
_RARE_SHARE = 0.25
# Ops per rank (the most recent) whose order is compared.
_HISTORY = 256

_REASON_PRIORITY = {"absent": 0, "dead": 0, "mismatch": 1, "missing": 2}


@dataclass
class Point:
    """Where blocked ranks wait: a collective (pg, seq) or a P2P (pg, sender, receiver, k)."""

    key: tuple
    pg_name: str
    seq: int | None = None
    p2p_index: int | None = None
    op: str | None = None
    blockers: list[int] = field(default_factory=list)
    issued: list[int] = field(default_factory=list)  # agree with the majority
    missing: list[int] = field(default_factory=list)  # recorded, never issued it
    absent: list[int] = field(default_factory=list)  # no record at all
    unknown: list[int] = field(default_factory=list)  # record does not reach back (wrap)
    minority: list[int] = field(default_factory=list)  # issued something else
    busy: list[int] = field(default_factory=list)  # issued it, but blocked in an older op
    no_record: list[int] = field(default_factory=list)  # absent, not blamed for this op
    mismatch_attrs: list[str] = field(default_factory=list)
    rows: pd.DataFrame | None = None  # the members' entries at this point
    time_ns: int = 0

    @property
    def targets(self) -> set[int]:
        return set(self.missing) | set(self.absent) | set(self.minority) | set(self.busy)


def diagnose(trace: Trace, alignment: Alignment | None = None) -> Verdict:
    """The one Verdict for this trace (see module docstring for the rules)."""
    al = alignment if alignment is not None else align(trace)
    ctx = _Context(trace, al)
    verdict = (
        ctx.from_graph()
        or ctx.stuck()
        or ctx.silent_mismatch()
        or ctx.straggler()
        or ctx.unexplained_absence()
        or ctx.healthy()
    )
    ctx.finish(verdict)
    summary = stacks_summary(trace, verdict.guilty_ranks)
    if summary.ranks_with_stacks:
        verdict.stacks = summary
    return verdict


class _Context:
    def __init__(self, trace: Trace, al: Alignment) -> None:
        self.trace = trace
        self.al = al
        self.coll = al.collectives
        self.present = set(int(r) for r in trace.ranks)
        if len(self.coll):
            self.present |= set(int(r) for r in self.coll["rank"].unique())
        if len(al.p2p):
            self.present |= set(int(r) for r in al.p2p["rank"].unique())
        self.expected = set(trace.expected_ranks) | self.present
        for ranks in al.members.values():
            self.expected |= set(ranks)
        self.absent = self.expected - self.present
        self.wrapped = {r for r, info in trace.ranks.items() if info.wrapped}
        self.status = {
            key: (row.first_seq, row.last_issued, row.last_completed)
            for key, row in zip(al.status.index, al.status.itertuples(index=False), strict=True)
        }
        self.notes: list[str] = []
        self.blocked_known: set[int] = set()
        self._ranks_with_info: set[int] | None = None
        self._pair_rows: dict[tuple, pd.DataFrame] = {}
        times = [self.coll[["rank", "time_created_ns"]]]
        if len(al.p2p):
            times.append(al.p2p[["rank", "time_created_ns"]])
        oldest = pd.concat(times).groupby("rank")["time_created_ns"].min()
        self.oldest_ns = {int(r): int(t) for r, t in oldest.items()}
        self.points: dict[tuple, Point] = {}
        self.blocked_at: dict[int, tuple] = {}
        self.has_completion_info = bool(
            len(self.coll) and self.coll["completed"].notna().any()
        ) or bool(len(al.p2p) and al.p2p["completed"].notna().any())

    # ----- the wait-for graph ---------------------------------------------------------

    def _blocked_ops(self) -> pd.DataFrame:
        """Per rank, where it is blocked: its oldest pending op where its record says which
        ops completed, else its latest op. Only those few rows leave the big frames."""
        cols = ["rank", "pg_name", "kind", "seq", "time_created_ns", "record_id", "completed"]
        p2p = self.al.p2p
        frames = [("coll", self.coll)] + ([("p2p", p2p)] if len(p2p) else [])
        info: set[int] = set()
        for _, f in frames:
            info |= _ranks_where(f, f["completed"].notna())
        parts = []
        for kind, f in frames:
            rank = f["rank"].to_numpy()
            has_info = np.isin(rank, np.fromiter(info, dtype=np.int64, count=len(info)))
            pending = f["completed"].eq(False).fillna(False).to_numpy(dtype=bool)
            # ranks without completion info: only their latest op matters
            latest = np.zeros(len(f), dtype=bool)
            if not has_info.all():
                no_info = f[~has_info]
                order = no_info.sort_values(["time_created_ns", "record_id"])
                latest[f.index.get_indexer(order.drop_duplicates("rank", keep="last").index)] = True
            keep = (has_info & pending) | latest
            small = f[keep]
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
        dump_ns = {
            r: i.dump_time_ns
            for r, i in self.trace.ranks.items()
            if i.dump_time_ns and not i.stalled  # the recorder's watchdog saw a stall: not fresh
        }
        if any(i.alive is False for i in self.trace.ranks.values()):
            dump_ns = {}  # a member's process is gone: nothing it owes can still arrive
        if dump_ns and len(out):
            # An op issued moments before its rank's dump is in flight, not hung.
            age = out["rank"].map(dump_ns) - out["time_created_ns"]
            out = out[~(age.notna() & (age < IN_FLIGHT_NS))]
        self.blocked_known = set(int(r) for r in out.loc[out["rank_has_info"], "rank"])
        return out

    def _completed_by_a_peer(self, ops: pd.DataFrame) -> pd.Series:
        """Which of ``ops`` (pending ones) are collectives that another member of a fully
        recorded group completed.

        A collective completes nowhere before every member entered it, so a member still
        showing it pending only lags in noticing (Gloo marks completion from a callback just
        after ``wait()`` returns) and is not blocked there. Groups with a member that left no
        record are left alone: Gloo also marks an op that failed on a dead peer completed.
        """
        lagging = pd.Series(False, index=ops.index)
        coll = (ops["kind"] == "coll").to_numpy()
        if not coll.any():
            return lagging
        whole = {str(n) for n, ranks in self.al.members.items() if not set(ranks) & self.absent}
        keys = pd.DataFrame(
            {
                "pg_name": ops["pg_name"].astype(str).to_numpy(),
                "seq": ops["seq"].to_numpy("int64"),
            }
        )
        asked = keys[coll & keys["pg_name"].isin(whole).to_numpy()].drop_duplicates()
        if not len(asked):
            return lagging
        # the completed rows at those (group, seq): filter the big frame by seq first
        c = self.coll
        near = c[c["seq"].isin(asked["seq"].unique()) & c["completed"].eq(True).fillna(False)]
        near = pd.DataFrame(
            {"pg_name": near["pg_name"].astype(str).to_numpy(), "seq": near["seq"].to_numpy()}
        )
        done = near.merge(asked, on=["pg_name", "seq"]).drop_duplicates()
        if not len(done):
            return lagging
        # a left merge keeps the left rows' order: one flag per op, no per-row Python
        hit = keys.merge(done.assign(_done=True), how="left", on=["pg_name", "seq"])["_done"]
        return pd.Series(coll & hit.eq(True).to_numpy(dtype=bool), index=ops.index)

    def _member_state(self, m: int, pg_name: str, seq: int, time_ns: int | None = None) -> str:
        if m in self.absent:
            return "absent"
        st = self.status.get((m, pg_name))
        last = None if st is None else st[1]
        if last is None or pd.isna(last):
            if m not in self.wrapped:
                return "missing"
            # A wrapped record without this group: it still covers the op's time if its
            # oldest entry is older, and then the op is simply not in it.
            oldest = self.oldest_ns.get(m)
            if time_ns is not None and oldest is not None and oldest < time_ns:
                return "missing"
            return "unknown"
        return "issued" if int(last) >= seq else "missing"

    def build_graph(self) -> None:
        blocked = self._blocked_ops()
        coll_blocked = blocked[blocked["kind"] == "coll"]
        if len(coll_blocked):
            keys = coll_blocked[["pg_name", "seq"]].drop_duplicates()
            rows = self.coll.merge(keys, on=["pg_name", "seq"], how="inner")
            rows_by_point = dict(iter(rows.groupby(["pg_name", "seq"], sort=False, observed=True)))
            for (pg_name, seq), who in coll_blocked.groupby(
                ["pg_name", "seq"], sort=False, observed=True
            ):
                point = self._collective_point(
                    str(pg_name), int(seq), rows_by_point.get((pg_name, seq))
                )
                point.blockers = sorted(int(r) for r in who["rank"])
                for r in point.blockers:
                    self.blocked_at[r] = point.key
        p2p_blocked = blocked[blocked["kind"] == "p2p"]
        if len(p2p_blocked):
            # Only the pairs some rank is blocked on, split once.
            p2p = self.al.p2p
            mine = p2p.loc[p2p_blocked["seq"].to_numpy(), ["pg_name", "sender", "receiver"]]
            rows = p2p.merge(mine.drop_duplicates(), on=["pg_name", "sender", "receiver"])
            self._pair_rows = dict(
                iter(rows.groupby(["pg_name", "sender", "receiver", "direction"], observed=True))
            )
        for row in p2p_blocked.itertuples(index=False):
            point = self._p2p_point(int(row.seq))
            if point is None:
                continue
            point.blockers.append(int(row.rank))
            self.blocked_at[int(row.rank)] = point.key
        # Members that issued the op but are blocked in an older op of their own (ops run in
        # order: NCCL streams, a CPU that ran ahead) cannot join it yet: they are waited for.
        # So are members whose record does not reach back to the op (wrapped) but who are
        # known to be blocked in another op now.
        for point in self.points.values():
            if not point.blockers:
                continue
            pending: list[int] = list(point.unknown)
            if point.rows is not None:
                rows = point.rows
                pending += [int(m) for m in rows.loc[rows["completed"] == False, "rank"]]  # noqa: E712
            busy = {
                m
                for m in pending
                if m in self.blocked_known
                and self.blocked_at.get(m, point.key) != point.key
                and m not in point.minority
            }
            point.busy = sorted(busy)
            point.unknown = sorted(set(point.unknown) - busy)

    def _collective_point(self, pg_name: str, seq: int, rows: pd.DataFrame | None) -> Point:
        key = ("coll", pg_name, seq)
        point = Point(key=key, pg_name=pg_name, seq=seq, rows=rows)
        members = set(self.al.members.get(pg_name, ()))
        if rows is not None:
            members |= set(int(r) for r in rows["rank"])
        recorded = set() if rows is None else set(int(r) for r in rows["rank"])
        time_ns = int(rows["time_created_ns"].min()) if rows is not None and len(rows) else None
        for m in sorted(members):
            if m in recorded:
                continue
            state = self._member_state(m, pg_name, seq, time_ns)
            if state == "issued":
                point.issued.append(m)
            else:
                getattr(point, state).append(m)
        if rows is not None and len(rows):
            majority_sig, minority = self._majority(rows, pg_name, seq)
            point.minority = sorted(minority)
            point.issued = sorted(set(point.issued) | (recorded - set(minority)))
            major = rows[rows["sig"] == majority_sig]
            point.op = str(major["op"].iloc[0])
            point.time_ns = int(major["time_created_ns"].min())
            if minority:
                odd = rows[rows["rank"].isin(minority)]
                point.mismatch_attrs = [
                    col for col in SIGNATURE_COLUMNS if (odd[col] != major[col].iloc[0]).any()
                ]
        if point.absent and (point.missing or point.minority):
            # A present rank already explains the wait; whether the absent one got here is
            # unknown (its dump is missing), so it is not blamed for it.
            point.no_record = sorted(point.absent)
            point.absent = []
        self.points[key] = point
        return point

    def _majority(self, rows: pd.DataFrame, pg_name: str, seq: int) -> tuple[int, list[int]]:
        counts = rows["sig"].value_counts()
        top = counts[counts == counts.max()].index.tolist()
        if len(top) > 1:
            top = self._tie_break(top, pg_name, seq) or top[:1]
        majority = int(top[0])
        minority = [int(r) for r in rows.loc[rows["sig"] != majority, "rank"]]
        return majority, minority

    def _tie_break(self, sigs: list[int], pg_name: str, seq: int) -> list[int]:
        """Equal counts inside the group: ask the groups of the same kind at the same seq."""
        kind = self._group_kind(pg_name)
        same_kind = [g for g in self.al.members if g != pg_name and self._group_kind(g) == kind]
        if not same_kind:
            return []
        peers = self.coll[(self.coll["seq"] == seq) & self.coll["pg_name"].isin(same_kind)]
        counts = peers["sig"].value_counts()
        counts = counts[counts.index.isin(sigs)]
        if not len(counts) or (counts == counts.max()).sum() > 1:
            return []
        return [int(counts.idxmax())]

    def _group_kind(self, pg_name: str) -> str:
        pg = self.al.process_groups.get(pg_name)
        desc = pg.desc if pg else ""
        size = len(self.al.members.get(pg_name, ()))
        if desc and desc not in ("undefined", "default_pg"):
            return f"{desc}/{size}"
        return f"{desc or 'group'}/{size}"

    def _p2p_point(self, idx: int) -> Point | None:
        p2p = self.al.p2p
        row = p2p.loc[idx]
        sender, receiver = int(row["sender"]), int(row["receiver"])
        if sender < 0 or receiver < 0:
            return None
        k = int(row["pair_index"])
        key = ("p2p", str(row["pg_name"]), sender, receiver, k)
        if key in self.points:
            return self.points[key]
        point = Point(
            key=key,
            pg_name=str(row["pg_name"]),
            p2p_index=int(row["p2p_seq_id"]) or None,
            op=str(row["op"]),
            time_ns=int(row["time_created_ns"]),
        )
        other_dir = "recv" if row["direction"] == "send" else "send"
        pair = self._pair_rows.get((row["pg_name"], sender, receiver, other_dir))
        if pair is None:
            pair = p2p.iloc[0:0]
        me = int(row["rank"])
        peer = receiver if me == sender else sender
        peer_known = pair["completed"].notna().any() or self._has_info(peer)
        known = pd.notna(row["completed"]) and not bool(row["completed"])
        if known and peer_known:
            # Ops of one pair complete in order: my oldest incomplete op matches the peer's
            # oldest incomplete counterpart, whatever either ring buffer dropped.
            match = pair[pair["completed"] == False].sort_values("record_id").head(1)  # noqa: E712
            uncertain = False
        else:
            match = pair[pair["pair_index"] == k]
            uncertain = bool(row["uncertain"]) or peer in self.wrapped
        point.rows = pd.concat([p2p.loc[[idx]], match])
        point.issued.append(me)
        if peer in self.absent:
            point.absent.append(peer)
        elif not len(match):
            if uncertain:
                point.unknown.append(peer)
            else:
                point.missing.append(peer)
        else:
            other = match.iloc[0]
            attrs = [
                col
                for col in ("input_sizes", "input_dtypes")
                if other[col] and row[col] and other[col] != row[col]
            ]
            if attrs:
                point.mismatch_attrs = attrs
                point.minority = sorted({me, peer})
                point.issued = []
            else:
                point.issued.append(peer)
        self.points[key] = point
        return point

    def _has_info(self, rank: int) -> bool:
        """Whether this rank's record says which of its ops completed."""
        if self._ranks_with_info is None:
            known = self.coll.loc[self.coll["completed"].notna(), "rank"]
            self._ranks_with_info = set(int(r) for r in known.unique())
            if len(self.al.p2p):
                p = self.al.p2p
                self._ranks_with_info |= set(int(r) for r in p.loc[p["completed"].notna(), "rank"])
        return rank in self._ranks_with_info

    def _targets_of(self, rank: int) -> set[int]:
        key = self.blocked_at.get(rank)
        if key is None:
            return set()
        point = self.points[key]
        if rank in point.minority:
            return set()
        return point.targets - {rank}

    def from_graph(self) -> Verdict | None:
        self.build_graph()
        waiting = {r for r in self.blocked_at if self._targets_of(r)}
        targeted: set[int] = set()
        for r in waiting:
            targeted |= self._targets_of(r)
        roots = targeted - waiting
        # Which waiting ranks reach a root (fixpoint over the functional rank -> point map).
        reaches: dict[int, bool] = {r: False for r in waiting}
        changed = True
        while changed:
            changed = False
            for r in waiting:
                if reaches[r]:
                    continue
                if any(t in roots or reaches.get(t, False) for t in self._targets_of(r)):
                    reaches[r] = True
                    changed = True
        cyclic = {r for r, ok in reaches.items() if not ok}
        # A root that is itself known to be blocked in an op every member issued and nobody
        # completed is not elsewhere: that op is stuck, and its waiters are victims.
        stuck_roots = {
            r
            for r in roots
            if r in self.blocked_known
            and self._stuck_point(self.points[self.blocked_at[r]], trust_gloo=True)
        }
        if roots and stuck_roots == roots:
            stuck = {self.blocked_at[r]: self.points[self.blocked_at[r]] for r in roots}
            unlisted = [p for p in stuck.values() if self._members_unlisted(p.pg_name)]
            if self.absent and unlisted:
                verdict = self._absent_member_verdict(min(unlisted, key=lambda p: p.time_ns))
                verdict.waiting = sorted(set(verdict.waiting) | waiting)
                return verdict
            # Other ops wedged the same way (real states), even if nobody waits on them yet.
            for key, p in self.points.items():
                if key not in stuck and self._stuck_point(p):
                    stuck[key] = p
            return self._stuck_verdict(list(stuck.values()), waiting)
        roots -= stuck_roots
        waiting |= stuck_roots
        if roots:
            verdict = self._root_verdict(roots, waiting)
            if cyclic:
                verdict.evidence.append(
                    f"Also a wait cycle among ranks {format_ranks(sorted(cyclic))} "
                    "(a cross-group ordering problem)."
                )
            return verdict
        if cyclic:
            return self._order_verdict(cyclic, waiting)
        return None

    # ----- verdicts from the graph ------------------------------------------------------

    def _reasons(self, roots: set[int]) -> dict[int, tuple[str, Point]]:
        found: dict[int, tuple[str, Point]] = {}
        for point in self.points.values():
            if not point.minority and not any(self._targets_of(b) for b in point.blockers):
                continue
            for r in roots:
                if r in point.absent:
                    reason = "absent"
                elif r in point.minority:
                    reason = "mismatch"
                elif r in point.missing:
                    reason = "missing"
                else:
                    continue
                if r in self.present:
                    info = self.trace.ranks.get(r)
                    gone = info is not None and info.alive is False
                    if reason == "missing" and (gone or self._stale(r)):
                        reason = "dead"
                prev = found.get(r)
                if prev is None or self._point_rank(reason, point, roots) < self._point_rank(
                    prev[0], prev[1], roots
                ):
                    found[r] = (reason, point)
        return found

    @staticmethod
    def _point_rank(reason: str, point: Point, roots: set[int]) -> tuple:
        """Prefer the strongest reason, then points that wait only for guilty ranks (the
        direct victims), then the most blocked ranks."""
        return (_REASON_PRIORITY[reason], not point.targets <= roots, point.time_ns)

    def _stale(self, rank: int) -> bool:
        info = self.trace.ranks.get(rank)
        if info is None or info.dump_time_ns is None:
            return False
        others = [
            i.dump_time_ns
            for r, i in self.trace.ranks.items()
            if r != rank and i.dump_time_ns is not None
        ]
        if not others:
            return False
        return float(np.median(others)) - info.dump_time_ns > STALE_DUMP_NS

    def _root_verdict(self, roots: set[int], waiting: set[int]) -> Verdict:
        reasons = self._reasons(roots)
        kind_of = {"absent": "dead", "dead": "dead", "mismatch": "mismatch", "missing": "missing"}
        kinds = sorted({kind_of[r[0]] for r in reasons.values()}, key=_kind_rank)
        kind = kinds[0]
        # The point to show: the one with the most blocked ranks among those naming a guilty
        # rank of the chosen kind.
        points = [p for r, p in reasons.values() if kind_of[r] == kind]
        point = min(points, key=lambda p: (not p.targets <= roots, p.time_ns))
        guilty = []
        for r in sorted(roots):
            reason, p = reasons.get(r, ("missing", point))
            guilty.append(self._guilty(r, reason, p))
        waiting_list = sorted(waiting)
        verdict = Verdict(
            kind=kind,
            headline="",
            confidence=0.0,
            guilty=guilty,
            waiting=waiting_list,
        )
        self._fill_point(verdict, point)
        verdict.headline = self._headline_root(kind, guilty, point, waiting_list)
        conf = {"dead": 0.9, "mismatch": 0.9, "missing": 0.85}[kind]
        if kind == "dead" and all(reasons.get(g.rank, ("",))[0] == "absent" for g in guilty):
            conf = 0.9
        if len(kinds) > 1:
            conf -= 0.1
        if kind == "mismatch" and point.rows is not None:
            counts = point.rows["sig"].value_counts() if "sig" in point.rows else None
            if counts is not None and len(counts) > 1 and counts.iloc[0] == counts.iloc[1]:
                conf = 0.6
        verdict.confidence = conf
        for g in guilty:
            verdict.evidence.append(f"Rank {g.rank}: {g.reason}.")
        shown = sorted(
            self.points.values(), key=lambda p: (not p.targets <= roots, -len(p.blockers))
        )
        for p in shown[:5]:
            if not p.targets or not p.blockers:
                continue
            verdict.evidence.append(
                f"Ranks {format_ranks(p.blockers, 60)} blocked in {self._point_name(p)}, "
                f"waiting for {format_ranks(sorted(p.targets), 60)}."
            )
        return verdict

    def _identity(self, rank: int) -> GuiltyRank:
        info = self.trace.ranks.get(rank)
        g = GuiltyRank(rank=rank)
        if info is not None:
            ident = info.identity()
            g.host, g.pid, g.local_rank = ident["host"], ident["pid"], ident["local_rank"]
            g.device, g.device_id = ident["device"], ident["device_id"]
        return g

    def _guilty(self, rank: int, reason: str, point: Point) -> GuiltyRank:
        info = self.trace.ranks.get(rank)
        g = self._identity(rank)
        where = self._point_name(point)
        if reason == "absent":
            g.reason = (
                f"no usable dump; ranks {format_ranks(point.blockers)} wait for it in {where}"
            )
        elif reason == "dead":
            why = "its process is gone" if info and info.alive is False else "its record is stale"
            g.reason = f"{why}; it never issued {where}"
        elif reason == "mismatch":
            attrs = ", ".join(point.mismatch_attrs) or "signature"
            g.reason = f"issued a different {attrs} than its peers at {where}"
        else:
            g.reason = f"alive but never issued {where}, where its peers wait"
        g.call_site = self._call_site(rank, point if reason == "mismatch" else None)
        return g

    def _call_site(self, rank: int, point: Point | None) -> str | None:
        if point is not None and point.rows is not None and "call_site" in point.rows:
            mine = point.rows[point.rows["rank"] == rank]
            if len(mine) and isinstance(mine["call_site"].iloc[0], str):
                return mine["call_site"].iloc[0]
        info = self.trace.ranks.get(rank)
        if info is not None and info.stacks:
            site = main_thread_call_site(info.stacks)
            if site:
                return site
        mine = self.coll[self.coll["rank"] == rank]
        if len(self.al.p2p):
            mine = pd.concat([mine, self.al.p2p[self.al.p2p["rank"] == rank]])
        if not len(mine):
            return None
        last = mine.sort_values(["time_created_ns", "record_id"]).iloc[-1]
        site = last.get("call_site")
        return site if isinstance(site, str) else None

    def _point_name(self, point: Point) -> str:
        pg = self._pg(point.pg_name)
        label = f"group {pg.name}" + (f" ({pg.desc})" if pg.desc else "")
        if point.key[0] == "coll":
            return f"{point.op or 'collective'} #{point.seq} on {label}"
        _, _, sender, receiver, k = point.key
        return f"send/recv {sender}->{receiver} (#{k + 1} of the pair) on {label}"

    def _pg(self, pg_name: str) -> ProcessGroup:
        pg = self.al.process_groups.get(pg_name)
        members = self.al.members.get(pg_name, ())
        if pg is None:
            return ProcessGroup(pg_name, "", tuple(members), True)
        if not pg.ranks and members:
            return ProcessGroup(pg.name, pg.desc, tuple(members), True)
        return pg

    def _fill_point(self, verdict: Verdict, point: Point) -> None:
        verdict.process_group = self._pg(point.pg_name)
        verdict.op = point.op
        if point.key[0] == "coll":
            verdict.collective_seq_id = point.seq
        else:
            verdict.p2p_seq_id = point.p2p_index
        verdict.groups = self._rank_groups(point)

    def _rank_groups(self, point: Point) -> list[RankGroup]:
        groups: list[RankGroup] = []
        rows = point.rows
        if rows is not None and len(rows):
            done = rows["completed"].fillna(False).astype(bool)
            shown = rows["state"].astype(str).where(~done, "completed")
            keyed = rows[list(SIGNATURE_COLUMNS) + ["rank"]].astype({"rank": int})
            keyed = keyed.assign(_state=shown.to_numpy())
            for _, part in keyed.groupby(
                [*SIGNATURE_COLUMNS, "_state"], sort=False, dropna=False, observed=True
            ):
                first = part.iloc[0]
                state = str(first["_state"]) or None
                groups.append(
                    RankGroup(
                        ranks=sorted(int(r) for r in part["rank"]),
                        op=str(first["op"]),
                        input_sizes=str(first["input_sizes"]),
                        input_dtypes=str(first["input_dtypes"]),
                        output_sizes=str(first["output_sizes"]),
                        output_dtypes=str(first["output_dtypes"]),
                        state=state,
                    )
                )
            groups.sort(key=lambda g: -len(g.ranks))
        recorded = set() if rows is None else set(int(r) for r in rows["rank"])
        issued_unrecorded = sorted(set(point.issued) - recorded)
        for ranks, state in (
            (issued_unrecorded, "issued (entry not in record)"),
            (point.missing, "not issued"),
            (point.absent, "no record"),
            (point.no_record, "no record (not judged)"),
            (point.unknown, "unknown (record wrapped)"),
        ):
            if ranks:
                groups.append(RankGroup(ranks=sorted(ranks), state=state))
        return groups

    def _headline_root(
        self, kind: str, guilty: list[GuiltyRank], point: Point, waiting: list[int]
    ) -> str:
        who = ", ".join(_who(g) for g in guilty[:4]) + (" …" if len(guilty) > 4 else "")
        ranks = "Rank" if len(guilty) == 1 else "Ranks"
        where = self._point_name(point)
        n = len(waiting)
        if kind == "dead":
            return f"{ranks} {who} dead: {n} rank(s) wait for it in {where}"
        if kind == "mismatch":
            attrs = "/".join(point.mismatch_attrs) or "signature"
            return f"{ranks} {who} issued a different {attrs} at {where}"
        return f"{ranks} {who} never issued {where}; {n} rank(s) wait"

    def _order_verdict(self, cyclic: set[int], waiting: set[int]) -> Verdict:
        # The sink cycles: cyclic ranks whose targets are all cyclic form the deadlock core;
        # ranks upstream of it only wait.
        core = _sink_core(cyclic, self._targets_of)
        deviants = self._order_deviants(core)
        blamed = sorted(deviants) or sorted(core)
        points = {self.blocked_at[r] for r in core}
        shown = sorted((self.points[k] for k in points), key=lambda p: -len(p.blockers))
        guilty = []
        for r in blamed:
            p = self.points[self.blocked_at[r]]
            g = self._guilty(r, "missing", p)
            others = [self._point_name(q) for q in shown if q.key != p.key]
            g.reason = f"entered {self._point_name(p)} before " + (
                " / ".join(others[:2]) or "the op its peers wait in"
            )
            if deviants.get(r) == "skip":
                g.reason += "; its recent ops are its peers' order with one collective left out"
            elif deviants.get(r) == "order":
                g.reason += "; no peer issued its recent ops in this order"
            g.call_site = self._call_site(r, p)
            guilty.append(g)
        verdict = Verdict(
            kind="order",
            headline="",
            confidence=0.75 if deviants else 0.5,
            guilty=guilty,
            waiting=sorted(waiting - set(blamed)),
        )
        self._fill_point(verdict, self.points[self.blocked_at[blamed[0]]])
        verdict.headline = (
            f"Cross-group deadlock: {'rank' if len(blamed) == 1 else 'ranks'} "
            f"{format_ranks(blamed)} issued collectives in a different order than "
            f"{'its' if len(blamed) == 1 else 'their'} peers"
        )
        verdict.evidence.append(f"Ranks {format_ranks(sorted(core))} wait for each other.")
        for p in shown[:6]:
            verdict.evidence.append(
                f"Ranks {format_ranks(p.blockers, 60)} blocked in {self._point_name(p)}, "
                f"waiting for {format_ranks(sorted(p.targets), 60)}."
            )
        if not deviants:
            verdict.evidence.append(
                "No rank's order differs from its peers' history; blaming the whole cycle."
            )
        return verdict

    def _order_deviants(self, core: set[int]) -> dict[int, str]:
        """Cycle ranks whose recent order of ops no peer ever produced.

        Tokens are (group kind, op), run-length encoded (four DP bucket all_reduces in a row
        are one run of 4). At every position of every rank's recent history (the last
        ``_HISTORY`` ops) the last ``_CONTEXT`` runs up to that op form a gram. A cycle rank is
        deviant when its gram at the blocked op is new for it (not a habit from earlier
        steps) and at most ``_RARE_SHARE`` of the other ranks that issued that token ever
        produced it. A gram that differs from a peer's only by one run being one
        shorter reads as a skipped collective; anything else as a reordering.
        """
        if not len(self.coll):
            return {}
        kinds = {g: self._group_kind(g) for g in self.al.members}
        c = self.coll.sort_values(["rank", "time_created_ns", "record_id"])
        c = c.groupby("rank", sort=False, observed=True).tail(_HISTORY)
        token = (c["pg_name"].map(kinds).astype(str) + "|" + c["op"].astype(str)).to_numpy()
        ranks = c["rank"].to_numpy()
        pgs = c["pg_name"].to_numpy()
        seqs = c["seq"].to_numpy()
        grams: dict[tuple, set[int]] = {}
        habit: dict[tuple, int] = {}
        with_token: dict[str, set[int]] = {}
        mine: dict[tuple, tuple] = {}
        wanted = {
            (r, self.points[self.blocked_at[r]].pg_name, self.points[self.blocked_at[r]].seq)
            for r in core
            if self.points[self.blocked_at[r]].key[0] == "coll"
        }
        bounds = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1], True])
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            r = int(ranks[a])
            runs: list[tuple[str, int]] = [("<start>", 1)] * _CONTEXT
            for i in range(a, b):
                tok = token[i]
                if runs[-1][0] == tok:
                    runs[-1] = (tok, runs[-1][1] + 1)
                else:
                    runs.append((tok, 1))
                gram = tuple(runs[-_CONTEXT:])
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
            if others and seen > _RARE_SHARE * others:
                continue
            skip = any(
                len(other) == len(gram)
                and [t for t, _ in other] == [t for t, _ in gram]
                and sum(abs(x - y) for (_, x), (_, y) in zip(other, gram, strict=True)) == 1
                and grams[other] - {r}
                for other in grams
                if other[-1][0] == tok
            )
            deviants[r] = "skip" if skip else "order"
        if len(deviants) == len(core):
            return {}
        return deviants

    # ----- no hang --------------------------------------------------------------------

    def _stuck_point(self, point: Point, trust_gloo: bool = False) -> bool:
        """Every member issued it with one signature and nobody completed it."""
        if point.key[0] != "coll" or point.targets or point.unknown:
            return False
        rows = point.rows
        if rows is None or not len(rows) or not point.blockers:
            return False
        if rows["completed"].fillna(False).astype(bool).any():
            return False
        if rows["completed"].isna().all():
            return False
        # Gloo marks completion from a callback that may lag the op's return, so "issued
        # everywhere, completed nowhere" alone is only trusted with real states.
        return trust_gloo or bool(rows["informative"].all())

    def stuck(self) -> Verdict | None:
        if not self.has_completion_info:
            return None
        stuck_points = [p for p in self.points.values() if self._stuck_point(p)]
        if not stuck_points:
            return None
        if self.absent:
            unlisted = [p for p in stuck_points if self._members_unlisted(p.pg_name)]
            if unlisted:
                return self._absent_member_verdict(min(unlisted, key=lambda p: p.time_ns))
        return self._stuck_verdict(stuck_points, set())

    def _members_unlisted(self, pg_name: str) -> bool:
        """No file lists this group's members (Gloo): they were inferred from who recorded
        on it, so a rank that left no record can be a member nobody saw."""
        pg = self.trace.process_groups.get(pg_name)
        return pg is None or pg.inferred

    def _absent_member_verdict(self, point: Point) -> Verdict:
        """An op "every member" issued and none completed, on a group whose membership was
        inferred, while some ranks left no record: the likelier story is a dead member
        (its partner waits for it, e.g. a tensor-parallel pair) than a stuck op."""
        absent = sorted(self.absent)
        where = self._point_name(point)
        guilty = []
        for r in absent:
            g = self._identity(r)
            g.reason = (
                f"no usable dump; ranks {format_ranks(point.blockers)} wait in {where}, whose "
                "members the dumps do not list"
            )
            guilty.append(g)
        verdict = Verdict(
            kind="dead",
            headline="",
            confidence=0.6,
            guilty=guilty,
            waiting=sorted(point.blockers),
        )
        self._fill_point(verdict, point)
        verdict.headline = (
            f"No dump from rank(s) {format_ranks(absent)}; rank(s) "
            f"{format_ranks(point.blockers)} wait in {where}, a group whose members the "
            "dumps do not list: the missing rank(s) are its likely absent member(s)"
        )
        verdict.evidence = [
            f"Ranks {format_ranks(point.blockers)} issued {where} and it never completed; "
            f"the group's membership ({format_ranks(sorted(point.issued))}) is inferred from "
            "the files present.",
            "Run with --world-size or a frtools dump manifest, or record group membership "
            "(frtools recorder, NCCL dumps), to name the member for certain.",
        ]
        return verdict

    def _stuck_verdict(self, stuck_points: list[Point], waiting: set[int]) -> Verdict:
        """Blame, per stuck op, the members that never started it while others did (a wedged
        GPU); with no such rank anywhere, every member of the earliest stuck op."""
        blamed_at: dict[int, Point] = {}
        for p in sorted(stuck_points, key=lambda p: p.time_ns):
            rows = p.rows
            assert rows is not None
            started = set(int(r) for r in rows.loc[rows["state"] == "started", "rank"])
            members = set(p.issued)
            laggards = members - started if started else set()
            if laggards and laggards != members:
                for r in laggards:
                    blamed_at.setdefault(r, p)
        point = min(stuck_points, key=lambda p: p.time_ns)
        if blamed_at:
            point = min(blamed_at.values(), key=lambda p: p.time_ns)
        members = sorted(set(point.issued))
        never_started = bool(blamed_at)
        if not blamed_at:
            blamed_at = {r: point for r in members}
        guilty = []
        for r in sorted(blamed_at):
            p = blamed_at[r]
            g = self._guilty(r, "missing", p)
            g.reason = (
                f"issued {self._point_name(p)} but never started it while its peers did"
                if never_started
                else f"issued {self._point_name(p)}; it never completed on any member"
            )
            g.call_site = self._call_site(r, p)
            guilty.append(g)
        blamed = sorted(blamed_at)
        involved = set(members)
        for p in stuck_points:
            involved |= set(p.issued)
        verdict = Verdict(
            kind="stuck",
            headline="",
            confidence=0.7 if never_started else 0.6,
            guilty=guilty,
            waiting=sorted((involved | waiting) - set(blamed)),
        )
        if point.rows is not None and not point.rows["informative"].all():
            verdict.confidence = 0.5
        self._fill_point(verdict, point)
        verdict.headline = (
            f"Stuck: every member issued {self._point_name(point)}, none completed it"
            + (f"; rank(s) {format_ranks(blamed)} never started it" if never_started else "")
        )
        verdict.evidence.append(
            f"{len(stuck_points)} op(s) issued by every member with one signature and "
            "completed by none."
        )
        return verdict

    def silent_mismatch(self) -> Verdict | None:
        """Collectives that did not hang but whose members disagreed."""
        c = self.coll
        if not len(c):
            return None
        n = c.groupby(["pg_name", "seq"], sort=False, observed=True)["sig"].nunique()
        bad = n[n > 1]
        if not len(bad):
            return None
        first = c.set_index(["pg_name", "seq"]).loc[bad.index]
        t = first.groupby(level=[0, 1], observed=True)["time_created_ns"].min().sort_values()
        pg_name, seq = t.index[0]
        rows = c[(c["pg_name"] == pg_name) & (c["seq"] == seq)]
        point = self._collective_point(str(pg_name), int(seq), rows)
        guilty = [self._guilty(r, "mismatch", point) for r in point.minority]
        verdict = Verdict(
            kind="mismatch",
            headline="",
            confidence=0.7,
            guilty=guilty,
            waiting=[],
        )
        self._fill_point(verdict, point)
        attrs = "/".join(point.mismatch_attrs) or "signature"
        verdict.headline = (
            f"Rank(s) {', '.join(_who(g) for g in guilty)} issued a different {attrs} at "
            f"{self._point_name(point)} (no hang recorded)"
        )
        verdict.evidence.append(f"{len(bad)} collective(s) where members disagree.")
        return verdict

    def straggler(self) -> Verdict | None:
        c = self.coll
        if not len(c):
            return None
        sizes = {g: len(m) for g, m in self.al.members.items()}
        c = c[c["pg_name"].map(sizes).fillna(0) >= 2]
        if not len(c):
            return None
        grp = c.groupby(["pg_name", "seq"], sort=False, observed=True)
        counts = grp["rank"].transform("size")
        full = counts == c["pg_name"].map(sizes)
        c = c[full]
        if not len(c):
            return None
        c = c[["pg_name", "seq", "rank", "time_created_ns"]].reset_index(drop=True)
        # Pass 1 with every member as a reference; pass 2 measures each rank against the
        # members that are not straggler candidates (two stragglers in one pair or group
        # would otherwise hide each other).
        candidates = set(self._stragglers(c, set())) or set(self._stragglers(c, set(), loose=True))
        found = self._stragglers(c, candidates) if candidates else {}
        found_list = [(r, *found[r]) for r in sorted(found)]
        if not found_list:
            return None
        found = found_list
        guilty = []
        for r, sh, lt, cnt in found:
            g = self._identity(r)
            g.call_site = self._call_site(r, None)
            g.reason = (
                f"late into {sh:.0%} of its {cnt} collectives, median {lt / 1e6:.1f} ms "
                "behind its peers"
            )
            guilty.append(g)
        verdict = Verdict(
            kind="straggler",
            headline=(
                f"Straggler: {', '.join(_who(g) for g in guilty)} enters collectives last "
                f"(median {found[0][2] / 1e6:.1f} ms late); no hang"
            ),
            confidence=0.75,
            guilty=guilty,
        )
        verdict.evidence.append(
            f"Rule: at least T late in >= {STRAGGLER_LAST_SHARE:.0%} of >= "
            f"{STRAGGLER_MIN_COLLECTIVES} matched collectives and median lateness >= T, "
            f"T = max({STRAGGLER_MIN_LATE_NS / 1e6:.0f} ms, {STRAGGLER_SPREAD_FACTOR:g} x the "
            "typical jitter)."
        )
        return verdict

    @staticmethod
    def _stragglers(
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
        threshold = max(STRAGGLER_MIN_LATE_NS, STRAGGLER_SPREAD_FACTOR * jitter)
        per = pd.DataFrame({"rank": ranks, "late": late, "flag": late >= threshold}).groupby("rank")
        share, n, med = per["flag"].mean(), per["flag"].size(), per["late"].median()
        if loose:
            # Candidates: clearly late in some collectives (a group made only of stragglers
            # shows them on time, so the share and the median are not asked for yet).
            q90 = per["late"].quantile(0.9)
            hit = (share >= 0.15) & (n >= STRAGGLER_MIN_COLLECTIVES) & (q90 >= threshold)
        else:
            hit = (
                (share >= STRAGGLER_LAST_SHARE)
                & (n >= STRAGGLER_MIN_COLLECTIVES)
                & (med >= threshold)
            )
        return {int(r): (float(share[r]), float(med[r]), int(n[r])) for r in share.index[hit]}

    def unexplained_absence(self) -> Verdict | None:
        """No hang in the records, but expected ranks left no dump: they may have died
        (a Gloo peer's failed op is recorded as completed). Low confidence."""
        if not self.absent:
            return None
        absent = sorted(self.absent)
        guilty = []
        for r in absent:
            g = self._identity(r)
            g.reason = "no usable dump, while the others show no hang; it may have died"
            guilty.append(g)
        return Verdict(
            kind="dead",
            headline=(
                f"No dump from rank(s) {format_ranks(absent)}; the other "
                f"{len(self.present)} rank(s) show no hang: the missing rank(s) may have died"
            ),
            confidence=0.5,
            guilty=guilty,
            evidence=[
                "Nobody is recorded waiting for the missing rank(s); the verdict rests on the "
                "missing dump alone."
            ],
        )

    def healthy(self) -> Verdict:
        n = len(self.present)
        if self.has_completion_info:
            headline = f"Healthy: {n} rank(s) consistent, no op left incomplete"
            conf = 0.9
        else:
            headline = f"Healthy: {n} rank(s) reached the same collectives (no completion info)"
            conf = 0.6
        verdict = Verdict(kind="healthy", headline=headline, confidence=conf)
        if self.points:
            incomplete = [p for p in self.points.values() if p.blockers]
            if incomplete:
                verdict.evidence.append(
                    f"{len(incomplete)} in-flight op(s) that every member issued."
                )
        return verdict

    # ----- common ---------------------------------------------------------------------

    def finish(self, verdict: Verdict) -> None:
        trace = self.trace
        verdict.ranks_expected = len(self.expected)
        verdict.ranks_found = len(self.present)
        verdict.ranks_missing = sorted(self.absent)
        verdict.inputs = list(trace.inputs)
        blamed = set(verdict.guilty_ranks)
        unexplained = sorted(self.absent - blamed)
        if unexplained:
            verdict.evidence.append(
                f"No usable record for rank(s) {format_ranks(unexplained, 60)}; nobody waits "
                "for them in the recorded ops."
            )
            verdict.confidence -= 0.1
        bad = [i for i in trace.inputs if i.status == "error"]
        if bad:
            verdict.evidence.append(f"{len(bad)} input file(s) could not be used.")
        if self.wrapped:
            verdict.evidence.append(
                f"Ring buffer wrapped on rank(s) {format_ranks(sorted(self.wrapped), 60)}: "
                "older ops were dropped; ops before their oldest entry are not judged."
            )
        verdict.confidence = float(min(1.0, max(0.05, verdict.confidence)))


def _ranks_where(frame: pd.DataFrame, mask: pd.Series) -> set[int]:
    return set(np.unique(frame["rank"].to_numpy()[mask.to_numpy(dtype=bool)]).tolist())


def _kind_rank(kind: str) -> int:
    return {"dead": 0, "mismatch": 1, "missing": 2}.get(kind, 3)


def _who(g: GuiltyRank) -> str:
    parts = [str(g.rank)]
    extra = [x for x in (g.host, g.device) if x]
    if extra:
        parts.append(f"({', '.join(extra)})")
    return " ".join(parts)


def _sink_core(nodes: set[int], targets_of) -> set[int]:
    """Ranks of the sink strongly connected components of the wait-for subgraph on ``nodes``."""
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
