"""Findings in words: the Verdict's headline, the guilty ranks' reasons, the evidence lines
and what would decide an inconclusive verdict. No decision is taken here: the Finding comes
with its final confidence and every choice made (rules.py, confidence.py); each Reason and
each NoteKind has its text in one table (REASON_TEXT, NOTE_TEXT)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pandas as pd

from frtools.analyze.align import SIGNATURE_COLUMNS
from frtools.analyze.stacks import main_thread_call_site
from frtools.analyze.verdict import GuiltyRank, RankGroup, Verdict
from frtools.model.ranks import format_ranks

from .facts import Ending, JobFacts
from .model import (
    Blame,
    Decide,
    Finding,
    MemberState,
    Note,
    NoteKind,
    Point,
    Reason,
    VerdictKind,
)
from .order import REORDER, SKIP
from .straggler import LAST_SHARE, MIN_COLLECTIVES, MIN_LATE_NS, SPREAD_FACTOR

DECIDE_TEXT = {
    Decide.WORLD_SIZE: "the job's world size (--world-size N): a Gloo dump states neither it "
    "nor who belongs to a group",
    Decide.MISSING_DUMPS: "the records of the ranks that left none (PyTorch's Flight Recorder "
    "writes none for a rank killed, exited or holding the GIL; frtools' black box survives "
    "them: frtools run + frtools dump)",
    Decide.MEMBERSHIP: "recorded group membership (frtools recorder, NCCL dumps): Gloo dumps "
    "list no members",
    Decide.LATER_DUMP: "a dump taken a moment later: Gloo marks an op completed just after "
    "wait() returns, and also when it failed",
    Decide.P2P_RECORDS: "records of send/recv (frtools recorder): PyTorch's Flight Recorder "
    "on Gloo records none",
    Decide.LARGER_BUFFER: "a larger ring buffer (TORCH_FR_BUFFER_SIZE, FRTOOLS_BUFFER_SIZE): "
    "the records do not reach back to the op",
    Decide.ANY_RECORD: "dumps with recorded ops (is the recorder on? TORCH_FR_BUFFER_SIZE > 0, "
    "or frtools run)",
}


def verdict_of(finding: Finding, facts: JobFacts) -> Verdict:
    """The Verdict a user reads for this finding."""
    w = _Wording(facts)
    guilty = [w.guilty(b, finding) for b in finding.blames]
    verdict = Verdict(
        kind=finding.kind.value,
        headline="",
        confidence=finding.confidence,
        guilty=guilty,
        waiting=sorted(finding.waiting),
        decide=[DECIDE_TEXT[d] for d in finding.decide],
    )
    if finding.point is not None:
        w.fill_point(verdict, finding.point)
    verdict.headline = w.headline(finding, guilty)
    verdict.evidence = w.evidence(finding, guilty)
    w.finish(verdict, finding)
    return verdict


class _Wording:
    def __init__(self, facts: JobFacts) -> None:
        self.f = facts

    # ----- names -----------------------------------------------------------------------

    def point_name(self, point: Point) -> str:
        pg = self.f.process_group(point.pg_name)
        label = f"group {pg.name}" + (f" ({pg.desc})" if pg.desc else "")
        if point.is_collective:
            return f"{point.op or 'collective'} #{point.seq} on {label}"
        k = point.key
        return f"send/recv {k.sender}->{k.receiver} (#{k.index + 1} of the pair) on {label}"

    def identity(self, rank: int) -> GuiltyRank:
        info = self.f.trace.ranks.get(rank)
        g = GuiltyRank(rank=rank)
        if info is not None:
            ident = info.identity()
            g.host, g.pid, g.local_rank = ident["host"], ident["pid"], ident["local_rank"]
            g.device, g.device_id = ident["device"], ident["device_id"]
        return g

    def call_site(self, rank: int, point: Point | None) -> str | None:
        if point is not None and point.rows is not None and "call_site" in point.rows:
            mine = point.rows[point.rows["rank"] == rank]
            if len(mine) and isinstance(mine["call_site"].iloc[0], str):
                return mine["call_site"].iloc[0]
        info = self.f.trace.ranks.get(rank)
        if info is not None and info.stacks:
            site = main_thread_call_site(info.stacks)
            if site:
                return site
        coll, p2p = self.f.al.collectives, self.f.al.p2p
        mine = coll[coll["rank"] == rank]
        if len(p2p):
            mine = pd.concat([mine, p2p[p2p["rank"] == rank]])
        if not len(mine):
            return None
        last = mine.sort_values(["time_created_ns", "record_id"]).iloc[-1]
        site = last.get("call_site")
        return site if isinstance(site, str) else None

    # ----- guilty ranks ----------------------------------------------------------------

    def guilty(self, b: Blame, finding: Finding) -> GuiltyRank:
        g = self.identity(b.rank)
        g.reason = self.reason(b)
        site_point = b.point if b.reason in _OWN_ENTRY_REASONS else None
        g.call_site = self.call_site(b.rank, site_point)
        return g

    def reason(self, b: Blame) -> str:
        """Why this rank is blamed, in words (REASON_TEXT)."""
        where = self.point_name(b.point) if b.point is not None else ""
        return _render(REASON_TEXT[b.reason], self, b, where, _Fields(where, b.point))

    @staticmethod
    def ended(ending: Ending | None, stale: bool) -> str:
        if ending is None or ending.kind in (None, "gone"):
            return "its record is stale" if stale and ending is None else "its process is gone"
        detail = f": {_error_summary(ending.detail)}" if ending.detail else ""
        return {
            "clean": "its process exited cleanly",
            "exit": f"its process exited{detail or ' with an error status'}",
            "exception": f"its process died of an uncaught exception{detail}",
            "os_exit": f"its process called os._exit{detail}",
            "signal": f"its process was killed by a signal{detail}",
            "killed": "its process was killed without a word (SIGKILL, the OOM killer, a lost "
            "node)" + detail,
        }.get(ending.kind, f"its process ended ({ending.kind}{detail})")

    # ----- headline --------------------------------------------------------------------

    def headline(self, finding: Finding, guilty: list[GuiltyRank]) -> str:
        kind, point = finding.kind, finding.point
        where = self.point_name(point) if point is not None else ""
        reasons = {b.reason for b in finding.blames}
        if kind is VerdictKind.HEALTHY:
            n = len(self.f.present)
            if finding.completion_info:
                return f"Healthy: {n} rank(s) consistent, no op left incomplete"
            return f"Healthy: {n} rank(s) reached the same collectives (no completion info)"
        if kind is VerdictKind.STRAGGLER:
            late = finding.blames[0].lateness
            median = late[1] / 1e6 if late else 0.0
            return (
                f"Straggler: {', '.join(_who(g) for g in guilty)} enters collectives last "
                f"(median {median:.1f} ms late); no hang"
            )
        if kind is VerdictKind.ORDER:
            blamed = [g.rank for g in guilty]
            one = len(blamed) == 1
            return (
                f"Cross-group deadlock: {'rank' if one else 'ranks'} {format_ranks(blamed)} "
                f"issued collectives in a different order than {'its' if one else 'their'} peers"
            )
        if kind is VerdictKind.STUCK and Reason.DEVICE_STOPPED in reasons:
            stopped = [b.rank for b in finding.blames if b.reason is Reason.DEVICE_STOPPED]
            absent = [b.rank for b in finding.blames if b.reason is not Reason.DEVICE_STOPPED]
            return (
                f"GPU stopped on rank(s) {format_ranks(stopped)}: ops their peers completed "
                f"never completed there, from {where}"
                + (
                    f"; rank(s) {format_ranks(absent)} left no record and peers wait for them"
                    if absent
                    else ""
                )
                + f"; {len(finding.waiting)} rank(s) wait"
            )
        if kind is VerdictKind.STUCK:
            never = Reason.NEVER_STARTED in reasons
            blamed = format_ranks([g.rank for g in guilty])
            if never and len({b.point.key for b in finding.blames if b.point}) > 1:
                # each never started the op on a group of its own (tensor-parallel pairs)
                return (
                    f"Stuck: from {where} on, ops every member issued never completed; "
                    f"rank(s) {blamed} never started theirs"
                )
            return f"Stuck: every member issued {where}, none completed it" + (
                f"; rank(s) {blamed} never started it" if never else ""
            )
        if kind is VerdictKind.INCONCLUSIVE:
            return self.inconclusive_headline(finding)
        if Reason.SPLITS in reasons:
            return self.splits_headline(finding, where)
        if Reason.NEVER_ARRIVED in reasons:
            return (
                f"Rank(s) {', '.join(_who(g) for g in guilty[:4])} never called "
                f"init_process_group; {len(finding.waiting)} rank(s) wait in it"
            )
        if Reason.UNLISTED_MEMBER in reasons and point is not None:
            return (
                f"No dump from rank(s) {format_ranks(sorted(self.f.absent))}; rank(s) "
                f"{format_ranks(list(point.blockers))} wait in {where}, a group whose members "
                "the dumps do not list: the missing rank(s) are its likely absent member(s)"
            )
        if Reason.NO_DUMP in reasons:
            return (
                f"No dump from rank(s) {format_ranks(sorted(self.f.absent))}; the other "
                f"{len(self.f.present)} rank(s) show no hang: the missing rank(s) may have died"
            )
        if Reason.ENDED in reasons:
            who = ", ".join(_who(g) for g in guilty[:4])
            return f"Rank(s) {who} died ({guilty[0].reason.split(';')[0]})" + (
                f"; {len(finding.waiting)} rank(s) failed after it" if finding.waiting else ""
            )
        if Reason.DISAGREES in reasons and point is not None:
            attrs = "/".join(point.mismatch_attrs) or "signature"
            return (
                f"Rank(s) {', '.join(_who(g) for g in guilty)} issued a different {attrs} at "
                f"{where} (no hang recorded)"
            )
        stalled = [b for b in finding.blames if b.reason is Reason.NEVER_STARTED]
        if stalled and len(stalled) < len(guilty):
            # a second cause beside the roots: said after their headline
            odd = {b.rank for b in stalled}
            rest = replace(finding, blames=tuple(b for b in finding.blames if b.rank not in odd))
            first = self.headline(rest, [g for g in guilty if g.rank not in odd])
            at = self.point_name(stalled[0].point) if stalled[0].point is not None else "its op"
            return (
                f"{first}; rank(s) {format_ranks(sorted(odd))} never started {at}, which "
                "peers' GPUs run"
            )
        who = ", ".join(_who(g) for g in guilty[:4]) + (" …" if len(guilty) > 4 else "")
        ranks = "Rank" if len(guilty) == 1 else "Ranks"
        n = len(finding.waiting)
        alive = [b for b in finding.blames if b.reason is Reason.MISSING]
        if kind is VerdictKind.DEAD and alive and len(alive) < len(finding.blames):
            return self.mixed_dead_headline(finding, guilty, alive)
        if kind is VerdictKind.DEAD:
            return f"{ranks} {who} dead: {n} rank(s) wait for it in {where}"
        if kind is VerdictKind.MISMATCH and point is not None:
            attrs = "/".join(point.mismatch_attrs) or "signature"
            return f"{ranks} {who} issued a different {attrs} at {where}"
        return f"{ranks} {who} never issued {where}; {n} rank(s) wait"

    def mixed_dead_headline(
        self, finding: Finding, guilty: list[GuiltyRank], alive: list[Blame]
    ) -> str:
        """Ranks without a record (or gone) and ranks alive that never issued the op their
        peers wait in: both named for what they are, not all called dead."""
        live = {b.rank for b in alive}
        dead = [_who(g) for g in guilty if g.rank not in live][:4]
        never = [_who(g) for g in guilty if g.rank in live][:4]
        missed = self.point_name(alive[0].point) if alive[0].point is not None else "its op"
        return (
            f"Rank(s) {', '.join(dead)} dead or without a record, and rank(s) "
            f"{', '.join(never)} alive but never issued {missed}; "
            f"{len(finding.waiting)} rank(s) wait"
        )

    def inconclusive_headline(self, finding: Finding) -> str:
        kinds = {n.kind for n in finding.notes}
        point = finding.point
        where = self.point_name(point) if point is not None else ""
        if NoteKind.NO_OPS in kinds:
            return "Inconclusive: no rank recorded any collective or send/recv"
        if point is not None:
            blocked = format_ranks(list(point.blockers))
            if point.completed:
                why = (
                    f"ranks {format_ranks(list(point.completed))} left it (completed or failed: "
                    "Gloo records both)"
                )
            elif point.of(MemberState.UNKNOWN):
                why = (
                    f"the records of ranks {format_ranks(list(point.of(MemberState.UNKNOWN)))} "
                    "do not reach back to it"
                )
            else:
                why = "every rank with a record issued it, none completed it"
            return (
                f"Inconclusive: ranks {blocked} blocked in {where}; {why}; no record names "
                "the member they wait for"
            )
        if NoteKind.UNRECORDED_OP in kinds:
            note = next(n for n in finding.notes if n.kind is NoteKind.UNRECORDED_OP)
            return (
                f"Inconclusive: ranks {format_ranks(list(note.ranks))} are blocked in an op "
                "their dumps count but do not record (send/recv on Gloo)"
            )
        if NoteKind.UNSEEN_MEMBERS in kinds:
            groups = sorted({g for n in finding.notes for g in n.groups})
            return (
                f"Inconclusive: group(s) {', '.join(groups)} have fewer members than their "
                "siblings; the missing member(s) left no record and cannot be named"
            )
        return "Inconclusive: the records cannot say which rank is at fault"

    def splits_headline(self, finding: Finding, where: str) -> str:
        pairs = [n for n in finding.notes if n.kind is NoteKind.SPLIT_PAIR]
        guilty = [b.rank for b in finding.blames]
        if len(pairs) == 1 and len(guilty) == 2:
            who = f"Ranks {guilty[0]} and {guilty[1]} disagree"
        else:
            who = f"Rank(s) {format_ranks(guilty)} disagree with their peers"
        first = pairs[0]
        (i, j), (sent, expected) = first.ranks, first.values
        more = f"; {len(pairs) - 1} more pair(s)" if len(pairs) > 1 else ""
        return (
            f"{who} in {where}: rank {i} sends {sent} elements to rank {j}, rank {j} expects "
            f"{expected}{more}"
        )

    # ----- evidence --------------------------------------------------------------------

    def evidence(self, finding: Finding, guilty: list[GuiltyRank]) -> list[str]:
        lines: list[str] = []
        if finding.kind in (VerdictKind.DEAD, VerdictKind.MISMATCH, VerdictKind.MISSING) and not (
            {b.reason for b in finding.blames}
            & {Reason.UNLISTED_MEMBER, Reason.NO_DUMP, Reason.DISAGREES}
        ):
            lines += [f"Rank {g.rank}: {g.reason}." for g in guilty]
        for note in finding.notes:
            line = self.note(note)
            if line:
                lines.append(line)
        return lines

    def note(self, n: Note) -> str:
        """One evidence line (NOTE_TEXT); none for a note without the point its text names."""
        if n.point is None and n.kind in _NEEDS_POINT:
            return ""
        where = self.point_name(n.point) if n.point is not None else ""
        return _render(NOTE_TEXT[n.kind], self, n, where, _Fields(where, n.point, n))

    def group_label(self, pg_name: str) -> str:
        pg = self.f.process_group(pg_name)
        return f"{pg.name} ({pg.desc})" if pg.desc else pg.name

    # ----- where -----------------------------------------------------------------------

    def fill_point(self, verdict: Verdict, point: Point) -> None:
        verdict.process_group = self.f.process_group(point.pg_name)
        verdict.op = point.op
        if point.is_collective:
            verdict.collective_seq_id = point.seq
        else:
            verdict.p2p_seq_id = point.p2p_index
        verdict.groups = self.rank_groups(point)

    def rank_groups(self, point: Point) -> list[RankGroup]:
        groups: list[RankGroup] = []
        rows = point.rows
        if rows is not None and len(rows):
            done = rows["_done"] if "_done" in rows else rows["completed"]
            done = done.fillna(False).astype(bool)
            shown = rows["state"].astype(str).where(~done, "completed")
            if point.failed:
                shown = shown.where(~rows["rank"].isin(point.failed), "failed")
            keyed = rows[list(SIGNATURE_COLUMNS) + ["rank"]].astype({"rank": int})
            keyed = keyed.assign(_state=shown.to_numpy())
            for _, part in keyed.groupby(
                [*SIGNATURE_COLUMNS, "_state"], sort=False, dropna=False, observed=True
            ):
                first = part.iloc[0]
                groups.append(
                    RankGroup(
                        ranks=sorted(int(r) for r in part["rank"]),
                        op=str(first["op"]),
                        input_sizes=str(first["input_sizes"]),
                        input_dtypes=str(first["input_dtypes"]),
                        output_sizes=str(first["output_sizes"]),
                        output_dtypes=str(first["output_dtypes"]),
                        state=str(first["_state"]) or None,
                    )
                )
            groups.sort(key=lambda g: -len(g.ranks))
        recorded = set() if rows is None else set(int(r) for r in rows["rank"])
        issued_unrecorded = sorted(set(point.issued) - recorded)
        for ranks, state in (
            (issued_unrecorded, "issued (entry not in record)"),
            (list(point.of(MemberState.MISSING)), "not issued"),
            (list(point.of(MemberState.ABSENT)), "no record"),
            (list(point.of(MemberState.NO_RECORD)), "no record (not judged)"),
            (list(point.of(MemberState.UNKNOWN)), "unknown (record wrapped)"),
        ):
            if ranks:
                groups.append(RankGroup(ranks=sorted(ranks), state=state))
        return groups

    # ----- common ----------------------------------------------------------------------

    def finish(self, verdict: Verdict, finding: Finding) -> None:
        f = self.f
        verdict.ranks_expected = len(f.expected)
        verdict.ranks_found = len(f.present)
        verdict.ranks_missing = sorted(f.absent)
        verdict.inputs = list(f.trace.inputs)
        if finding.unexplained:
            verdict.evidence.append(
                f"No usable record for rank(s) {format_ranks(list(finding.unexplained), 60)}; "
                "nobody waits for them in the recorded ops."
            )
        bad = [i for i in f.trace.inputs if i.status == "error"]
        if bad:
            verdict.evidence.append(f"{len(bad)} input file(s) could not be used.")
        if f.wrapped:
            verdict.evidence.append(
                f"Ring buffer wrapped on rank(s) {format_ranks(sorted(f.wrapped), 60)}: "
                "older ops were dropped; ops before their oldest entry are not judged."
            )


# ----- the texts: one table per Reason and per NoteKind -------------------------------------
#
# An entry is a template or, where the text needs more than the fields below, a function of
# (wording, blame or note, the name of its point). Template fields, computed when named:
# where, ranks, others, count, groups, blockers, pg_name.


class _Fields(dict):
    """What a text template names, of one blame or note: computed only when named (a
    group's blockers may be 131,072 ranks)."""

    def __init__(self, where: str, point: Point | None, note: Note | None = None) -> None:
        super().__init__(where=where)
        self.point, self.n = point, note

    def __missing__(self, key: str) -> object:
        p, n = self.point, self.n
        if key == "blockers":
            value: object = format_ranks(list(p.blockers)) if p is not None else "-"
        elif key == "pg_name":
            value = p.pg_name
        elif key == "groups":
            value = ", ".join(n.groups)
        elif key == "count":
            value = n.count
        elif key in ("ranks", "others"):
            value = format_ranks(list(getattr(n, key)))
        else:
            raise KeyError(key)
        self[key] = value
        return value


def _render(text: str | Callable[..., str], w: _Wording, item: Blame | Note, where: str,
            fields: _Fields) -> str:  # fmt: skip
    return text.format_map(fields) if isinstance(text, str) else text(w, item, where)


def _why_gone(w: _Wording, b: Blame, where: str) -> str:
    ended = w.ended(b.ending, b.stale)
    if b.point and (b.rank not in b.point.of(MemberState.GONE)):
        return f"{ended}; it never issued {where}"
    return f"{ended} before completing {where}"


def _why_mismatch(w: _Wording, b: Blame, where: str) -> str:
    attrs = ", ".join(b.point.mismatch_attrs) if b.point else ""
    return f"issued a different {attrs or 'signature'} than its peers at {where}"


def _why_skipped(w: _Wording, b: Blame, where: str) -> str:
    if b.point is None:
        return b.reason.value
    rows = b.point.rows
    mine = rows[rows["rank"] == b.rank] if rows is not None else None
    site = mine["call_site"].iloc[0] if mine is not None and len(mine) else None
    return (
        f"skipped {where}: its entry at that seq comes from {site or 'another call'}, "
        "the call its peers make next"
    )


def _why_order(w: _Wording, b: Blame, where: str) -> str:
    others = " / ".join(w.point_name(q) for q in b.others)
    text = f"entered {where} before " + (others or "the op its peers wait in")
    if b.deviation == SKIP:
        text += "; its recent ops are its peers' order with one collective left out"
    elif b.deviation == REORDER:
        text += "; no peer issued its recent ops in this order"
    return text


def _why_device_stopped(w: _Wording, b: Blame, where: str) -> str:
    at = b.point.pg_name if b.point is not None else None
    lag = next((x for x in w.f.device_lags.get(b.rank, ()) if x.pg_name == at), None)
    peer = f"rank {lag.peer}" if lag is not None else "a peer"
    return (
        f"its GPU stopped: {where} completed on {peer} but never on it, although "
        "every member's kernel must run it (a poisoned CUDA context: a device-side "
        "error or an Xid)"
    )


def _why_straggler(w: _Wording, b: Blame, where: str) -> str:
    if b.lateness is None:
        return b.reason.value
    share, late, n = b.lateness
    return (
        f"late into {share:.0%} of its {n} collectives, median {late / 1e6:.1f} ms behind its peers"
    )


def _why_ended(w: _Wording, b: Blame, where: str) -> str:
    return f"{w.ended(b.ending, False)}; no recorded op of its peers waits for it"


def _why_never_arrived(w: _Wording, b: Blame, where: str) -> str:
    """A guilty rank of the start-up rule: what its record says of it."""
    if b.rank not in w.f.trace.ranks:
        return "left no record, while the others' records state the world size: it never joined"
    if b.ending is not None and b.ending.gone:
        return "its process is gone; its record ends at process start (never called init)"
    return "alive, never called init_process_group (its record ends at process start)"


REASON_TEXT: dict[Reason, str | Callable[[_Wording, Blame, str], str]] = {
    Reason.ABSENT: "no usable dump; ranks {blockers} wait for it in {where}",
    Reason.GONE: _why_gone,
    Reason.MISMATCH: _why_mismatch,
    Reason.DISAGREES: _why_mismatch,
    Reason.MISSING: "alive but never issued {where}, where its peers wait",
    Reason.SKIPPED: _why_skipped,
    Reason.ORDER: _why_order,
    Reason.NEVER_STARTED: "issued {where} but never started it while its peers did",
    Reason.DEVICE_STOPPED: _why_device_stopped,
    Reason.IN_HOST_CALL: "inside the NCCL call of {where}: the op is recorded but its group's "
    "last_enqueued never reached it",
    Reason.STUCK: "issued {where}; it never completed on any member",
    Reason.UNLISTED_MEMBER: "no usable dump; ranks {blockers} wait in {where}, whose members "
    "the dumps do not list",
    Reason.STRAGGLER: _why_straggler,
    Reason.ENDED: _why_ended,
    Reason.NO_DUMP: "no usable dump, while the others show no hang; it may have died",
    Reason.NEVER_ARRIVED: _why_never_arrived,
    Reason.SPLITS: "its split sizes at {where} disagree with what its peers send or expect "
    "(pairs below)",
}


def _note_placed_member(w: _Wording, n: Note, where: str) -> str:
    pg = w.f.process_group(n.point.pg_name)
    return (
        f"No file lists the members of group {pg.name}; it has fewer recorded members "
        f"than its sibling groups ({pg.desc or 'same kind'}), and rank(s) "
        f"{format_ranks(list(n.ranks))} complete it the way its siblings are shaped."
    )


def _note_beyond_files(w: _Wording, n: Note, where: str) -> str:
    groups = ", ".join(w.group_label(g) for g in n.groups)
    return (
        f"No file names rank(s) {format_ranks(list(n.ranks))} and no dump states the "
        f"world size, but group(s) {groups} have fewer recorded members than their "
        "sibling groups: the job had more ranks than files."
    )


def _note_device_lags(w: _Wording, n: Note, where: str) -> str:
    lines = [
        f"rank {r} completed group {w.group_label(lag.pg_name)} up to #{lag.completed}, "
        f"rank {lag.peer} up to #{lag.peer_completed} (#{lag.completed + 1} is {lag.op})"
        for r in n.ranks
        for lag in w.f.device_lags.get(r, ())[:3]
    ]
    return (
        "Completion counters (pg_status) behind a peer's on the same group: "
        + "; ".join(lines)
        + ". A collective completes on no member before every member's kernel ran it."
    )


def _note_startup_wait(w: _Wording, n: Note, where: str) -> str:
    phase = n.groups[0] if n.groups else ""
    one = len(n.ranks) == 1
    return (
        f"{'Rank' if one else 'Ranks'} {format_ranks(list(n.ranks), 60)} "
        f"{'waits' if one else 'wait'} inside init_process_group, "
        f"{_STARTUP_WAIT_TEXT.get(phase, phase)}."
    )


def _note_split_pair(w: _Wording, n: Note, where: str) -> str:
    if len(n.ranks) != 2 or len(n.values) != 2:
        return ""
    (i, j), (sent, expected) = n.ranks, n.values
    return (
        f"Split sizes of {where}: rank {i} sends {sent} elements to rank {j}; rank {j} "
        f"expects {expected} from rank {i}."
    )


def _note_blocked(w: _Wording, n: Note, where: str) -> str:
    p = n.point
    assert p is not None  # _NEEDS_POINT
    ranks = format_ranks(list(p.blockers), 60)
    if not p.targets:  # every member reached the op: a stopped GPU or network, not a rank
        return f"Ranks {ranks} blocked in {where}; no member is behind them in the records."
    return f"Ranks {ranks} blocked in {where}, waiting for {format_ranks(sorted(p.targets), 60)}."


def _note_host_call(w: _Wording, n: Note, where: str) -> str:
    calls = [w.f.host_calls[r] for r in n.ranks if r in w.f.host_calls]
    return (
        "Inside an NCCL host call (entry recorded, last_enqueued not reached): "
        + "; ".join(
            f"rank {c.rank} at {c.op} #{c.seq} on group {w.group_label(c.pg_name)} "
            f"(last_enqueued {c.enqueued})"
            for c in calls
        )
        + "."
    )


NOTE_TEXT: dict[NoteKind, str | Callable[[_Wording, Note, str], str]] = {
    NoteKind.BLOCKED: _note_blocked,
    NoteKind.ALSO_CYCLE: "Also a wait cycle among ranks {ranks} (a cross-group ordering problem).",
    NoteKind.CYCLE_CORE: "Ranks {ranks} wait for each other.",
    NoteKind.WHOLE_CYCLE: "No rank's order differs from its peers' history; blaming the whole "
    "cycle.",
    NoteKind.STUCK_OPS: "{count} op(s) issued by every member with one signature and "
    "completed by none.",
    NoteKind.DISAGREEING_OPS: "{count} collective(s) where members disagree.",
    NoteKind.STRAGGLER_RULE: f"Rule: at least T late in >= {LAST_SHARE:.0%} of >= "
    f"{MIN_COLLECTIVES} matched collectives and median lateness >= T, T = max("
    f"{MIN_LATE_NS / 1e6:.0f} ms, {SPREAD_FACTOR:g} x the typical jitter).",
    NoteKind.NOBODY_WAITS: "Nobody is recorded waiting for the missing rank(s); the verdict "
    "rests on the missing dump alone (a Gloo op that failed on a dead peer is recorded as "
    "completed).",
    NoteKind.UNLISTED_GROUP: "Ranks {blockers} issued {where} and it never completed; the "
    "group's membership ({ranks}) is inferred from the files present.",
    NoteKind.PLACED_MEMBER: _note_placed_member,
    NoteKind.BEYOND_FILES: _note_beyond_files,
    NoteKind.FAILED_COMPLETION: "Ranks {ranks} left {where} without every member: an error, "
    "which Gloo records as completion (victims, not healthy).",
    NoteKind.SPLIT_COMPLETION: "Ranks {ranks} are blocked in {where} while ranks {others} left "
    "it: a collective completes on no member before every member issued it, so they left it "
    "with an error, or the dump caught the moment after it completed.",
    NoteKind.ALL_PENDING: "Every rank with a record issued {where}; none completed it. A "
    "member of group {pg_name} without a record would explain it: no file lists the group's "
    "members.",
    NoteKind.UNSEEN_MEMBERS: "Group(s) {groups} lack {count} member(s) compared with their "
    "sibling groups; no file names them.",
    NoteKind.WRAPPED_MEMBERS: "The records of ranks {ranks} do not reach back to {where} (ring "
    "buffer wrapped): whether they issued it is unknown.",
    NoteKind.UNRECORDED_OP: "pg_status of ranks {ranks} counts an op on group(s) {groups} past "
    "every recorded entry that did not complete: an unrecorded op (send/recv on Gloo) holds "
    "them.",
    NoteKind.NO_OPS: "No rank's record holds any op.",
    NoteKind.ENDINGS: "The process(es) of rank(s) {ranks} ended by their own failure.",
    NoteKind.VICTIMS: "Rank(s) {ranks} failed in a collective because a peer went away "
    "(victims, not healthy and not guilty).",
    NoteKind.CASUALTIES: "Rank(s) {ranks} issued the op as the majority did and ended there: "
    "casualties of the disagreement (Gloo aborts a rank that receives a payload of another "
    "size), not its cause.",
    NoteKind.IN_FLIGHT: "{count} in-flight op(s) that every member issued.",
    NoteKind.DEVICE_LAGS: _note_device_lags,
    NoteKind.HOST_CALL: _note_host_call,
    NoteKind.RERAISED: "Rank(s) {ranks} ended with the same error, which names rank(s) "
    "{others} as where it failed: they re-raised it (casualties, not causes).",
    NoteKind.STARTUP_WAIT: _note_startup_wait,
    NoteKind.SPLIT_PAIR: _note_split_pair,
    NoteKind.SPLIT_TIE: "Ranks {ranks} each disagree with as many peers: the records cannot "
    "tell whose split sizes are wrong.",
}

# Notes whose text names their point: without one there is no line.
_NEEDS_POINT = frozenset(
    {
        NoteKind.BLOCKED,
        NoteKind.UNLISTED_GROUP,
        NoteKind.PLACED_MEMBER,
        NoteKind.FAILED_COMPLETION,
        NoteKind.SPLIT_COMPLETION,
        NoteKind.ALL_PENDING,
        NoteKind.WRAPPED_MEMBERS,
    }
)


# Reasons whose call site is the rank's own entry at the verdict's op.
_OWN_ENTRY_REASONS = (
    Reason.SKIPPED,
    Reason.MISMATCH,
    Reason.DISAGREES,
    Reason.ORDER,
    Reason.NEVER_STARTED,
    Reason.STUCK,
    Reason.DEVICE_STOPPED,
    Reason.IN_HOST_CALL,
    Reason.SPLITS,
)


def _error_summary(text: str, limit: int = 240) -> str:
    """An error text in one line: its first line and, for a multi-line text (a re-raised
    error with the original's traceback), its last."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    out = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
    return out if len(out) <= limit else out[: limit - 1] + "…"


# where a rank waits inside init_process_group (its recorded start-up phase), in words
_STARTUP_WAIT_TEXT = {
    "init": "before its rendezvous",
    "rendezvous": "in rendezvous: connecting to the store, whose master waits for every rank",
    "connect": "in the backend's connect to its peers (their addresses come through the store)",
}


def _who(g: GuiltyRank) -> str:
    parts = [str(g.rank)]
    extra = [x for x in (g.host, g.device) if x]
    if extra:
        parts.append(f"({', '.join(extra)})")
    return " ".join(parts)
