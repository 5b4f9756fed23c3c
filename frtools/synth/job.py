"""The simulated job the writers write: which records each rank holds at the hang.

``make_job`` turns a schedule, a placed fault and its hang outcome into a ``Job``: per
pipeline stage, the static part of every position of a training step (``Slot``);
``rank_arrays`` computes one rank's window of the ring buffer (record ids, sequence ids,
times, states, group status) as numpy arrays. The writers (``torch_writer``: PyTorch
Flight Recorder pickles; ``snapshot_writer``: frtools snapshots) lay the same window out in
their formats; this module knows neither format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from frtools.formats.torch_fr import DUMP_FILE_PREFIX

from .faults import FaultPlan, HangOutcome
from .layout import CREATION_ORDER, GROUP_DESCS, Layout
from .schedule import CALL_SITES, COLL, SEND, Schedule

BACKEND = "nccl"  # the simulated job's process-group backend
COMM_LIB_VERSION = "2.27.5"  # its NCCL version
T0_NS = 1_795_960_800_000_000_000  # 2026-11-29 12:00:00 UTC
RANKS_PER_HOST = 8


@dataclass
class WriteParams:
    buffer_size: int = 2000
    steps: int = 0  # complete steps before the last one (0: enough to wrap the buffer)
    seed: int = 0
    timing: bool = True  # TORCH_NCCL_ENABLE_TIMING: completed calls carry duration_ms
    clock_skew_ms: float = 0.2
    prefix: str = DUMP_FILE_PREFIX  # torch: file name = prefix + rank
    format: str = "torch"  # "torch": PyTorch FR pickles; "frtools": frtools snapshots;
    # "summary": packed host summaries of the last ``window`` ops per rank
    window: int = 64
    omit_ranks: set[int] = field(default_factory=set)  # ranks that leave no dump


@dataclass
class Slot:
    """The static part of one position of a program."""

    kind: str
    role: int
    op: str  # "all_reduce", "send", "recv" ...
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    input_dtypes: list[str]
    output_dtypes: list[str]
    frames: list[dict[str, object]]
    is_p2p: bool
    offset_ns: int
    duration_ns: int
    coll_count: int  # collectives of this kind so far in the step, this one included
    p2p_count: int
    stage: int  # P2P: this side's stage (its rank in the pipeline group); -1 otherwise
    peer_stage: int  # P2P: the other stage


def program_slots(
    schedule: Schedule,
    phases: list[int],
    roles: list[int],
    override: dict[int, dict[str, Any]] | None = None,
) -> list[Slot]:
    override = override or {}
    out: list[Slot] = []
    coll: dict[str, int] = {}
    p2p: dict[str, int] = {}
    offsets = sorted(schedule.phases[p].offset_ns for p in phases)
    for i, (p, role) in enumerate(zip(phases, roles, strict=True)):
        ph = schedule.phases[p]
        ov = override.get(i, {})
        kind = ph.kind
        if role == COLL:
            coll[kind] = coll.get(kind, 0) + 1
            op = ov.get("op", ph.op)
            site = ov.get("site", ph.site)
            stage = peer_stage = -1
        else:
            p2p[kind] = p2p.get(kind, 0) + 1
            if role == SEND:
                op, site, stage, peer_stage = "send", ph.site, ph.src_stage, ph.dst_stage
            else:
                op, site, stage, peer_stage = "recv", ph.recv_site, ph.dst_stage, ph.src_stage
        ins = ov.get("input_sizes", [list(s) for s in ph.input_sizes])
        outs = ov.get("output_sizes", [list(s) for s in ph.output_sizes])
        dtype = ov.get("dtype", ph.dtype)
        out.append(
            Slot(
                kind=kind,
                role=role,
                op=op,
                input_sizes=ins,
                output_sizes=outs,
                input_dtypes=[dtype] * len(ins),
                output_dtypes=[dtype] * len(outs),
                frames=CALL_SITES[site],
                is_p2p=role != COLL,
                offset_ns=offsets[i],
                duration_ns=ph.duration_ns,
                coll_count=coll.get(kind, 0),
                p2p_count=p2p.get(kind, 0),
                stage=stage,
                peer_stage=peer_stage,
            )
        )
    return out


# record 0 of every rank: the barrier ``init_process_group`` ends with (on the world group)
INIT_BARRIER = Slot(
    kind="world",
    role=COLL,
    op="all_reduce_barrier",
    input_sizes=[[1]],
    output_sizes=[[1]],
    input_dtypes=["Float"],
    output_dtypes=["Float"],
    frames=CALL_SITES["init_barrier"],
    is_p2p=False,
    offset_ns=0,
    duration_ns=0,
    coll_count=1,
    p2p_count=0,
    stage=-1,
    peer_stage=-1,
)


def init_barrier_times(skew_ns: int) -> tuple[int, int, int, float]:
    """Created, started and completed ns and duration_ms of the init barrier (completed
    long before the hang)."""
    t = T0_NS - 5_000_000_000 + skew_ns
    return t, t + 20_000, t + 2_000_000, 1.98


@dataclass
class Job:
    """Everything a worker needs to write any rank (shared with forked workers)."""

    schedule: Schedule
    plan: FaultPlan
    outcome: HangOutcome
    params: WriteParams
    steps: int
    stage_slots: list[list[Slot]]
    n_coll: list[dict[str, int]]  # per stage
    n_p2p: list[dict[str, int]]
    stragglers: frozenset[int]
    host_skew_ns: np.ndarray

    @property
    def layout(self) -> Layout:
        return self.schedule.layout


def make_job(schedule: Schedule, plan: FaultPlan, outcome: HangOutcome, params: WriteParams) -> Job:
    stage_slots = [program_slots(schedule, p.phases, p.roles) for p in schedule.programs]
    steps = params.steps
    if steps <= 0:
        shortest = min(len(p) for p in schedule.programs)
        steps = -(-params.buffer_size * 5 // 4 // max(1, shortest)) + 1  # wraps the buffer
    rng = np.random.default_rng(params.seed + 7)
    n_hosts = -(-schedule.layout.world_size // RANKS_PER_HOST)
    skew = (rng.uniform(-1, 1, n_hosts) * params.clock_skew_ms * 1e6).astype(np.int64)
    return Job(
        schedule=schedule,
        plan=plan,
        outcome=outcome,
        params=params,
        steps=steps,
        stage_slots=stage_slots,
        n_coll=[dict(p.n_coll) for p in schedule.programs],
        n_p2p=[dict(p.n_p2p) for p in schedule.programs],
        stragglers=frozenset(plan.ranks) if plan.fault == "straggler" else frozenset(),
        host_skew_ns=skew,
    )


@dataclass
class RankArrays:
    """One rank's window of records as arrays (shared by the pickle and snapshot writers)."""

    rank: int
    slots: list[Slot]  # the stage program
    hang_slots: list[Slot]  # this rank's program in the last step
    pg_tuple: dict[str, tuple[str, str]]
    pg_members: dict[str, Any]
    barrier: bool  # record 0 (the init barrier) is still in the window
    skew: int
    total: int  # records ever written
    recs: np.ndarray
    in_hang: np.ndarray
    pos: np.ndarray
    coll_seq: np.ndarray
    p2p_seq: np.ndarray
    created: np.ndarray
    started: np.ndarray
    discovered: np.ndarray
    duration: np.ndarray
    state: np.ndarray  # 0 completed, 1 started, 2 scheduled
    status: dict[str, list[int]]  # kind -> last enqueued / started / completed collective


