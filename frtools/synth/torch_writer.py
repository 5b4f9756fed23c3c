"""Write each rank's flight record as PyTorch's NCCL Flight Recorder writes it.

Schema of torch 2.13's ``FlightRecorder::dump`` (version ``"2.10"``): ``version``,
``pg_config`` (name -> name/desc/ranks string), ``comm_lib_version``, ``pg_status`` (by the
group's process-local uid), ``entries`` (oldest first; ``record_id`` counts every call the
rank made, so a wrapped ring buffer starts at a high id). Files are named like PyTorch's
default ``TORCH_FR_DUMP_TEMP_FILE`` (``nccl_trace_rank_<R>``), which is also what
``torchfrtrace`` expects (a common prefix followed by the rank).

Each rank's entries are filled from per-stage templates (the static fields of every
position of the step), so writing thousands of ranks is dominated by pickling; ranks are
written by a pool of forked workers.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .faults import FaultPlan, HangOutcome
from .layout import CREATION_ORDER, GROUP_DESCS, Layout
from .schedule import CALL_SITES, COLL, SEND, Schedule

VERSION = "2.10"
COMM_LIB_VERSION = "2.27.5"
DEFAULT_PREFIX = "nccl_trace_rank_"
T0_NS = 1_795_960_800_000_000_000  # 2026-11-29 12:00:00 UTC
TIMEOUT_MS = 600_000
RANKS_PER_HOST = 8

# the rank-local uid PyTorch gives each ProcessGroupNCCL: creation order on this rank
PG_ID = {"world": 0, **{kind: i + 1 for i, kind in enumerate(CREATION_ORDER)}}


@dataclass
class WriteParams:
    buffer_size: int = 2000
    steps: int = 0  # complete steps before the last one (0: enough to wrap the buffer)
    seed: int = 0
    timing: bool = True  # TORCH_NCCL_ENABLE_TIMING: completed calls carry duration_ms
    clock_skew_ms: float = 0.2
    prefix: str = DEFAULT_PREFIX
    format: str = "torch"  # "torch": PyTorch FR pickles; "frtools": frtools snapshots
    omit_ranks: set[int] = field(default_factory=set)  # ranks that leave no dump


@dataclass
class _Slot:
    """The static part of one position of a program."""

    kind: str
    role: int
    profiling_name: str
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
    peer_stage: int  # P2P: the other stage


def _slots(
    schedule: Schedule,
    phases: list[int],
    roles: list[int],
    override: dict[int, dict[str, Any]] | None = None,
) -> list[_Slot]:
    override = override or {}
    out: list[_Slot] = []
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
            name = f"nccl:{op}"
            site = ov.get("site", ph.site)
            peer_stage = -1
        else:
            p2p[kind] = p2p.get(kind, 0) + 1
            if role == SEND:
                name = f"nccl:send {ph.src_stage}->{ph.dst_stage}"
                site, peer_stage = ph.site, ph.dst_stage
            else:
                name = f"nccl:recv {ph.dst_stage}<-{ph.src_stage}"
                site, peer_stage = ph.recv_site, ph.src_stage
        ins = ov.get("input_sizes", [list(s) for s in ph.input_sizes])
        outs = ov.get("output_sizes", [list(s) for s in ph.output_sizes])
        dtype = ov.get("dtype", ph.dtype)
        out.append(
            _Slot(
                kind=kind,
                role=role,
                profiling_name=name,
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
                peer_stage=peer_stage,
            )
        )
    return out


@dataclass
class Job:
    """Everything a worker needs to write any rank (shared with forked workers)."""

    schedule: Schedule
    plan: FaultPlan
    outcome: HangOutcome
    params: WriteParams
    steps: int
    stage_slots: list[list[_Slot]]
    n_coll: list[dict[str, int]]  # per stage
    n_p2p: list[dict[str, int]]
    stragglers: frozenset[int]
    host_skew_ns: np.ndarray

    @property
    def layout(self) -> Layout:
        return self.schedule.layout


def make_job(schedule: Schedule, plan: FaultPlan, outcome: HangOutcome, params: WriteParams) -> Job:
    stage_slots = [_slots(schedule, p.phases, p.roles) for p in schedule.programs]
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


def _pg_ranks_str(ranks: Any) -> str:
    return "[" + ", ".join(map(str, np.asarray(ranks).tolist())) + "]"


_WORLD_RANKS_STR: dict[int, str] = {}

_ENTRY_KEYS = (
    "frames",
    "record_id",
    "pg_id",
    "process_group",
    "thread_name",
    "thread_id",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "time_created_ns",
    "duration_ms",
    "input_sizes",
    "input_dtypes",
    "output_sizes",
    "output_dtypes",
    "state",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "retired",
    "timeout_ms",
    "is_p2p",
)


def _template(
    slot: _Slot | None, pg: tuple[str, str], thread_id: str, timing: bool
) -> dict[str, Any]:
    """An entry with every static field filled, keys in PyTorch's order."""
    if slot is None:  # the init barrier
        static = {
            "frames": CALL_SITES["init_barrier"],
            "pg_id": 0,
            "profiling_name": "nccl:all_reduce_barrier",
            "input_sizes": [[1]],
            "input_dtypes": ["Float"],
            "output_sizes": [[1]],
            "output_dtypes": ["Float"],
            "is_p2p": False,
        }
    else:
        static = {
            "frames": slot.frames,
            "pg_id": PG_ID[slot.kind],
            "profiling_name": slot.profiling_name,
            "input_sizes": slot.input_sizes,
            "input_dtypes": slot.input_dtypes,
            "output_sizes": slot.output_sizes,
            "output_dtypes": slot.output_dtypes,
            "is_p2p": slot.is_p2p,
        }
    entry = dict.fromkeys(_ENTRY_KEYS)
    entry.update(static)
    entry["process_group"] = pg
    entry["thread_name"] = "python"
    entry["thread_id"] = thread_id
    entry["timeout_ms"] = TIMEOUT_MS
    if not timing:
        del entry["duration_ms"]
    return entry


