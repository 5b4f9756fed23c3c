"""Host summaries of a simulated job, straight from the job model (no black box written).

A fleet of 131,072 ranks would leave ~600 GB of black boxes; its host summaries are what
the central step reads. ``rank_summary`` computes, from the same window of records the
snapshot writer lays out (``job.rank_arrays``), the summary ``frtools summarize`` computes
from that rank's written box (``frtools.analyze.summarize.rank_summary`` after the snapshot
reader): the same groups, frontiers, kept ops, strings and facts, field by field
(tests/test_summaries.py checks it). ``host_bytes`` packs a host's ranks
(``formats.summary_packed``); ``write.write_dumps`` writes one file per host.
"""

from __future__ import annotations

import functools

import numpy as np

from frtools.formats.summary import (
    RankSummary,
    SummaryEntry,
    SummaryGroup,
    completed_ops,
    kept_positions,
)
from frtools.formats.summary_packed import DEFAULT_HOST_WINDOW, encode_packed, host_file_name

from .job import (
    COMM_LIB_VERSION,
    INIT_BARRIER,
    RANKS_PER_HOST,
    T0_NS,
    Job,
    Slot,
    WriteParams,
    init_barrier_times,
    rank_arrays,
)
from .snapshot_writer import GROUP_ROWS, _texts

# when the simulated summaries were taken (fixed: same seed, same bytes)
TAKEN_NS = T0_NS + 900_000_000_000
STATE_NAMES = ("completed", "started", "scheduled")  # rank_arrays' state codes 0, 1, 2


def host_name(rank: int) -> str:
    return f"node{rank // RANKS_PER_HOST:05d}"


def file_name(params: WriteParams, host: int) -> str:
    return host_file_name(f"node{host:05d}")


@functools.lru_cache(maxsize=1024)
def _call_site(stack: str) -> str:
    from frtools.model.trace import is_user_frame  # the snapshot reader's choice of frame

    lines = [line for line in stack.splitlines() if line]
    for line in lines:
        if is_user_frame(line.rsplit(" in ", 1)[0].rsplit(":", 1)[0]):
            return line
    return lines[0] if lines else ""


def _members(job: Job, kind: str, name: str, members: np.ndarray) -> tuple[int, ...]:
    """A group's member tuple, built once per job (the default group has every rank)."""
    cache = job.__dict__.setdefault("_summary_members", {})
    found = cache.get((kind, name))
    if found is None:
        found = cache[(kind, name)] = tuple(members.tolist())
    return found


