"""This rank's summary, from its own live black box, in the current group's numbering.

The recorder's black box keeps recording across a recovery, but the job it describes
changes: after survivors are renumbered 0..n-1, the box's group table still lists the launch
membership, its older ops belong to the previous group, and its sequence counters carry on
from the failed op (which may be one op further on some ranks than on others). ``Eras``
remembers, for each membership, where it started in the box (record id, group-table row,
each group's last sequence ids); ``summary_bytes`` keeps the current era's ops only, maps
every member list and P2P peer into the current numbering, and counts sequence ids from the
era's start, so that the next diagnosis sees the job as it is now.

The box is read while this process writes it: ``consistent_snapshot`` never lets a slot
being written at that moment fall out of a summary (see there).
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from frtools.formats.blackbox import Snapshot, copy_consistent, read_header, read_snapshot
from frtools.formats.summary import RankSummary, encode, summarize

# the error text kept for an op that failed (the first line of the exception)
MAX_ERROR_CHARS = 512
# how long a summary waits for slots that were being written while the box was read (a
# writer holds a slot for well under a microsecond; one preempted mid-write, a time slice)
CONSISTENT_READ_S = 1.0


@dataclass
class Era:
    """One membership of the job: ``members`` (launch ranks, in rank order) from record
    ``first_record_id`` and group-table row ``first_group`` of the box on; ``seq_base``: per
    group row, the (collective, p2p) sequence ids already used when the era began."""

    members: list[int]
    first_record_id: int = 0
    first_group: int = 0
    seq_base: dict[int, tuple[int, int]] = field(default_factory=dict)


class Eras:
    """The memberships this rank has lived through, newest last."""

    def __init__(self, members: Sequence[int]) -> None:
        self.eras = [Era(list(members))]

    @property
    def current(self) -> Era:
        return self.eras[-1]

    def begin(self, members: Sequence[int], box_path: str) -> None:
        """A new membership starts now (call right after the group was rebuilt)."""
        snap = read_snapshot(box_path)
        base = {
            i: (max(0, g.last_enqueued_collective), max(0, g.last_enqueued_p2p))
            for i, g in enumerate(snap.groups)
        }
        self.eras.append(Era(list(members), int(snap.records_written), len(snap.groups), base))

    def era_of_group(self, row: int) -> Era:
        for era in reversed(self.eras):
            if row >= era.first_group:
                return era
        return self.eras[0]

    def to_current(self, row: int, rank: int) -> int | None:
        """A global rank recorded for group ``row`` (numbered as when that group was made)
        in the current numbering; None when that rank is no longer a member."""
        era = self.era_of_group(row)
        if not 0 <= rank < len(era.members):
            return None
        launch = era.members[rank]
        members = self.current.members
        return members.index(launch) if launch in members else None


def stacks_text() -> str | None:
    """Every thread's Python stack now (faulthandler's text), None if it cannot be had."""
    try:
        with tempfile.TemporaryFile(mode="w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read()
    except Exception:
        return None


def consistent_snapshot(box_path: str, patience_s: float = CONSISTENT_READ_S) -> Snapshot:
    """This rank's live black box with no slot dropped as torn.

    ``read_snapshot`` drops each slot whose sequence counter moved while it copied the ring
    (milliseconds for a big ring). In a recovery that is the rule, not the exception: the
    recorder's poller marks the op that just failed here (``mark_failed`` writes its slot)
    in the very moment this rank takes its summary, and a summary without that op says the
    rank never issued it: the diagnosis then names a healthy survivor "missing" and the job
    drops it. So a read that tore a slot is taken again, slot by slot (``copy_consistent``
    re-reads a slot being written on its own), until nothing is torn or ``patience_s`` has
    passed (the snapshot's notes then say what it dropped)."""
    snap = read_snapshot(box_path)
    if not snap.torn:
        return snap
    deadline = time.monotonic() + patience_s
    pause = 0.001
    try:
        with tempfile.TemporaryDirectory(prefix="frtools-box-") as tmp:
            copy = os.path.join(tmp, os.path.basename(box_path))
            while True:
                copy_consistent(box_path, copy)
                snap = read_snapshot(copy)
                if not snap.torn or time.monotonic() >= deadline:
                    return snap
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
    except OSError:  # no room for the copy: the first read, whose notes say what it dropped
        return snap


def oldest_pending_ns(box_path: str, since_record_id: int) -> int | None:
    """When this rank's oldest op of the era that did not complete was issued (the onset of
    what it waits for), None when all completed."""
    snap = consistent_snapshot(box_path)
    s = snap.slots
    s = s[(s["record_id"] >= since_record_id) & (s["state"] != 3)]
    return int(s["time_created_ns"].min()) if len(s) else None


def last_completed_ns(box_path: str, since_record_id: int) -> int | None:
    """When this rank's newest op of the era completed (its own proof that its collectives
    complete), None when none did."""
    snap = consistent_snapshot(box_path)
    s = snap.slots
    s = s[(s["record_id"] >= since_record_id) & (s["state"] == 3)]
    return int(s["time_completed_ns"].max()) if len(s) else None


def stall_since(box_path: str, since_record_id: int) -> bool:
    """The watchdog flags a stall on an op of the current era (an older op that failed stays
    incomplete in the box, and would keep the flag up for ever)."""
    try:
        header = read_header(box_path)
    except (OSError, ValueError):
        return False
    return bool(header["stalled"]) and int(header["stall_record_id"]) >= since_record_id


def local_summary(
    box_path: str,
    eras: Eras,
    launch_rank: int,
    *,
    window: int,
    failure: str | None = None,
    stalled: bool = False,
    stacks: bool = True,
) -> RankSummary:
    """This rank's summary of the current era. ``failure``: the error a collective raised
    here (its ops that did not complete are marked failed with it, and the rank known to be
    blocked); ``stalled``: the rank knows it waits (its watchdog flagged it); ``stacks``:
    add every thread's Python stack as it is now."""
    era = eras.current
    snap = consistent_snapshot(box_path)
    summary = summarize(
        snap,
        window=window,
        since_record_id=era.first_record_id,
        stacks=stacks_text() if stacks else None,
    )
    members = era.members
    rank = members.index(launch_rank)
    groups = []
    for row, g in enumerate(summary.groups):
        mapped = (eras.to_current(row, r) for r in g.ranks)
        base_c, base_p = era.seq_base.get(row, (0, 0))
        groups.append(
            replace(
                g,
                ranks=tuple(sorted(r for r in mapped if r is not None)),
                last_enqueued_collective=_rebase(g.last_enqueued_collective, base_c),
                last_started_collective=_rebase(g.last_started_collective, base_c),
                last_completed_collective=_rebase(g.last_completed_collective, base_c),
                last_enqueued_p2p=_rebase(g.last_enqueued_p2p, base_p),
                last_completed_p2p=_rebase(g.last_completed_p2p, base_p),
            )
        )
    error = (failure or "").strip().split("\n", 1)[0][:MAX_ERROR_CHARS]
    entries = []
    for e in summary.entries:
        base_c, base_p = era.seq_base.get(e.group, (0, 0))
        peer = e.peer if e.peer is None or e.group < 0 else eras.to_current(e.group, e.peer)
        entries.append(
            replace(
                e,
                peer=peer,
                collective_seq_id=e.collective_seq_id - base_c if e.collective_seq_id else 0,
                p2p_seq_id=e.p2p_seq_id - base_p if e.p2p_seq_id else 0,
                error=error if error and e.state != "completed" else e.error,
            )
        )
    identity = dict(summary.identity, launch_rank=launch_rank)
    return replace(
        summary,
        rank=rank,
        world_size=len(members),
        identity=identity,
        groups=groups,
        entries=entries,
        alive=True,
        stalled=True if (failure or stalled) else summary.stalled,
        taken_ns=time.time_ns(),
    )


def _rebase(seq: int, base: int) -> int:
    """A group's sequence id counted from the era's start (0: none in this era)."""
    return max(0, seq - base) if seq > 0 else seq


def summary_bytes(box_path: str, eras: Eras, launch_rank: int, **kw: object) -> bytes:
    return encode(local_summary(box_path, eras, launch_rank, **kw))  # type: ignore[arg-type]
