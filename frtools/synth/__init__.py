"""Simulated flight records of large jobs with one known, injected fault.

``synthesize`` builds a Megatron-style layout, the per-step collective schedule, places the
fault, runs the hang step to see who waits for whom, and writes every rank's dump plus
``truth.json`` (what a correct diagnosis must say). It needs neither torch nor GPUs, so the
analyzer can be measured for accuracy and speed at cluster scale.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .faults import FAULTS, VERDICT_KIND, FaultError, FaultPlan, plan_fault, simulate_hang
from .job import RANKS_PER_HOST, WriteParams, make_job
from .layout import GROUP_DESCS, Layout, LayoutError
from .schedule import ModelShape, Schedule, build_schedule
from .write import WRITERS, write_dumps

__all__ = [
    "FAULTS",
    "VERDICT_KIND",
    "FaultError",
    "Layout",
    "LayoutError",
    "ModelShape",
    "SynthResult",
    "synthesize",
]


@dataclass
class SynthResult:
    out_dir: Path
    truth: dict[str, Any]
    files: int
    bytes: int
    seconds: float


def _truth(
    schedule: Schedule, plan: FaultPlan, params: WriteParams, steps: int, n_entries: int
) -> dict[str, Any]:
    layout = schedule.layout
    truth: dict[str, Any] = {
        "fault": plan.fault,
        "kind": VERDICT_KIND[plan.fault],
        "guilty": list(plan.ranks),
        "process_group": None,
        "collective_seq_id": None,
        "p2p_seq_id": None,
        "op": None,
        "layout": layout.to_dict(),
        "steps": steps + 1,
        "buffer_size": params.buffer_size,
        "seed": params.seed,
        "entries_per_step": [len(p) for p in schedule.programs],
        "max_entries_per_rank": n_entries,
    }
    if plan.phase is not None and plan.ranks:
        ph = schedule.phases[plan.phase]
        r = plan.ranks[0]
        name, _ = layout.rank_group(ph.kind, r)
        truth["process_group"] = {"name": name, "desc": GROUP_DESCS[ph.kind]}
        truth["op"] = ph.op
        prog = schedule.program(layout.stage(r))
        pos = prog.phases.index(plan.phase)
        base = 1 if ph.kind == "world" else 0
        same_kind = [p for p in prog.phases[: pos + 1] if schedule.phases[p].kind == ph.kind]
        if ph.is_p2p:
            truth["p2p_seq_id"] = steps * prog.n_p2p.get(ph.kind, 0) + len(same_kind)
        else:
            truth["collective_seq_id"] = base + steps * prog.n_coll.get(ph.kind, 0) + len(same_kind)
    return truth


def synthesize(
    out_dir: str | Path,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    fault: str = "healthy",
    fault_ranks: list[int] | None = None,
    n_faulty: int = 1,
    seed: int = 0,
    buffer_size: int = 2000,
    steps: int = 0,
    shape: ModelShape | None = None,
    timing: bool = True,
    straggler_ms: float = 30.0,
    clock_skew_ms: float = 0.2,
    workers: int | None = None,
    format: str = "torch",
    window: int = 64,
) -> SynthResult:
    """Write a simulated job's dumps and ``truth.json`` into ``out_dir``.

    ``format``: ``"torch"`` writes PyTorch NCCL Flight Recorder pickles
    (``nccl_trace_rank_<R>``), ``"frtools"`` frtools snapshots (``rank_<R>.frt``),
    ``"summary"`` the host summaries ``frtools summarize`` would make of those snapshots
    (``node<H>.summary``, the last ``window`` ops per rank), without writing them."""
    if format not in WRITERS:
        raise ValueError(f"unknown format {format!r}: torch, frtools or summary")
    t_start = time.perf_counter()
    layout = Layout.from_sizes(world_size, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
    schedule = build_schedule(layout, shape)
    rng = np.random.default_rng(seed)
    # A placement can fail to hang the job (two ranks that swap their order in the same way
    # and are the only members of the group they swap with agree with each other): draw
    # again, or refuse the ranks the user gave. The first draw is kept whenever it hangs.
    for _ in range(50):
        plan = plan_fault(
            schedule, fault, fault_ranks, rng, n_faulty=n_faulty, straggler_ms=straggler_ms
        )
        outcome = simulate_hang(schedule, plan, rng)
        if not plan.hangs or bool((outcome.done < outcome.length).any()):
            break
        if fault_ranks:
            raise FaultError(
                f"{fault} on ranks {plan.ranks} does not hang this job (the faulty ranks only "
                "wait for each other); choose other ranks"
            )
    else:
        raise FaultError(f"could not place a {fault} fault that hangs this job")
    params = WriteParams(
        buffer_size=buffer_size,
        steps=steps,
        seed=seed,
        timing=timing,
        clock_skew_ms=clock_skew_ms,
        omit_ranks=set(plan.ranks) if fault == "dead" else set(),
        format=format,
        window=window,
    )
    job = make_job(schedule, plan, outcome, params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_entries = min(
        buffer_size,
        1 + job.steps * max(len(p) for p in schedule.programs) + int(outcome.issued.max()),
    )
    truth = _truth(schedule, plan, params, job.steps, n_entries)
    nbytes = write_dumps(job, out, workers=workers)
    (out / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    files = layout.world_size - len(params.omit_ranks)
    if format == "summary":  # one file per host that has a rank with a record
        kept = set(range(layout.world_size)) - params.omit_ranks
        files = len({r // RANKS_PER_HOST for r in kept})
    return SynthResult(out, truth, files, nbytes, time.perf_counter() - t_start)
