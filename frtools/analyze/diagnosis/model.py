"""The diagnosis' vocabulary: verdict kinds, wait-for graph points and member states, the
reasons a rank is blamed, findings, and the named confidence levels. Plain data: the rules
build it, the wording module turns it into text."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from functools import cached_property

import pandas as pd

from .facts import Ending


class VerdictKind(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: a C hash, not enum's by name

    HEALTHY = "healthy"
    MISSING = "missing"
    DEAD = "dead"
    MISMATCH = "mismatch"
    ORDER = "order"
    STUCK = "stuck"
    STRAGGLER = "straggler"
    INCONCLUSIVE = "inconclusive"


class PointKind(enum.Enum):
    __hash__ = object.__hash__

    COLLECTIVE = "collective"  # (group, collective_seq_id)
    P2P = "p2p"  # (group, sender, receiver, k-th of the pair)


@dataclass(frozen=True)
class PointKey:
    kind: PointKind
    pg_name: str
    _: KW_ONLY
    seq: int = 0
    sender: int = -1
    receiver: int = -1
    index: int = -1


class MemberState(enum.Enum):
    """What a member of a point's group did about the op, as the blocked ranks see it."""

    __hash__ = object.__hash__

    ISSUED = "issued"  # issued it, agreeing on what must agree
    MINORITY = "minority"  # issued it with an attribute that must agree set otherwise
    MISSING = "missing"  # its record covers the op and it never issued it
    ABSENT = "absent"  # no usable record at all
    NO_RECORD = "no_record"  # absent, while a present rank already explains the wait
    UNKNOWN = "unknown"  # its record does not reach back (ring buffer wrapped)
    BUSY = "busy"  # issued it, but is blocked in an older op of its own
    GONE = "gone"  # issued it, then its process ended before completing it


# Member states the blocked ranks wait for (edges of the wait-for graph).
TARGET_STATES = (MemberState.MISSING, MemberState.ABSENT, MemberState.MINORITY,
                 MemberState.BUSY, MemberState.GONE)  # fmt: skip


@dataclass(frozen=True, eq=False, kw_only=True)
class Point:
    """Where blocked ranks wait: one collective or one P2P transfer, with what each member
    of its group did there."""

    key: PointKey
    op: str | None
    time_ns: int
    members: Mapping[MemberState, tuple[int, ...]]
    blockers: tuple[int, ...] = ()
    rows: pd.DataFrame | None = None  # the members' entries at this point
    p2p_index: int | None = None
    mismatch_attrs: tuple[str, ...] = ()  # attributes that must agree and do not
    tie: bool = False  # the majority was a tie inside the group
    unseen: int = 0  # members the dumps do not name (a group short of its siblings' size)
    completed: tuple[int, ...] = ()  # members whose entry here says completed
    failed: tuple[int, ...] = ()  # members whose entry here failed (or "completed" without
    # every member: Gloo retires a failed op)

    def of(self, state: MemberState) -> tuple[int, ...]:
        return self.members.get(state, ())

    @property
    def is_collective(self) -> bool:
        return self.key.kind is PointKind.COLLECTIVE

    @property
    def pg_name(self) -> str:
        return self.key.pg_name

    @property
    def seq(self) -> int | None:
        return self.key.seq if self.is_collective else None

    @property
    def issued(self) -> tuple[int, ...]:
        return self.of(MemberState.ISSUED)

    @cached_property  # asked per blocked rank: a set, not the tuple scanned each time
    def minority(self) -> frozenset[int]:
        return frozenset(self.of(MemberState.MINORITY))

    @cached_property  # asked per waiting rank: 131,072 times at fleet scale
    def targets(self) -> frozenset[int]:
        out: set[int] = set()
        for state in TARGET_STATES:
            out.update(self.of(state))
        return frozenset(out)


