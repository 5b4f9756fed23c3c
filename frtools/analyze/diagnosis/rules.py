"""The diagnosis as rules: each reads the facts and the wait-for graph and returns a
Finding, or None when it does not apply. ``PRIORITY`` is the one place that orders them;
the first rule that answers gives the verdict (docs/verdict.md "Priority").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from frtools.analyze.align import as_texts

from .confidence import settle
from .facts import CompletionSource, JobFacts, counter_pair
from .graph import WaitForGraph, collective_point, is_stuck, sink_core
from .model import (
    ROOT_KIND,
    ROOT_REASON_RANK,
    Blame,
    Confidence,
    Decide,
    Finding,
    MemberState,
    Note,
    NoteKind,
    Point,
    Reason,
    VerdictKind,
)
from .order import order_deviants
from .origin import shared_errors
from .skips import skipped
from .splits import first_split_mismatch
from .startup import never_arrived
from .straggler import stragglers

# Verdict kinds of graph roots, strongest first.
_ROOT_KIND_ORDER = (VerdictKind.DEAD, VerdictKind.MISMATCH, VerdictKind.MISSING)


@dataclass(frozen=True)
class Evidence:
    """Everything a rule may read."""

    facts: JobFacts
    graph: WaitForGraph


Rule = Callable[[Evidence], "Finding | None"]


# ----- hangs before any group exists ------------------------------------------------------


def startup(ev: Evidence) -> Finding | None:
    """Ranks wait inside ``init_process_group`` for ranks that never called it (startup.py)."""
    return never_arrived(ev.facts)


# ----- an all_to_all whose members disagree pair by pair ------------------------------------


def split_mismatch(ev: Evidence) -> Finding | None:
    """An all_to_all where what a rank sends a peer is not what the peer expects from it
    (splits.py). Whatever followed — a hang, Gloo aborting the receiver, peers failing on
    the closed connections — it is the cause: the rank(s) whose splits disagree with the
    most peers."""
    g, f = ev.graph, ev.facts
    found = first_split_mismatch(f.trace, f.members)
    if found is None:
        return None
    c = f.al.collectives
    rows = c[(c["pg_name"] == found.pg_name).to_numpy() & (c["seq"] == found.seq).to_numpy()]
    point = collective_point(f, found.pg_name, found.seq, rows if len(rows) else None)
    blames = tuple(Blame(r, Reason.SPLITS, point=point) for r in found.guilty)
    notes = [
        Note(NoteKind.SPLIT_PAIR, point=point, ranks=(p.sender, p.receiver),
             values=(p.sent, p.expected))
        for p in found.pairs[:6]
    ]  # fmt: skip
    if found.tie:
        notes.append(Note(NoteKind.SPLIT_TIE, ranks=found.guilty))
    if found.count > 1:
        notes.append(Note(NoteKind.DISAGREEING_OPS, count=found.count))
    ended = {r for r, e in f.endings.items() if e.abnormal or e.victim}
    waiting = (set(g.blocked_at) | ended) - set(found.guilty)
    conf = Confidence.MISMATCH_TIE if found.tie else Confidence.MISMATCH
    return Finding(
        kind=VerdictKind.MISMATCH, confidence=conf, blames=blames, waiting=frozenset(waiting), point=point, notes=tuple(notes)
    )  # fmt: skip


# ----- hangs the graph explains ---------------------------------------------------------


def stopped_device(ev: Evidence) -> Finding | None:
    """Ranks whose GPU stopped: on a group they share with a peer, the peer completed an
    all-member collective the rank never saw complete (device.py). Blocked ranks wait for
    them directly or through others: victims, however many groups show them waiting."""
    g, f = ev.graph, ev.facts
    lags = f.device_lags
    if not lags or not g.blocked_at:
        return None
    blames = []
    points: dict[int, Point] = {}
    c = f.al.collectives
    names = as_texts(c["pg_name"])
    for r in sorted(lags):
        mine = []
        for lag in lags[r]:
            seq = lag.completed + 1
            rows = c[(names == lag.pg_name) & (c["seq"] == seq).to_numpy()]
            mine.append(collective_point(f, lag.pg_name, seq, rows))
        # the op it stopped at: the earliest of its lagging groups' first unfinished ops
        points[r] = min(mine, key=lambda p: (p.time_ns or float("inf"), p.pg_name))
        blames.append(Blame(r, Reason.DEVICE_STOPPED, point=points[r]))
    point = min(points.values(), key=lambda p: p.time_ns)
    # a rank without a record that ranks wait for is blamed as the roots rule blames it, not
    # counted among the waiting: the other faulted GPU often leaves no dump
    # (waited for by a rank whose GPU runs: a stopped one's waits prove nothing)
    awaited = {t for r in g.blocked_at if r not in lags for t in g.targets_of(r)}
    absent = frozenset(r for r in g.roots if r in f.absent and r in awaited) - set(lags)
    found = _root_reasons(ev, absent)
    for r in sorted(absent):
        reason, p = found.get(r, (Reason.ABSENT, point))
        blames.append(Blame(r, reason, point=p))
    blames.sort(key=lambda b: b.rank)
    waiting = (set(g.blocked_at) | set(g.waiting) | set(g.roots)) - set(lags) - absent
    notes = [Note(NoteKind.DEVICE_LAGS, ranks=tuple(sorted(lags)))]
    notes += [Note(NoteKind.BLOCKED, point=p) for p in g.points.values() if p.blockers][:4]
    conf = Confidence.STUCK_DEVICE - (Confidence.MIXED_KINDS if absent else 0)
    return Finding(
        kind=VerdictKind.STUCK, confidence=conf, blames=tuple(blames), waiting=frozenset(waiting), point=point,
        notes=tuple(notes),
    )  # fmt: skip


def skip(ev: Evidence) -> Finding | None:
    """A rank skipped a collective its peers issued: its entry at that seq comes from the
    call site its peers reach one collective later (its next call took the seq). Whatever
    followed — peers blocked, or aborted by the exchange of mismatched data — it is the
    cause."""
    g, f = ev.graph, ev.facts
    found = skipped(f, g)
    if not found:
        return None
    c = f.al.collectives
    blames = []
    points: list[Point] = []
    for r, (pg_name, seq) in sorted(found.items()):
        rows = c[(c["pg_name"] == pg_name).to_numpy() & (c["seq"] == seq).to_numpy()]
        point = collective_point(f, pg_name, seq, rows)
        points.append(point)
        blames.append(Blame(r, Reason.SKIPPED, point=point))
    point = min(points, key=lambda p: p.time_ns)
    waiting = (set(g.blocked_at) | set(g.roots) | set(point.issued)) - set(found)
    notes = [Note(NoteKind.BLOCKED, point=p) for p in g.points.values() if p.targets][:5]
    return Finding(
        kind=VerdictKind.MISSING, confidence=Confidence.MISSING, blames=tuple(blames), waiting=frozenset(waiting), point=point,
        notes=tuple(notes),
    )  # fmt: skip


def roots(ev: Evidence) -> Finding | None:
    """Ranks waited for that wait for nobody: dead > mismatch > missing by their reasons."""
    g, f = ev.graph, ev.facts
    if not g.roots or g.stuck_roots == g.roots:
        return None
    blamed = g.roots - g.stuck_roots
    waiting = g.waiting | g.stuck_roots
    reasons = _root_reasons(ev, blamed)
    casualties = _casualties(reasons)
    if casualties:
        blamed -= casualties
        waiting |= casualties
        reasons = {r: rp for r, rp in reasons.items() if r not in casualties}
    kinds = sorted({ROOT_KIND[r] for r, _ in reasons.values()}, key=_ROOT_KIND_ORDER.index)
    kind = kinds[0]
    points = [p for r, p in reasons.values() if ROOT_KIND[r] is kind]
    # the op the roots explain that names the most of them, the earliest of those
    point = min(
        points, key=lambda p: (not p.targets <= blamed, -len(p.targets & blamed), p.time_ns)
    )
    blames = []
    for r in sorted(blamed):
        reason, p = reasons.get(r, (Reason.MISSING, point))
        blames.append(
            Blame(
                r,
                reason,
                point=p,
                ending=f.ending(r) if reason is Reason.GONE else None,
                stale=r in f.stale,
            )  # fmt: skip
        )
    stalled = _never_started_on_their_own(ev, blamed)
    for r, p in sorted(stalled.items()):
        blames.append(Blame(r, Reason.NEVER_STARTED, point=p))
        waiting |= set(p.issued) - set(stalled)
    conf = {
        VerdictKind.DEAD: Confidence.DEAD,
        VerdictKind.MISMATCH: Confidence.MISMATCH,
        VerdictKind.MISSING: Confidence.MISSING,
    }[kind]
    if len(kinds) > 1 or stalled:
        conf -= Confidence.MIXED_KINDS
    if kind is VerdictKind.MISMATCH and point.tie:
        conf = Confidence.MISMATCH_TIE
    notes: list[Note] = []
    placed = _placed(f, blames)
    if placed:
        conf -= Confidence.PLACED_MEMBER
        notes += placed
    shown = sorted(g.points.values(), key=lambda p: (not p.targets <= blamed, -len(p.blockers)))
    for p in shown[:5]:
        if p.targets and p.blockers:
            notes.append(Note(NoteKind.BLOCKED, point=p))
    if casualties:
        notes.append(Note(NoteKind.CASUALTIES, point=point, ranks=tuple(sorted(casualties))))
    calling = tuple(r for r in sorted(blamed) if r in f.host_calls)
    if calling:
        notes.append(Note(NoteKind.HOST_CALL, ranks=calling))
    failure = _failure_notes(f, point)
    notes += failure
    for note in failure:
        waiting |= set(note.ranks)  # they left the op with an error: victims
    if g.cyclic:
        notes.append(Note(NoteKind.ALSO_CYCLE, ranks=tuple(sorted(g.cyclic))))
    return Finding(
        kind=kind,
        confidence=conf,
        blames=tuple(blames),
        waiting=frozenset(waiting),
        point=point,
        notes=tuple(notes),
    )


def _never_started_on_their_own(ev: Evidence, blamed: frozenset[int]) -> dict[int, Point]:
    """Ranks, beside the roots, whose GPU never started the collective they are blocked at
    while a peer's did (NCCL launches a collective's kernel whoever else has joined), where
    that op is the oldest one pending on them, so nothing of theirs holds it back: a second
    cause, which only the start states show (the graph has the rank waiting there, for
    the roots or for nobody)."""
    g = ev.graph
    out: dict[int, Point] = {}
    for key, p in g.points.items():
        if not p.is_collective or p.rows is None or p.completed or p.failed:
            continue
        for r in sorted(_laggards(p)):
            if r not in blamed and r in g.blocked_known and g.blocked_at.get(r) == key:
                out.setdefault(r, p)
    return out


def _laggards(p: Point) -> set[int]:
    """Members that issued ``p`` but never started it while another member did (none when
    no member or every member started it)."""
    assert p.rows is not None
    rows = p.rows
    started = set(int(r) for r in rows.loc[rows["state"] == "started", "rank"])
    laggards = set(p.issued) - started
    return laggards if started and laggards != set(p.issued) else set()


def stuck_roots(ev: Evidence) -> Finding | None:
    """Every root is itself blocked in an op every member issued and nobody completed:
    that op is stuck (or, on a group whose members no file lists, short of a dead member)."""
    g, f = ev.graph, ev.facts
    if not g.roots or g.stuck_roots != g.roots:
        return None
    stuck = {g.blocked_at[r]: g.points[g.blocked_at[r]] for r in g.roots}
    unlisted = [p for p in stuck.values() if not f.listed(p.pg_name)]
    if f.absent and unlisted:
        return _absent_member(ev, min(unlisted, key=lambda p: p.time_ns), set(g.waiting))
    # Other ops wedged the same way (real states), even if nobody waits on them yet.
    for key, p in g.points.items():
        if key not in stuck and is_stuck(p):
            stuck[key] = p
    return _stuck(ev, list(stuck.values()), set(g.waiting))


def cycle(ev: Evidence) -> Finding | None:
    """Waiting ranks that reach no root wait for each other: a cross-group deadlock."""
    g, f = ev.graph, ev.facts
    if g.roots or not g.cyclic:
        return None
    core = sink_core(g.cyclic, g.targets_of)
    deviants = order_deviants(f, g, core)
    blamed = sorted(deviants) or sorted(core)
    shown = sorted({g.blocked_at[r] for r in core}, key=lambda k: -len(g.points[k].blockers))
    shown_points = [g.points[k] for k in shown]
    blames = []
    for r in blamed:
        p = g.points[g.blocked_at[r]]
        others = tuple(q for q in shown_points if q.key != p.key)[:2]
        blames.append(Blame(r, Reason.ORDER, point=p, others=others, deviation=deviants.get(r)))
    notes = [Note(NoteKind.CYCLE_CORE, ranks=tuple(sorted(core)))]
    notes += [Note(NoteKind.BLOCKED, point=p) for p in shown_points[:6]]
    if not deviants:
        notes.append(Note(NoteKind.WHOLE_CYCLE))
    elif not any(p.is_collective for p in shown_points):
        # A send/recv cycle: the rank whose own order stands out never posted the transfer
        # its peer waits in (it went on to the next one): that is a missing op, not two
        # groups in conflicting orders.
        missing = []
        for r in blamed:
            where = [p for p in shown_points if r in p.of(MemberState.MISSING)]
            if where:
                missing.append(Blame(r, Reason.MISSING, point=where[0]))
        if len(missing) == len(blamed):
            return Finding(
                kind=VerdictKind.MISSING,
                confidence=Confidence.MISSING,
                blames=tuple(missing),
                waiting=frozenset(g.waiting - set(blamed)),
                point=missing[0].point,
                notes=tuple(notes),
            )
    return Finding(
        kind=VerdictKind.ORDER,
        confidence=Confidence.ORDER_DEVIANT if deviants else Confidence.ORDER_WHOLE_CYCLE,
        blames=tuple(blames),
        waiting=frozenset(g.waiting - set(blamed)),
        point=g.points[g.blocked_at[blamed[0]]],
        notes=tuple(notes),
    )


def stuck(ev: Evidence) -> Finding | None:
    """Ops every member issued with one signature and no member completed, by real states,
    although nobody is recorded waiting on them."""
    g, f = ev.graph, ev.facts
    if not f.has_completion_info:
        return None
    points = [p for p in g.points.values() if is_stuck(p)]
    if not points:
        return None
    if f.absent:
        unlisted = [p for p in points if not f.listed(p.pg_name)]
        if unlisted:
            return _absent_member(ev, min(unlisted, key=lambda p: p.time_ns), set())
    return _stuck(ev, points, set())


# ----- failures without a hang ------------------------------------------------------------


def ended(ev: Evidence) -> Finding | None:
    """A rank's process ended by a failure of its own (an uncaught exception, a signal, a
    kill) and nothing recorded waits for it: the job lost it (invariant 5)."""
    f = ev.facts
    ended_ranks = sorted(r for r, e in f.endings.items() if e.abnormal)
    if not ended_ranks:
        return None
    victims = sorted(r for r, e in f.endings.items() if e.victim)
    notes: list[Note] = []
    # one error re-raised on several ranks: the rank it names is the root (origin.py)
    shared = shared_errors({r: f.endings[r] for r in ended_ranks}, f.present | f.expected)
    reraised: set[int] = set()
    for err in shared:
        if set(err.ranks) & reraised:
            continue
        reraised |= set(err.casualties)
        notes.append(Note(NoteKind.RERAISED, ranks=err.casualties, others=err.roots))
    if reraised:
        ended_ranks = [r for r in ended_ranks if r not in reraised]
        victims = sorted(set(victims) | reraised)
    blames = tuple(Blame(r, Reason.ENDED, ending=f.ending(r)) for r in ended_ranks)
    notes.insert(0, Note(NoteKind.ENDINGS, ranks=tuple(ended_ranks)))
    if victims and not reraised:
        notes.append(Note(NoteKind.VICTIMS, ranks=tuple(victims)))
    return Finding(
        kind=VerdictKind.DEAD,
        confidence=Confidence.DEAD_ENDED,
        blames=blames,
        waiting=frozenset(victims),
        point=None,
        notes=tuple(notes),
    )


def silent_mismatch(ev: Evidence) -> Finding | None:
    """Collectives that did not hang but whose members disagreed on what must agree."""
    f = ev.facts
    c = f.al.collectives
    if not len(c):
        return None
    n = c.groupby(["pg_name", "seq"], sort=False, observed=True)["sig"].nunique()
    bad = n[n > 1]
    if not len(bad):
        return _odd_against_siblings(ev)
    first = c.set_index(["pg_name", "seq"]).loc[bad.index]
    t = first.groupby(level=[0, 1], observed=True)["time_created_ns"].min().reset_index()
    # the earliest; a tie goes to the group name and seq, not to the order of the group
    # categories (the order in which the readers met the groups)
    t["name"] = as_texts(t["pg_name"])
    earliest = t.sort_values(["time_created_ns", "name", "seq"], kind="stable").iloc[0]
    pg_name, seq = earliest["pg_name"], earliest["seq"]
    rows = c[(c["pg_name"] == pg_name) & (c["seq"] == seq)]
    return _disagreement(collective_point(f, str(pg_name), int(seq), rows), len(bad))


def _odd_against_siblings(ev: Evidence) -> Finding | None:
    """A group whose other members left no record: its present members' ops whose dtype
    differs from what every sibling group recorded at the same seq (Gloo aborts the
    partner that receives the wrong number of bytes; the op itself may be retired)."""
    f = ev.facts
    c = f.al.collectives
    short = [g for g, m in f.membership.members.items() if set(m) & f.absent and len(m) > 1]
    for pg_name in sorted(short):
        mine = c[(c["pg_name"] == pg_name).to_numpy()]
        for seq in sorted(mine["seq"].unique().tolist(), reverse=True)[:LATEST_SEQS]:
            rows = mine[(mine["seq"] == seq).to_numpy()]
            point = collective_point(f, pg_name, int(seq), rows)
            if point.of(MemberState.MINORITY) and point.mismatch_attrs:
                return _disagreement(point, 1)
    return None


def _disagreement(point: Point, count: int) -> Finding:
    """A mismatch without a hang at ``point`` (of ``count`` such collectives): its minority
    is blamed, nobody waits."""
    blames = tuple(Blame(r, Reason.DISAGREES, point=point) for r in point.of(MemberState.MINORITY))
    return Finding(
        kind=VerdictKind.MISMATCH,
        confidence=Confidence.MISMATCH_NO_HANG,
        blames=blames,
        point=point,
        notes=(Note(NoteKind.DISAGREEING_OPS, count=count),),
    )


# Ops per group, the latest, compared with the sibling groups' when a member left no record.
LATEST_SEQS = 4


# ----- hangs the data cannot pin on a rank --------------------------------------------------


def unnamed_wait(ev: Evidence) -> Finding | None:
    """Ranks are blocked, but nothing the dumps name is what they wait for: a member no
    file names (Gloo dumps list no members and state no world size), records that do not
    reach back, an op "completed" on some members and pending on others on a group whose
    completion marks prove nothing (Gloo retires a failed op), or an op only pg_status
    counts (Gloo's FR records no send/recv). "Healthy" would be false (invariant 2), and no
    rank can be named (invariant 3): inconclusive, saying what would decide it."""
    g, f = ev.graph, ev.facts
    held = sorted(r for r in g.blocked_known if not g.targets_of(r))
    points = {g.blocked_at[r]: g.points[g.blocked_at[r]] for r in held}
    unexplained = [p for p in points.values() if _unnamed(f, p)]
    unrecorded = dict(g.unrecorded)
    if not unexplained and not unrecorded:
        return None
    waiting = {b for p in unexplained for b in p.blockers} | set(unrecorded)
    notes: list[Note] = []
    decide: list[Decide] = []
    for p in sorted(unexplained, key=lambda p: (p.time_ns, -len(p.blockers))):
        notes += _unnamed_notes(f, p)
    if unrecorded:
        groups = sorted({pg for pgs in unrecorded.values() for pg in pgs})
        notes.append(Note(NoteKind.UNRECORDED_OP, ranks=tuple(sorted(unrecorded)),
                          groups=tuple(groups)))  # fmt: skip
        decide.append(Decide.P2P_RECORDS)
    if any(p.of(MemberState.UNKNOWN) for p in unexplained):
        decide.append(Decide.LARGER_BUFFER)
    if any(p.unseen or not f.complete(p.pg_name) for p in unexplained) or unrecorded:
        if not f.world_certain:
            decide.append(Decide.WORLD_SIZE)
        decide.append(Decide.MISSING_DUMPS)
    if any(p.completed and not f.complete(p.pg_name) for p in unexplained):
        decide.append(Decide.LATER_DUMP)
    point = max(unexplained, key=lambda p: (len(p.blockers), -p.time_ns)) if unexplained else None
    return Finding(
        kind=VerdictKind.INCONCLUSIVE,
        confidence=Confidence.INCONCLUSIVE,
        blames=(),
        waiting=frozenset(waiting),
        point=point,
        notes=tuple(notes),
        decide=tuple(dict.fromkeys(decide)),
    )


# ----- no hang --------------------------------------------------------------------------


def straggler(ev: Evidence) -> Finding | None:
    found = stragglers(ev.facts)
    if not found:
        return None
    blames = tuple(
        Blame(r, Reason.STRAGGLER, lateness=(share, late, n)) for r, share, late, n in found
    )
    return Finding(
        kind=VerdictKind.STRAGGLER,
        confidence=Confidence.STRAGGLER,
        blames=blames,
        notes=(Note(NoteKind.STRAGGLER_RULE),),
    )


def absence(ev: Evidence) -> Finding | None:
    """No hang in the records, but expected ranks left no record: "healthy" needs every
    member accounted for (invariant 2). Named absent ranks may have died (a Gloo peer's
    failed op is recorded as completed); members only a short group reveals cannot be
    named."""
    f = ev.facts
    if f.absent:
        victims = sorted(r for r, e in f.endings.items() if e.victim)
        notes = [Note(NoteKind.NOBODY_WAITS)]
        if victims:
            notes.append(Note(NoteKind.VICTIMS, ranks=tuple(victims)))
        return Finding(
            kind=VerdictKind.DEAD,
            confidence=Confidence.DEAD_ENDED if victims else Confidence.DEAD_NO_DUMP,
            blames=tuple(Blame(r, Reason.NO_DUMP) for r in sorted(f.absent)),
            waiting=frozenset(victims),
            point=None,
            notes=tuple(notes),
            decide=(Decide.MISSING_DUMPS,),
        )
    unseen = dict(f.membership.unseen)
    if not unseen:
        return None
    notes = tuple(
        Note(NoteKind.UNSEEN_MEMBERS, count=n, groups=(g,)) for g, n in sorted(unseen.items())
    )
    decide = (Decide.WORLD_SIZE,) if not f.world_certain else ()
    return Finding(
        kind=VerdictKind.INCONCLUSIVE,
        confidence=Confidence.INCONCLUSIVE,
        notes=notes,
        decide=decide + (Decide.MISSING_DUMPS,),
    )


def no_records(ev: Evidence) -> Finding | None:
    """Nothing recorded: "healthy" would rest on no evidence at all — unless every rank's
    counters say it completed all it enqueued (NCCL dumps of the active ops of a job between
    two steps hold no entry at all): then nothing is pending anywhere."""
    f = ev.facts
    al = f.al
    if len(al.collectives) or len(al.p2p):
        return None
    if f.present and all(_all_idle(f.trace.ranks[r].pg_status) for r in f.present):
        return Finding(
            kind=VerdictKind.HEALTHY, confidence=Confidence.HEALTHY, completion_info=True
        )
    return Finding(
        kind=VerdictKind.INCONCLUSIVE,
        confidence=Confidence.INCONCLUSIVE,
        notes=(Note(NoteKind.NO_OPS),),
        decide=(Decide.ANY_RECORD,),
    )


def _all_idle(pg_status: dict) -> bool:
    """Each group's last enqueued op completed, and some op done (-1: no counter, a
    summary's placeholder)."""
    entries = [
        st
        for st in pg_status.values()
        if isinstance(st, dict)
        and (st.get("last_enqueued_collective"), st.get("last_completed_collective")) != (-1, -1)
    ]
    counts = [counter_pair(st) for st in entries]
    return (
        bool(counts)
        and all(c is not None and c[0] == c[1] for c in counts)
        and any(c[1] > 0 for c in counts if c is not None)
    )


def healthy(ev: Evidence) -> Finding:
    f, g = ev.facts, ev.graph
    in_flight = sum(1 for p in g.points.values() if p.blockers)
    notes = (Note(NoteKind.IN_FLIGHT, count=in_flight),) if in_flight else ()
    conf = Confidence.HEALTHY if f.has_completion_info else Confidence.HEALTHY_NO_COMPLETION
    return Finding(
        kind=VerdictKind.HEALTHY,
        confidence=conf,
        notes=notes,
        completion_info=f.has_completion_info,
    )


PRIORITY: tuple[Rule, ...] = (
    startup,
    split_mismatch,
    stopped_device,
    skip,
    roots,
    stuck_roots,
    cycle,
    stuck,
    ended,
    silent_mismatch,
    unnamed_wait,
    straggler,
    absence,
    no_records,
    healthy,
)


def first_finding(ev: Evidence) -> Finding:
    """The first rule's answer, its confidence settled (confidence.py): what the wording
    renders, with nothing left to decide."""
    for rule in PRIORITY:
        finding = rule(ev)
        if finding is not None:
            return settle(finding, ev.facts)
    raise AssertionError("the healthy rule always answers")


# ----- helpers ------------------------------------------------------------------------------


def _root_reasons(ev: Evidence, blamed: frozenset[int]) -> dict[int, tuple[Reason, Point]]:
    """Per root, its strongest reason and where: prefer the strongest reason, then points
    that wait only for roots (the direct victims), then the earliest."""
    g, f = ev.graph, ev.facts
    found: dict[int, tuple[Reason, Point]] = {}
    for point in g.points.values():
        if not point.of(MemberState.MINORITY) and not any(g.targets_of(b) for b in point.blockers):
            continue
        for r in blamed:
            if r in point.of(MemberState.ABSENT):
                reason = Reason.ABSENT
            elif r in point.of(MemberState.MINORITY):
                reason = Reason.MISMATCH
            elif r in point.of(MemberState.GONE):
                reason = Reason.GONE
            elif r in point.of(MemberState.MISSING):
                reason = Reason.MISSING
                if r in f.present and (f.gone(r) or r in f.stale):
                    reason = Reason.GONE
            else:
                continue
            prev = found.get(r)
            if prev is None or _point_rank(reason, point, blamed) < _point_rank(
                prev[0], prev[1], blamed
            ):
                found[r] = (reason, point)
    return found


def _casualties(reasons: dict[int, tuple[Reason, Point]]) -> frozenset[int]:
    """Roots whose process ended in an op they issued with the majority's signature, where
    another root issued it otherwise: the disagreement is the cause and they its casualties
    (Gloo aborts a rank that receives a payload of another size; seen in real jobs)."""
    odd = {p.key for reason, p in reasons.values() if reason is Reason.MISMATCH}
    return frozenset(
        r for r, (reason, p) in reasons.items() if reason is Reason.GONE and p.key in odd
    )


def _point_rank(reason: Reason, point: Point, blamed: frozenset[int]) -> tuple:
    # then the op naming the most roots (two absent ranks: each one peer's send, and
    # both an all_to_all where more peers wait)
    return (
        ROOT_REASON_RANK[reason],
        not point.targets <= blamed,
        -len(point.targets & blamed),
        point.time_ns,
    )


def _placed(f: JobFacts, blames: list[Blame]) -> list[Note]:
    """Notes for guilty ranks that only sibling inference named or put in their group."""
    notes = []
    beyond = set(f.membership.beyond)
    if beyond & {b.rank for b in blames}:
        short = tuple(sorted(f.membership.short))
        notes.append(Note(NoteKind.BEYOND_FILES, ranks=tuple(sorted(beyond)), groups=short))
    for b in blames:
        if b.point is None:
            continue
        added = f.membership.added.get(b.point.pg_name, ())
        if b.rank in added and b.rank not in beyond:
            notes.append(Note(NoteKind.PLACED_MEMBER, point=b.point, ranks=tuple(added)))
    return notes


def _failure_notes(f: JobFacts, point: Point) -> list[Note]:
    """Members that left the verdict's op with an error (or a Gloo "completion" while a
    member never joined): victims, not healthy and not guilty."""
    if point.failed:
        return [Note(NoteKind.FAILED_COMPLETION, point=point, ranks=point.failed)]
    if not (point.of(MemberState.ABSENT) or point.of(MemberState.GONE)):
        return []
    retired = tuple(r for r in point.completed if f.completion.get(r) is CompletionSource.RETIRED)
    return [Note(NoteKind.FAILED_COMPLETION, point=point, ranks=retired)] if retired else []


def _unnamed(f: JobFacts, p: Point) -> bool:
    """A point whose blocked ranks wait for somebody the dumps do not name."""
    if p.targets:
        return False
    if p.of(MemberState.UNKNOWN) or p.unseen:
        return True
    if not p.is_collective:
        return False
    # Every member a file names issued it. On a group whose members are not all known, the
    # one nobody saw may be missing; a completion there proves nothing (Gloo retires a
    # failed op). On a complete group every member has it: it is in flight.
    return not f.complete(p.pg_name)


def _unnamed_notes(f: JobFacts, p: Point) -> list[Note]:
    notes = []
    if p.of(MemberState.UNKNOWN):
        notes.append(Note(NoteKind.WRAPPED_MEMBERS, point=p, ranks=p.of(MemberState.UNKNOWN)))
    if p.unseen:
        notes.append(Note(NoteKind.UNSEEN_MEMBERS, point=p, count=p.unseen, groups=(p.pg_name,)))
    if p.completed:
        notes.append(Note(NoteKind.SPLIT_COMPLETION, point=p, ranks=p.blockers,
                          others=p.completed))  # fmt: skip
    elif p.is_collective and not p.of(MemberState.UNKNOWN):
        notes.append(Note(NoteKind.ALL_PENDING, point=p, ranks=p.blockers))
    return notes


def _absent_member(ev: Evidence, point: Point, waiting: set[int]) -> Finding:
    """An op "every member" issued and none completed, on a group whose membership was
    inferred, while some ranks left no record: the likelier story is a dead member (its
    partner waits for it, e.g. a tensor-parallel pair) than a stuck op."""
    f = ev.facts
    blames = tuple(Blame(r, Reason.UNLISTED_MEMBER, point=point) for r in sorted(f.absent))
    return Finding(
        kind=VerdictKind.DEAD,
        confidence=Confidence.DEAD_UNLISTED_MEMBER,
        blames=blames,
        waiting=frozenset(set(point.blockers) | waiting),
        point=point,
        notes=(Note(NoteKind.UNLISTED_GROUP, point=point, ranks=point.issued),),
        decide=(Decide.WORLD_SIZE, Decide.MEMBERSHIP),
    )


def _stuck(ev: Evidence, points: list[Point], waiting: set[int]) -> Finding:
    """Blame, per stuck op, the members that never started it while others did (a wedged
    GPU); with no such rank anywhere, every member of the earliest stuck op."""
    f = ev.facts
    blamed_at: dict[int, Point] = {}
    in_call: set[int] = set()
    for p in sorted(points, key=lambda p: p.time_ns):
        members = set(p.issued)
        # inside the NCCL call of this very op (entry recorded, never enqueued)
        calling = {
            r
            for r in members
            if (hc := f.host_calls.get(r)) is not None
            and (hc.pg_name, hc.seq) == (p.pg_name, p.seq)
        }
        if calling and calling != members:
            in_call |= calling
            for r in calling:
                blamed_at.setdefault(r, p)
            continue
        for r in _laggards(p):
            blamed_at.setdefault(r, p)
    point = min(points, key=lambda p: p.time_ns)
    if blamed_at:
        point = min(blamed_at.values(), key=lambda p: p.time_ns)
    never_started = bool(blamed_at)
    if not blamed_at:
        blamed_at = {r: point for r in point.issued}
    reason = Reason.NEVER_STARTED if never_started else Reason.STUCK
    blames = tuple(
        Blame(r, Reason.IN_HOST_CALL if r in in_call else reason, point=blamed_at[r])
        for r in sorted(blamed_at)
    )
    involved = set(point.issued)
    for p in points:
        involved |= set(p.issued)
    conf = Confidence.STUCK_NEVER_STARTED if never_started else Confidence.STUCK_ALL_MEMBERS
    # (a laggard's record without states of its own does not weaken its peers' starts)
    if not never_started and point.rows is not None and not point.rows["informative"].all():
        conf = Confidence.STUCK_WITHOUT_STATES
    notes = [Note(NoteKind.STUCK_OPS, count=len(points))]
    if in_call:
        notes.append(Note(NoteKind.HOST_CALL, ranks=tuple(sorted(in_call))))
    return Finding(
        kind=VerdictKind.STUCK,
        confidence=conf,
        blames=blames,
        waiting=frozenset((involved | waiting) - set(blamed_at)),
        point=point,
        notes=tuple(notes),
    )