def rank_summary(
    job: Job, rank: int, window: int = DEFAULT_HOST_WINDOW, taken_ns: int = TAKEN_NS
) -> RankSummary:
    """What ``frtools summarize`` makes of ``rank``'s black box, computed from the model."""
    a = rank_arrays(job, rank)
    timing = job.params.timing
    n = len(a.recs) + int(a.barrier)
    world = job.layout.world_size

    # the box's rows: [barrier] + the window's records; states 0 completed, 1, 2
    done = a.state == 0
    rows_state = np.concatenate([[0], a.state]) if a.barrier else a.state
    # the model's states are exact (its frontiers never say more than they do), and its
    # retired flags are its states: the keep rule asks only them
    kept = kept_positions(n, window, lambda older: completed_ops(rows_state[older] == 0))

    # the kinds the kept ops use (a group of this rank alone, unused, is left out, as
    # frtools summarize does)
    used_kinds = set()
    for k in kept.tolist():
        if a.barrier and k == 0:
            used_kinds.add(INIT_BARRIER.kind)
            continue
        i = k - int(a.barrier)
        program = a.hang_slots if a.in_hang[i] else a.slots
        used_kinds.add(program[min(int(a.pos[i]), len(program) - 1)].kind)
    names = []
    groups = []
    for kind in GROUP_ROWS:
        name, desc = a.pg_tuple[kind]
        members = a.pg_members[kind]
        if name in names or (kind not in used_kinds and len(members) == 1 and members[0] == rank):
            continue
        names.append(name)
        e, s, c = a.status.get(kind, (0, 0, 0))
        groups.append(
            SummaryGroup(name, desc, _members(job, kind, name, a.pg_members[kind]), e, s, c)
        )
    index = {name: i for i, name in enumerate(names)}
    row_of_kind = {k: index[a.pg_tuple[k][0]] for k in GROUP_ROWS if a.pg_tuple[k][0] in index}

    entries = []
    thread = str(100_000 + rank)
    for k in kept.tolist():
        if a.barrier and k == 0:
            slot: Slot = INIT_BARRIER
            created, started, completed, duration = init_barrier_times(a.skew)
            entries.append(
                _entry(slot, 0, row_of_kind, 1, 0, created, started, completed,
                       duration if timing else None, "completed", thread, a, rank)
            )  # fmt: skip
            continue
        i = k - int(a.barrier)
        pos = int(a.pos[i])
        program = a.hang_slots if a.in_hang[i] else a.slots
        slot = program[min(pos, len(program) - 1)]
        st = int(a.state[i])
        entries.append(
            _entry(
                slot,
                int(a.recs[i]),
                row_of_kind,
                int(a.coll_seq[i]),
                int(a.p2p_seq[i]),
                int(a.created[i]),
                int(a.started[i]) if st <= 1 else None,
                int(a.discovered[i]) if st == 0 else None,
                float(a.duration[i]) if (done[i] and timing) else None,
                STATE_NAMES[st],
                thread,
                a,
                rank,
            )
        )
    heartbeat = int(a.created.max()) + 600_000_000_000 if len(a.created) else T0_NS
    omitted = n - len(kept)
    return RankSummary(
        rank=rank,
        world_size=world,
        identity={
            "host": host_name(rank),
            "pid": 200_000 + rank,
            "local_rank": rank % RANKS_PER_HOST,
            "device": f"cuda:{rank % RANKS_PER_HOST}",
            "device_id": f"GPU-{rank:08x}-5f1c-4e2a-9d3b-{job.params.seed:012x}",
            "comm_lib_version": COMM_LIB_VERSION,
        },
        groups=groups,
        entries=entries,
        taken_ns=taken_ns,
        heartbeat_ns=None,
        stalled=bool((a.state != 0).any()),
        alive=None,
        wrapped=bool(a.total > job.params.buffer_size or not a.barrier or omitted > 0),
        records_written=a.total,
        omitted=omitted,
        dump_time_ns=heartbeat,
    )


def _entry(
    slot: Slot,
    record_id: int,
    row_of_kind: dict[str, int],
    coll_seq: int,
    p2p_seq: int,
    created: int,
    started: int | None,
    completed: int | None,
    duration: float | None,
    state: str,
    thread: str,
    a: object,
    rank: int,
) -> SummaryEntry:
    op, ins, outs, idt, odt, stack = _texts(slot)
    members = a.pg_members  # type: ignore[attr-defined]
    return SummaryEntry(
        record_id=record_id,
        group=row_of_kind[slot.kind],
        collective_seq_id=coll_seq,
        p2p_seq_id=p2p_seq,
        is_p2p=slot.is_p2p,
        op=op,
        peer=int(members["pp"][slot.peer_stage]) if slot.is_p2p else None,
        input_sizes=ins,
        output_sizes=outs,
        input_dtypes=idt,
        output_dtypes=odt,
        state=state,
        time_created_ns=created,
        time_started_ns=started,
        time_completed_ns=completed,
        duration_ms=duration,
        thread_id=thread,
        thread_name="python",
        stack=stack,
        error="",
        retired=1 if state == "completed" else 0,
        timeout_ms=None,
        call_site=_call_site(stack) if stack else "",
    )


def host_bytes(job: Job, host: int, window: int = DEFAULT_HOST_WINDOW) -> bytes:
    """The packed host summary of host ``host`` (its ranks that left a record)."""
    world = job.layout.world_size
    ranks = range(host * RANKS_PER_HOST, min(world, (host + 1) * RANKS_PER_HOST))
    summaries = [rank_summary(job, r, window) for r in ranks if r not in job.params.omit_ranks]
    return encode_packed(summaries, f"node{host:05d}", window=window)