class Reason(enum.Enum):
    """Why a rank is blamed; the wording module says it in words."""

    __hash__ = object.__hash__

    ABSENT = "absent"  # no usable record, and ranks wait for it
    GONE = "gone"  # its process ended (or its record is stale) before the op
    MISMATCH = "mismatch"  # issued the op with an attribute that must agree set otherwise
    MISSING = "missing"  # alive, never issued the op its peers wait in
    SKIPPED = "skipped"  # its next call took the seq of a collective it skipped
    ORDER = "order"  # entered an op of another group first (a cross-group cycle)
    STUCK = "stuck"  # issued an op that completed on no member
    NEVER_STARTED = "never_started"  # issued the stuck op but never started it
    DEVICE_STOPPED = "device_stopped"  # ops its peers completed never completed on it (GPU)
    IN_HOST_CALL = "in_host_call"  # its entry is past last_enqueued: inside the NCCL call
    UNLISTED_MEMBER = "unlisted_member"  # no record; its group's members are not listed
    STRAGGLER = "straggler"
    ENDED = "ended"  # its process ended by a failure of its own; nobody recorded waiting
    NO_DUMP = "no_dump"  # no record, and nothing recorded waits for it
    DISAGREES = "disagrees"  # a mismatch in collectives that did not hang
    NEVER_ARRIVED = "never_arrived"  # never called init_process_group while peers wait in it
    SPLITS = "splits"  # its all_to_all split sizes disagree with its peers', pair by pair


# The strongest root reason decides the verdict kind (docs/verdict.md "Priority").
ROOT_REASON_RANK = {Reason.ABSENT: 0, Reason.GONE: 0, Reason.MISMATCH: 1, Reason.MISSING: 2}
ROOT_KIND = {
    Reason.ABSENT: VerdictKind.DEAD,
    Reason.GONE: VerdictKind.DEAD,
    Reason.MISMATCH: VerdictKind.MISMATCH,
    Reason.MISSING: VerdictKind.MISSING,
}


@dataclass(frozen=True)
class Blame:
    """A rank and why it is blamed; the rest by keyword (which point, ending, ...)."""

    rank: int
    reason: Reason
    _: KW_ONLY
    point: Point | None = None
    ending: Ending | None = None  # how its process ended, where that is the reason
    stale: bool = False
    others: tuple[Point, ...] = ()  # ORDER: the ops its peers wait in
    deviation: str | None = None  # ORDER: "skip" or "order" when its own order stands out
    lateness: tuple[float, float, int] | None = None  # STRAGGLER: share, median ns, count


class NoteKind(enum.Enum):
    """One line of evidence; the wording module writes it."""

    BLOCKED = "blocked"  # point: its blockers and whom they wait for
    ALSO_CYCLE = "also_cycle"  # ranks: a wait cycle besides the verdict's roots
    CYCLE_CORE = "cycle_core"  # ranks that wait for each other
    WHOLE_CYCLE = "whole_cycle"  # no rank's order stands out
    STUCK_OPS = "stuck_ops"  # count
    DISAGREEING_OPS = "disagreeing_ops"  # count
    STRAGGLER_RULE = "straggler_rule"
    NOBODY_WAITS = "nobody_waits"  # the verdict rests on a missing dump alone
    UNLISTED_GROUP = "unlisted_group"  # point, ranks: membership inferred from the files
    PLACED_MEMBER = "placed_member"  # point, ranks: absent ranks placed in a short group
    BEYOND_FILES = "beyond_files"  # ranks, groups: ranks no file names, short groups reveal
    FAILED_COMPLETION = "failed_completion"  # point, ranks: left it with an error/"completed"
    SPLIT_COMPLETION = "split_completion"  # point, ranks pending, others completed
    ALL_PENDING = "all_pending"  # point: every rank with a record issued it, none completed
    UNSEEN_MEMBERS = "unseen_members"  # point, count: members no file names
    WRAPPED_MEMBERS = "wrapped_members"  # point, ranks: records that do not reach back
    UNRECORDED_OP = "unrecorded_op"  # ranks, groups: an op pg_status counts, no entry shows
    NO_OPS = "no_ops"  # no rank recorded any op
    ENDINGS = "endings"  # ranks whose processes ended by a failure of their own
    VICTIMS = "victims"  # ranks whose op failed because a peer went away
    CASUALTIES = "casualties"  # point, ranks: issued the mismatched op as agreed, then ended
    IN_FLIGHT = "in_flight"  # count: ops every member issued, still running
    DEVICE_LAGS = "device_lags"  # ranks: completion counters behind a peer's, per group
    HOST_CALL = "host_call"  # ranks: an entry past last_enqueued (inside the NCCL call)
    RERAISED = "reraised"  # ranks re-raised the error of ``others`` (the ranks it names)
    STARTUP_WAIT = "startup_wait"  # ranks, groups=(phase,): waiting inside init_process_group
    SPLIT_PAIR = "split_pair"  # point, ranks=(sender, receiver), values=(sent, expected)
    SPLIT_TIE = "split_tie"  # ranks: as many disagreeing peers each; the records cannot choose


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    _: KW_ONLY
    point: Point | None = None
    ranks: tuple[int, ...] = ()
    others: tuple[int, ...] = ()
    count: int = 0
    groups: tuple[str, ...] = ()
    values: tuple[int, ...] = ()  # SPLIT_PAIR: elements sent, elements expected


