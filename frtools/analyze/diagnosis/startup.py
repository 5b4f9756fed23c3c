"""A rank that never arrived: its peers wait inside ``init_process_group`` for it.

No group exists yet, so no collective is recorded and the wait-for graph is empty; the
start-up phases frtools records from process start (``RankInfo.startup_phase``,
docs/snapshot-format.md) are the evidence. Ranks inside ``init_process_group`` (``init``,
``rendezvous``, ``connect``) wait for every rank of the world; those that are not there —
still ``started`` (running, never called it) or without any record while the others'
headers state the world size — are the cause.

Example: 4 ranks, rank 3 sleeps before ``init_process_group``. Rank 0 (the store's master)
waits in ``rendezvous`` for every rank to connect, ranks 1 and 2 in ``connect`` (Gloo reads
its peers' addresses from the store): rank 3's box says ``started`` -> ``missing [3]``,
waiting [0, 1, 2]. Had rank 3 written no box at all: ``dead [3]``.
"""

from __future__ import annotations

from .facts import JobFacts
from .model import Blame, Confidence, Finding, Note, NoteKind, Reason, VerdictKind

# phases in which a rank waits for the whole world (frtools.model.trace.STARTUP_PHASES)
WAITING_PHASES = ("init", "rendezvous", "connect")


def never_arrived(f: JobFacts) -> Finding | None:
    """Ranks inside ``init_process_group`` while others never called it (``missing``: alive
    and elsewhere) or left no record (``dead``); None when no rank waits in start-up, or
    every expected rank is in it (nobody is behind: not this rule's to say)."""
    phases = {r: info.startup_phase for r, info in f.trace.ranks.items()}
    waiting = sorted(r for r, phase in phases.items() if phase in WAITING_PHASES)
    if not waiting:
        return None
    started = {r for r, phase in phases.items() if phase == "started"}
    behind = sorted(started | set(f.absent))
    if not behind:
        return None
    dead = {r for r in behind if r in f.absent or f.gone(r)}
    kind = VerdictKind.DEAD if dead == set(behind) else VerdictKind.MISSING
    blames = tuple(
        Blame(r, Reason.NEVER_ARRIVED, ending=f.ending(r) if r in dead else None) for r in behind
    )
    notes = tuple(
        Note(NoteKind.STARTUP_WAIT, ranks=tuple(r for r in waiting if phases[r] == phase),
             groups=(phase,))
        for phase in WAITING_PHASES
        if any(phases[r] == phase for r in waiting)
    )  # fmt: skip
    confidence = Confidence.DEAD if kind is VerdictKind.DEAD else Confidence.MISSING
    if dead and kind is VerdictKind.MISSING:
        confidence -= Confidence.MIXED_KINDS
    return Finding(
        kind=kind,
        confidence=confidence,
        blames=blames,
        waiting=frozenset(waiting),
        point=None,
        notes=notes,
    )
