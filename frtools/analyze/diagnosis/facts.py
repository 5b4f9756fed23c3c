"""What the inputs establish about the job before any rule runs: who is present, who is
expected, how each rank ended, which groups have which members, whose completion marks
can be trusted. Gathered once per diagnosis, then only read.

Group membership (``membership``) is ``frtools.analyze.membership``'s: stated, recorded,
then inferred from sibling groups.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from frtools.analyze.align import Alignment
from frtools.analyze.membership import Membership, from_siblings
from frtools.analyze.readers.registry import capabilities
from frtools.model.trace import ABNORMAL_EXITS, DEFAULT_PG_DESC, ProcessGroup, Trace

from .device import DeviceLag, HostCall, counters, device_lags, host_calls, nccl_ranks

# A rank whose record was written (or whose heartbeat stopped) this much earlier than the
# others' is a stale record of a process that was already gone.
STALE_DUMP_NS = 60 * 1_000_000_000

# Words of a backend error raised because a peer went away or a collective failed, as
# opposed to the rank's own fault (an exception in user code, a CUDA error).
_COLLECTIVE_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "gloo",
    "nccl",
    "distbackenderror",
    "distnetworkerror",
    "timed out",
    "timeout",
    "watchdog",
    "process group",
    "processgroup",
)


def is_collective_error(text: str | None) -> bool:
    """Whether an error text is a collective failing on the rank (a victim's error)."""
    return bool(text) and any(word in str(text).lower() for word in _COLLECTIVE_ERRORS)


def counter_pair(st: object) -> tuple[int, int] | None:
    """A group's pg_status entry as (last enqueued, last completed), where both are known
    (-1: no counter, a summary's placeholder)."""
    if not isinstance(st, dict):
        return None
    enq, comp = st.get("last_enqueued_collective"), st.get("last_completed_collective")
    ok = type(enq) is int and type(comp) is int and enq >= 0 and comp >= 0
    return (enq, comp) if ok else None


class CompletionSource(enum.Enum):
    """Where a rank's "completed" marks come from, which says what they prove."""

    __hash__ = object.__hash__  # members are singletons: a C hash, not enum's by name

    STATES = "states"  # real per-op states (NCCL, frtools): completed means succeeded
    RETIRED = "retired"  # Gloo's FR: retired on success *and* on failure
    PG_STATUS = "pg_status"  # only the group counters
    NONE = "none"


@dataclass(frozen=True)
class Ending:
    """How a rank's process ended, as far as its record says."""

    kind: str | None  # RankInfo.exit_kind, or "gone" when only alive=False is known
    detail: str | None
    gone: bool  # the process is known not to run any more
    abnormal: bool  # it ended by a failure of its own (exit facts), not cleanly
    victim: bool  # it ended because a collective failed on it (a peer went away)


@dataclass(frozen=True)
class JobFacts:
    trace: Trace
    al: Alignment
    present: frozenset[int]
    expected: frozenset[int]
    absent: frozenset[int]
    wrapped: frozenset[int]
    membership: Membership
    world_certain: bool  # a file, a manifest or --world-size stated the world size
    endings: Mapping[int, Ending]
    stale: frozenset[int]
    completion: Mapping[int, CompletionSource]
    in_order: frozenset[int]  # CPU ranks: an op issued before a completed one completed
    # ranks whose completion marks are Gloo-like (retired, or frtools on a CPU) but whose
    # ops an NCCL engine recorded: one GPU stream per group, no order across groups
    on_gpu_streams: frozenset[int]
    status: Mapping[tuple[int, str], tuple[object, object, object]]
    oldest_ns: Mapping[int, int]
    dump_ns: Mapping[int, int]  # fresh dump times (in-flight judgement); empty if unusable
    has_completion_info: bool  # some entry says whether it completed
    # NCCL counters: ranks whose GPU stopped, ranks inside an NCCL host call (device.py)
    device_lags: Mapping[int, tuple[DeviceLag, ...]] = field(default_factory=dict)
    host_calls: Mapping[int, HostCall] = field(default_factory=dict)

    def members(self, pg_name: str) -> tuple[int, ...]:
        return tuple(self.membership.members.get(pg_name, ()))

    def listed(self, pg_name: str) -> bool:
        return pg_name in self.membership.listed

    def complete(self, pg_name: str) -> bool:
        """Every member of the group is known (listed, stated world, full sibling)."""
        return pg_name in self.membership.complete

    def ending(self, rank: int) -> Ending | None:
        return self.endings.get(rank)

    def gone(self, rank: int) -> bool:
        e = self.endings.get(rank)
        return e is not None and e.gone

    def process_group(self, pg_name: str) -> ProcessGroup:
        """The group as a report shows it: its listed members, or the inferred ones."""
        pg = self.al.process_groups.get(pg_name)
        members = self.members(pg_name)
        inferred = not self.listed(pg_name) or bool(self.membership.added.get(pg_name))
        if pg is None:
            return ProcessGroup(pg_name, "", members, True)
        if members and (not pg.ranks or tuple(pg.ranks) != members):
            return ProcessGroup(pg.name, pg.desc, members, inferred or pg.inferred)
        return pg

    def kind_of_group(self, pg_name: str) -> str:
        """Groups of one kind (same description and size) do the same thing at the same
        seq: a tie inside a group is broken by its siblings."""
        pg = self.al.process_groups.get(pg_name)
        desc = pg.desc if pg else ""
        size = len(self.members(pg_name))
        if desc and desc not in ("undefined", DEFAULT_PG_DESC):
            return f"{desc}/{size}"
        return f"{desc or 'group'}/{size}"


def gather_facts(trace: Trace, al: Alignment) -> JobFacts:
    coll, p2p = al.collectives, al.p2p
    present = set(int(r) for r in trace.ranks)
    if len(coll):
        present.update(coll["rank"].unique().tolist())
    if len(p2p):
        present.update(p2p["rank"].unique().tolist())
    listed = frozenset(
        name for name, pg in trace.process_groups.items() if pg.ranks and not pg.inferred
    )
    world_certain = _world_certain(trace, present)
    membership, expected = from_siblings(trace, al.members, present, listed, world_certain)
    absent = expected - present
    wrapped = frozenset(r for r, info in trace.ranks.items() if info.wrapped)
    endings = {r: _ending(info, coll, p2p) for r, info in trace.ranks.items()}
    endings = {r: e for r, e in endings.items() if e is not None}
    stale = _stale(trace)
    completion, completion_known = _completion_sources(trace, al)
    in_order = frozenset(
        r
        for r, info in trace.ranks.items()
        if (info.device or "").startswith("cpu") and completion.get(r) is CompletionSource.STATES
    )
    retired = {r for r, s in completion.items() if s is CompletionSource.RETIRED}
    on_gpu_streams = nccl_ranks(trace.entries, retired | set(in_order))
    times = [coll[["rank", "time_created_ns"]]]
    if len(p2p):
        times.append(p2p[["rank", "time_created_ns"]])
    oldest = pd.concat(times).groupby("rank")["time_created_ns"].min()
    dump_ns = {
        r: i.dump_time_ns
        for r, i in trace.ranks.items()
        if i.dump_time_ns and not i.stalled  # the recorder's watchdog saw a stall: not fresh
    }
    if any(e.gone for e in endings.values()):
        dump_ns = {}  # a member's process is gone: nothing it owes can still arrive
    counted = counters(al)  # pg_status counters, read once for both NCCL questions
    return JobFacts(
        trace=trace,
        al=al,
        present=frozenset(present),
        expected=frozenset(expected),
        absent=frozenset(absent),
        wrapped=wrapped,
        membership=membership,
        world_certain=world_certain,
        endings=endings,
        stale=stale,
        completion=completion,
        in_order=in_order,
        on_gpu_streams=on_gpu_streams,
        status=StatusTable(al.status),
        oldest_ns={int(r): int(t) for r, t in oldest.items()},
        dump_ns=dump_ns,
        has_completion_info=completion_known,
        device_lags=device_lags(trace, al, counted),
        host_calls=host_calls(trace, al, counted),
    )


class StatusTable(Mapping[tuple[int, str], tuple[object, object, object]]):
    """(rank, group) -> (first seq, last issued, last completed): ``al.status`` looked up
    where asked. The diagnosis asks about a few members; a dict of every row was ~400,000
    tuples at 131,072 ranks (1 s)."""

    def __init__(self, st: pd.DataFrame) -> None:
        self._st = st
        self._rows: tuple[np.ndarray, list, list, list, list] | None = None

    def _columns(self) -> tuple[np.ndarray, list, list, list, list]:
        if self._rows is None:
            st = self._st  # sorted by (rank, group): a rank's rows are one run
            self._rows = (
                st.index.get_level_values(0).to_numpy(),
                st.index.get_level_values(1).tolist(),
                st["first_seq"].tolist(),
                st["last_issued"].tolist(),
                st["last_completed"].tolist(),
            )
        return self._rows

    def __getitem__(self, key: tuple[int, str]) -> tuple[object, object, object]:
        rank, name = key
        ranks, names, first, issued, completed = self._columns()
        lo = int(np.searchsorted(ranks, rank, side="left"))
        hi = int(np.searchsorted(ranks, rank, side="right"))
        for i in range(hi - 1, lo - 1, -1):  # the last, as a dict of the rows would keep
            if names[i] == name:
                return first[i], issued[i], completed[i]
        raise KeyError(key)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        ranks, names, *_ = self._columns()
        return zip(ranks.tolist(), names, strict=True)

    def __len__(self) -> int:
        return len(self._st)


def _world_certain(trace: Trace, present: set[int]) -> bool:
    """Whether the world size comes from a statement (a listed default group, a file's
    header, a manifest, --world-size) rather than from the highest rank seen."""
    if trace.world_stated:
        return True
    listed = [pg for pg in trace.process_groups.values() if pg.ranks and not pg.inferred]
    if any(pg.is_default for pg in listed):
        return True
    if any(capabilities(info.format).states_world_size for info in trace.ranks.values()):
        return True  # a black box's header states the world size
    known = set(present) | {i.rank for i in trace.inputs if i.rank is not None}
    for pg in listed:
        known.update(pg.ranks)
    top = max(known) + 1 if known else 0
    return bool(trace.world_size and trace.world_size > top)


def _ending(info, coll: pd.DataFrame, p2p: pd.DataFrame) -> Ending | None:  # noqa: ANN001
    kind = info.exit_kind
    detail = info.exit_detail
    gone = info.alive is False or (kind is not None and kind != "running")
    if kind is None and not gone:
        return None
    own_error = _first_error(coll, info.rank) or _first_error(p2p, info.rank)
    victim = bool(own_error) or (kind == "exception" and is_collective_error(detail))
    abnormal = kind in ABNORMAL_EXITS and not victim
    return Ending(kind or ("gone" if gone else None), detail or own_error, gone, abnormal, victim)


def _first_error(frame: pd.DataFrame, rank: int) -> str | None:
    if not len(frame) or "error" not in frame.columns:
        return None
    errors = frame["error"]
    if not errors.notna().any():
        return None
    mine = frame.loc[(frame["rank"] == rank).to_numpy() & errors.notna().to_numpy(), "error"]
    return str(mine.iloc[0]) if len(mine) else None


def _stale(trace: Trace) -> frozenset[int]:
    """Ranks whose record (or last heartbeat) is much older than the others'."""
    seen = {
        r: (i.last_heartbeat_ns or i.dump_time_ns)
        for r, i in trace.ranks.items()
        if (i.last_heartbeat_ns or i.dump_time_ns)
    }
    if len(seen) < 2:
        return frozenset()
    ranks = np.fromiter(seen, dtype=np.int64, count=len(seen))
    times = np.fromiter(seen.values(), dtype=np.float64, count=len(seen))
    # the median of the others' times for every rank at once (131,072 ranks: one sort, not
    # a median per rank): without the value at sorted position k, the remaining n-1 values'
    # index j is s[j] below k and s[j + 1] from k on
    order = np.argsort(times, kind="stable")
    s = times[order]
    n = len(s)
    k = np.empty(n, dtype=np.int64)
    k[order] = np.arange(n)

    def kth(j: int) -> np.ndarray:
        return np.where(j < k, s[j], s[min(j + 1, n - 1)])

    others = (kth((n - 2) // 2) + kth((n - 1) // 2)) / 2
    return frozenset(ranks[others - times > STALE_DUMP_NS].tolist())


def _completion_sources(trace: Trace, al: Alignment) -> tuple[dict[int, CompletionSource], bool]:
    """Per rank, where its completion marks come from; and whether any entry says
    whether it completed at all."""
    coll, p2p = al.collectives, al.p2p
    known = bool(len(coll) and coll["completed"].notna().any()) or bool(
        len(p2p) and p2p["completed"].notna().any()
    )
    sources: dict[int, CompletionSource] = {}
    for r in trace.ranks:
        if al.state_informative.get(r):
            sources[r] = CompletionSource.STATES
    if len(coll):
        retired = coll["retired"].notna().to_numpy() & ~coll["informative"].to_numpy()
        for r in np.unique(coll["rank"].to_numpy()[retired]).tolist():
            sources.setdefault(int(r), CompletionSource.RETIRED)
    for r, info in trace.ranks.items():
        if r not in sources:
            sources[r] = CompletionSource.PG_STATUS if info.pg_status else CompletionSource.NONE
    return sources, known