class Decide(enum.Enum):
    """What would settle an inconclusive (or weakly supported) verdict."""

    WORLD_SIZE = "world_size"
    MISSING_DUMPS = "missing_dumps"
    MEMBERSHIP = "membership"
    LATER_DUMP = "later_dump"
    P2P_RECORDS = "p2p_records"
    LARGER_BUFFER = "larger_buffer"
    ANY_RECORD = "any_record"


class Confidence:
    """Named confidence levels (docs/verdict.md "Confidence"): plain constants, so two
    levels with one value stay two names (an Enum would make them aliases)."""

    DEAD = 0.9
    MISMATCH = 0.9
    MISSING = 0.85
    MISMATCH_TIE = 0.6  # the majority inside the group was a tie
    ORDER_DEVIANT = 0.75  # the reordered ranks stand out from their peers' history
    ORDER_WHOLE_CYCLE = 0.5
    STUCK_NEVER_STARTED = 0.7
    STUCK_DEVICE = 0.8  # peers completed all-member ops the guilty ranks never saw end
    STUCK_ALL_MEMBERS = 0.6
    STUCK_WITHOUT_STATES = 0.5  # only Gloo's retired flags say it did not complete
    DEAD_UNLISTED_MEMBER = 0.6
    DEAD_ENDED = 0.7  # a process ended by its own failure; nobody recorded waiting
    DEAD_NO_DUMP = 0.5  # the verdict rests on a missing dump alone
    MISMATCH_NO_HANG = 0.7
    STRAGGLER = 0.75
    HEALTHY = 0.9
    HEALTHY_NO_COMPLETION = 0.6
    INCONCLUSIVE = 0.5
    # adjustments
    MIXED_KINDS = 0.1  # guilty ranks of several kinds
    UNEXPLAINED_ABSENT = 0.1  # ranks without a record that the verdict does not explain
    UNSEEN_SHARE = 0.4  # times the share of the job those unexplained ranks are
    PLACED_MEMBER = 0.1  # a guilty rank placed in its group by sibling inference
    FLOOR = 0.05
    CEILING = 1.0


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One rule's answer, before wording (keyword-only: seven fields invite a swap)."""

    kind: VerdictKind
    confidence: float
    blames: tuple[Blame, ...] = ()
    waiting: frozenset[int] = frozenset()
    point: Point | None = None
    notes: tuple[Note, ...] = ()
    decide: tuple[Decide, ...] = ()
    # HEALTHY: the records say which ops completed (the headline says so, or that they cannot)
    completion_info: bool = True
    # absent ranks this finding does not explain (confidence.settle: they cost confidence)
    unexplained: tuple[int, ...] = ()

    @property
    def guilty(self) -> tuple[int, ...]:
        return tuple(b.rank for b in self.blames)