@dataclass
class RankArrays:
    """One rank's window of records as arrays (shared by the pickle and snapshot writers)."""

    rank: int
    slots: list[_Slot]  # the stage program
    hang_slots: list[_Slot]  # this rank's program in the last step
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
    hang_slots = _slots(schedule, dev.phases, dev.roles, dev.override) if dev is not None else slots
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

    def slot_arrays(sl: list[_Slot]) -> dict[str, np.ndarray]:
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


def rank_dump(job: Job, rank: int) -> dict[str, Any]:
    """The dict PyTorch would pickle for ``rank``."""
    a = rank_arrays(job, rank)
    layout = job.layout
    timing = job.params.timing
    slots, hang_slots = a.slots, a.hang_slots
    pg_tuple, pg_members, status = a.pg_tuple, a.pg_members, a.status
    skew = a.skew
    recs, in_hang, pos, coll_seq, p2p_seq = a.recs, a.in_hang, a.pos, a.coll_seq, a.p2p_seq
    created, state, started, discovered, duration = (
        a.created,
        a.state,
        a.started,
        a.discovered,
        a.duration,
    )
    thread_id = str(139_800_000_000_000 + rank * 4096)
    tmpl_regular = [_template(x, pg_tuple[x.kind], thread_id, timing) for x in slots]
    tmpl_hang = (
        tmpl_regular
        if hang_slots is slots
        else [_template(x, pg_tuple[x.kind], thread_id, timing) for x in hang_slots]
    )

    entries: list[dict[str, Any]] = []
    if a.barrier:
        e = _template(None, pg_tuple["world"], thread_id, timing)
        t = T0_NS - 5_000_000_000 + skew
        e.update(
            record_id=0,
            collective_seq_id=1,
            p2p_seq_id=0,
            op_id=1,
            time_created_ns=t,
            state="completed",
            time_discovered_started_ns=t + 20_000,
            time_discovered_completed_ns=t + 2_000_000,
            retired=True,
        )
        if timing:
            e["duration_ms"] = 1.98
        entries.append(e)
    STATES = ("completed", "started", "scheduled")
    for rec, h, p, cs, ps, cr, st, sn, dc, du in zip(
        recs.tolist(),
        in_hang.tolist(),
        pos.tolist(),
        coll_seq.tolist(),
        p2p_seq.tolist(),
        created.tolist(),
        state.tolist(),
        started.tolist(),
        discovered.tolist(),
        duration.tolist(),
        strict=True,
    ):
        e = (tmpl_hang if h else tmpl_regular)[p].copy()
        e["record_id"] = rec
        e["collective_seq_id"] = cs
        e["p2p_seq_id"] = ps
        e["op_id"] = cs + ps
        e["time_created_ns"] = cr
        e["state"] = STATES[st]
        if st == 0:
            if timing:
                e["duration_ms"] = du
            e["time_discovered_started_ns"] = sn
            e["time_discovered_completed_ns"] = dc
            e["retired"] = True
        else:
            if timing:
                del e["duration_ms"]
            e["time_discovered_started_ns"] = sn if st == 1 else None
            e["retired"] = False
        entries.append(e)

    pg_config: dict[str, dict[str, str]] = {}
    for kind in ("world", *CREATION_ORDER):
        name, desc = pg_tuple[kind]
        if kind == "world":
            ranks_str = _WORLD_RANKS_STR.get(layout.world_size)
            if ranks_str is None:
                ranks_str = _WORLD_RANKS_STR[layout.world_size] = _pg_ranks_str(pg_members[kind])
        else:
            ranks_str = _pg_ranks_str(pg_members[kind])
        pg_config[name] = {"name": name, "desc": desc, "ranks": ranks_str}
    pg_config = dict(sorted(pg_config.items()))
    pg_status = {}
    for kind in sorted(status, key=lambda k: PG_ID[k]):
        e_, s_, c_ = status[kind]
        pg_status[str(PG_ID[kind])] = {
            "last_enqueued_collective": e_,
            "last_started_collective": s_,
            "last_completed_collective": c_,
        }
    return {
        "version": VERSION,
        "pg_config": pg_config,
        "comm_lib_version": COMM_LIB_VERSION,
        "pg_status": pg_status,
        "entries": entries,
    }


