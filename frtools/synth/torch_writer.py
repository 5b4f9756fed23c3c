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
    return "[" + ", ".join(str(int(r)) for r in ranks) + "]"


def rank_dump(job: Job, rank: int) -> dict[str, Any]:
    """The dict PyTorch would pickle for ``rank``."""
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

    # per kind: (pg_name, desc) and whether a straggler shares the group
    pg_tuple: dict[str, tuple[str, str]] = {}
    pg_members: dict[str, Any] = {}
    for kind in ("world", *CREATION_ORDER):
        name, members = layout.rank_group(kind, rank)
        pg_tuple[kind] = (name, GROUP_DESCS[kind])
        pg_members[kind] = members
    stragglers = job.stragglers
    straggle_ns = int(job.plan.straggler_ms * 1e6)
    slowed: dict[str, bool] = {}
    if stragglers:
        for kind, members in pg_members.items():
            slowed[kind] = any(int(m) in stragglers for m in members)
    i_am_straggler = rank in stragglers

    rng = np.random.default_rng((params.seed, rank))
    n = total - lo
    jitter = rng.integers(0, 300_000, size=n).tolist()
    launch = rng.integers(8_000, 40_000, size=n).tolist()
    discover = rng.integers(100_000, 3_000_000, size=n).tolist()
    late = (rng.uniform(0.5, 1.5, size=n) * straggle_ns).astype(np.int64).tolist()
    skew = int(job.host_skew_ns[rank // RANKS_PER_HOST])
    thread_id = str(139_800_000_000_000 + rank * 4096)
    step_ns = schedule.step_ns
    timing = params.timing
    n_coll = job.n_coll[stage]
    n_p2p = job.n_p2p[stage]
    base_coll = {"world": 1}

    entries: list[dict[str, Any]] = []
    # last enqueued / started / completed collective per kind, for pg_status
    status: dict[str, list[int]] = {}
    for k, count in n_coll.items():
        status[k] = [0, 0, 0]
        del count
    for k in n_p2p:
        status.setdefault(k, [0, 0, 0])
    status.setdefault("world", [1, 1, 1])

    for j, rec in enumerate(range(lo, total)):
        if rec == 0:
            kind = "world"
            slot = None
            step = -1
            pos = 0
            created = T0_NS - 5_000_000_000 + skew + jitter[j]
            coll_seq, p2p_seq = 1, 0
            state = "completed"
            complete_ns = T0_NS - 5_000_000_000 + 2_000_000
        else:
            step, pos = divmod(rec - 1, L)
            hang = step >= K
            if hang:
                step, pos = K, rec - 1 - K * L
                slot = hang_slots[pos]
            else:
                slot = slots[pos]
            kind = slot.kind
            nominal = T0_NS + step * step_ns + slot.offset_ns
            created = nominal + skew + jitter[j]
            if i_am_straggler:
                created += late[j]
            coll_seq = base_coll.get(kind, 0) + step * n_coll.get(kind, 0) + slot.coll_count
            p2p_seq = step * n_p2p.get(kind, 0) + slot.p2p_count
            if hang and pos >= done:
                state = "scheduled" if pos > done or pos == never_starts else "started"
                complete_ns = 0
            else:
                state = "completed"
                delay = 0
                if stragglers:
                    if slot.is_p2p:
                        peer = int(pg_members["pp"][slot.peer_stage])
                        if peer in stragglers or i_am_straggler:
                            delay = straggle_ns * 3 // 2
                    elif slowed.get(kind):
                        delay = straggle_ns * 3 // 2
                complete_ns = nominal + skew + 300_000 + delay + slot.duration_ns
        st = status.get(kind)
        if st is not None and (slot is None or not slot.is_p2p):
            st[0] = max(st[0], coll_seq)
            if state != "scheduled":
                st[1] = max(st[1], coll_seq)
            if state == "completed":
                st[2] = max(st[2], coll_seq)
        started_ns = created + launch[j] if state != "scheduled" else None
        entry: dict[str, Any] = {
            "frames": slot.frames if slot is not None else CALL_SITES["init_barrier"],
            "record_id": rec,
            "pg_id": PG_ID[kind],
            "process_group": pg_tuple[kind],
            "thread_name": "python",
            "thread_id": thread_id,
            "collective_seq_id": coll_seq,
            "p2p_seq_id": p2p_seq,
            "op_id": coll_seq + p2p_seq,
            "profiling_name": slot.profiling_name
            if slot is not None
            else "nccl:all_reduce_barrier",
            "time_created_ns": created,
        }
        if state == "completed" and timing:
            entry["duration_ms"] = max(0.001, (complete_ns - started_ns) / 1e6)
        entry["input_sizes"] = slot.input_sizes if slot is not None else [[1]]
        entry["input_dtypes"] = slot.input_dtypes if slot is not None else ["Float"]
        entry["output_sizes"] = slot.output_sizes if slot is not None else [[1]]
        entry["output_dtypes"] = slot.output_dtypes if slot is not None else ["Float"]
        entry["state"] = state
        entry["time_discovered_started_ns"] = started_ns
        entry["time_discovered_completed_ns"] = (
            complete_ns + discover[j] if state == "completed" else None
        )
        entry["retired"] = state == "completed"
        entry["timeout_ms"] = TIMEOUT_MS
        entry["is_p2p"] = slot.is_p2p if slot is not None else False
        entries.append(entry)

    pg_config: dict[str, dict[str, str]] = {}
    for kind in ("world", *CREATION_ORDER):
        name, desc = pg_tuple[kind]
        pg_config[name] = {"name": name, "desc": desc, "ranks": _pg_ranks_str(pg_members[kind])}
    pg_config = dict(sorted(pg_config.items()))
    pg_status = {}
    for kind in sorted(status, key=lambda k: PG_ID[k]):
        e, s, c = status[kind]
        pg_status[str(PG_ID[kind])] = {
            "last_enqueued_collective": e,
            "last_started_collective": s,
            "last_completed_collective": c,
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