def rank_arrays(job: Job, rank: int) -> RankArrays:
    """Compute ``rank``'s window: which records, their sequence ids, times and states."""
    layout = job.layout
    schedule = job.schedule
    params = job.params
    stage = layout.stage(rank)
    slots = job.stage_slots[stage]
    L = len(slots)
    dev = job.plan.deviations.get(rank)
    hang_slots = (
        program_slots(schedule, dev.phases, dev.roles, dev.override) if dev is not None else slots
    )
    K = job.steps
    done = int(job.outcome.done[rank])
    issued = int(job.outcome.issued[rank])
    never_starts = dev.never_starts if dev is not None else None
    total = 1 + K * L + issued  # record 0: the init barrier
    lo = max(0, total - params.buffer_size)

    # per kind: (pg_name, desc), members, and whether a straggler shares the group
    pg_tuple: dict[str, tuple[str, str]] = {}
    pg_members: dict[str, Any] = {}
    for kind in ("world", *CREATION_ORDER):
        name, members = layout.rank_group(kind, rank)
        pg_tuple[kind] = (name, GROUP_DESCS[kind])
        pg_members[kind] = members
    stragglers = job.stragglers
    straggle_ns = int(job.plan.straggler_ms * 1e6)
    i_am_straggler = rank in stragglers

    def slot_arrays(sl: list[Slot]) -> dict[str, np.ndarray]:
        base = {"world": 1}
        n_coll = job.n_coll[stage]
        n_p2p = job.n_p2p[stage]
        slowed = []
        for x in sl:
            if not stragglers:
                slowed.append(False)
            elif x.is_p2p:
                peer = int(pg_members["pp"][x.peer_stage])
                slowed.append(i_am_straggler or peer in stragglers)
            else:
                slowed.append(any(int(m) in stragglers for m in pg_members[x.kind]))
        return {
            "offset": np.array([x.offset_ns for x in sl], dtype=np.int64),
            "duration": np.array([x.duration_ns for x in sl], dtype=np.int64),
            "coll0": np.array([base.get(x.kind, 0) + x.coll_count for x in sl], dtype=np.int64),
            "coll_step": np.array([n_coll.get(x.kind, 0) for x in sl], dtype=np.int64),
            "p2p0": np.array([x.p2p_count for x in sl], dtype=np.int64),
            "p2p_step": np.array([n_p2p.get(x.kind, 0) for x in sl], dtype=np.int64),
            "slowed": np.array(slowed, dtype=bool),
        }

    regular = slot_arrays(slots)
    hang = regular if hang_slots is slots else slot_arrays(hang_slots)

    recs = np.arange(max(lo, 1), total, dtype=np.int64)
    in_hang = recs > K * L
    step = np.where(in_hang, K, (recs - 1) // L)
    pos = np.where(in_hang, recs - 1 - K * L, (recs - 1) % L)

    def pick(key: str) -> np.ndarray:
        a, b = regular[key], hang[key]
        return np.where(in_hang, b[np.minimum(pos, len(b) - 1)], a[np.minimum(pos, len(a) - 1)])

    coll_seq = pick("coll0") + step * pick("coll_step")
    p2p_seq = pick("p2p0") + step * pick("p2p_step")
    nominal = T0_NS + step * schedule.step_ns + pick("offset")
    n = len(recs)
    rng = np.random.default_rng((params.seed, rank))
    skew = int(job.host_skew_ns[rank // RANKS_PER_HOST])
    created = nominal + skew + rng.integers(0, 300_000, size=n)
    if i_am_straggler:
        created += (rng.uniform(0.5, 1.5, size=n) * straggle_ns).astype(np.int64)
    started = created + rng.integers(8_000, 40_000, size=n)
    complete = nominal + skew + 300_000 + pick("duration")
    if stragglers:
        complete += np.where(pick("slowed"), straggle_ns * 3 // 2, 0)
    discovered = complete + rng.integers(100_000, 3_000_000, size=n)
    # 0 completed, 1 started, 2 scheduled
    state = np.where(in_hang & (pos >= done), np.where(pos > done, 2, 1), 0)
    if never_starts is not None:
        state = np.where(in_hang & (pos == never_starts) & (state == 1), 2, state)
    duration = np.maximum(0.001, (complete - started) / 1e6)

    # pg_status: the last enqueued / started / completed collective of each group
    status: dict[str, list[int]] = {"world": [0, 0, 0]}
    for k in list(job.n_coll[stage]) + list(job.n_p2p[stage]):
        status[k] = [0, 0, 0]
    for k in status:
        if k not in job.n_coll[stage]:
            continue
        before = (1 if k == "world" else 0) + K * job.n_coll[stage][k]
        vals = [before, before, before]
        for i, x in enumerate(hang_slots[:issued]):
            if x.kind != k or x.is_p2p:
                continue
            seq = before + x.coll_count
            vals[0] = max(vals[0], seq)
            if i < done or (i == done and i != never_starts):
                vals[1] = max(vals[1], seq)
            if i < done:
                vals[2] = max(vals[2], seq)
        status[k] = vals

    return RankArrays(
        rank=rank,
        slots=slots,
        hang_slots=hang_slots,
        pg_tuple=pg_tuple,
        pg_members=pg_members,
        barrier=lo == 0,
        skew=skew,
        total=total,
        recs=recs,
        in_hang=in_hang,
        pos=pos,
        coll_seq=coll_seq,
        p2p_seq=p2p_seq,
        created=created,
        started=started,
        discovered=discovered,
        duration=duration,
        state=state,
        status=status,
    )