# set in the parent before forking the pool; workers read it
_JOB: Job | None = None
_OUT: Path | None = None


def _write_ranks(ranks: list[int]) -> int:
    assert _JOB is not None and _OUT is not None
    written = 0
    if _JOB.params.format == "frtools":
        from .snapshot_writer import rank_snapshot

        for r in ranks:
            data = rank_snapshot(_JOB, r)
            (_OUT / f"rank_{r}.frt").write_bytes(data)
            written += len(data)
        return written
    for r in ranks:
        data = pickle.dumps(rank_dump(_JOB, r), protocol=2)
        (_OUT / f"{_JOB.params.prefix}{r}").write_bytes(data)
        written += len(data)
    return written


def write_dumps(job: Job, out_dir: Path, workers: int | None = None) -> int:
    """Write every rank's dump (but the omitted ones) into ``out_dir``; returns bytes."""
    global _JOB, _OUT
    ranks = [r for r in range(job.layout.world_size) if r not in job.params.omit_ranks]
    workers = workers or min(os.cpu_count() or 1, 16)
    _JOB, _OUT = job, out_dir
    try:
        if workers <= 1 or len(ranks) < 32:
            return _write_ranks(ranks)
        import multiprocessing as mp

        chunk = max(1, min(64, len(ranks) // (workers * 4)))
        chunks = [ranks[i : i + chunk] for i in range(0, len(ranks), chunk)]
        ctx = mp.get_context("fork")
        with ctx.Pool(workers) as pool:
            return sum(pool.imap_unordered(_write_ranks, chunks))
    finally:
        _JOB, _OUT = None, None
