"""Injected faults, and what the rest of the job does about them.

A fault changes what one or two ranks call in the last step (the *hang step*). Who then
completes what is simulated, not guessed: a call completes when every member of its
group instance has it as its oldest incomplete call (calls complete in program order, as
a rank's stream and its data dependencies force). The calls a rank issued but that never
completed are ``started`` (the oldest: its kernel runs, waiting for peers) and
``scheduled`` (queued behind it; a rank's CPU runs ahead by 0-2 calls before it blocks).

Kinds and the verdict they should produce:

* ``missing``  - the rank stops calling (stuck in user code, alive, dumps): ``missing``.
* ``dead``     - the same, but the process is gone and left no dump: ``dead``. Its peers
  either block (NCCL: a dead GPU's peers are not told) or, half the time, fail (Gloo: the
  dead rank's connections close, the op blocked on it raises and is recorded *completed*,
  the survivor exits, and its own peers fail the same way): every rank's last op completed.
* ``mismatch-op/-size/-dtype`` - the rank calls a different op / shape / dtype at the same
  sequence id as its group: ``mismatch``.
* ``order``    - the rank calls the step's final default-group all-reduce *before* its
  previous call, while everyone else calls them the other way round: a cross-group
  deadlock: ``order``.
* ``stuck``    - every member calls the op, nobody completes it; on the faulty rank the
  kernel never even starts (its GPU is wedged in the kernel before): ``stuck``.
* ``straggler`` - nothing hangs; the rank calls every collective late: ``straggler``.

In every job with expert parallelism the hang step's token all_to_alls have per-rank sizes,
as a router makes them (MoE dispatch receives a different number of tokens on every rank):
what a collective needs to complete is decided by its op semantics
(``frtools.model.ops``), not by equal sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from frtools.model.ops import INPUT_DTYPES, INPUT_SIZES, OUTPUT_SIZES, family_of, semantics

from .schedule import COLL, RECV, SEND, Schedule

FAULTS = (
    "healthy",
    "missing",
    "dead",
    "mismatch-op",
    "mismatch-size",
    "mismatch-dtype",
    "order",
    "stuck",
    "straggler",
)

VERDICT_KIND = {
    "healthy": "healthy",
    "missing": "missing",
    "dead": "dead",
    "mismatch-op": "mismatch",
    "mismatch-size": "mismatch",
    "mismatch-dtype": "mismatch",
    "order": "order",
    "stuck": "stuck",
    "straggler": "straggler",
}

HANGS = {"missing", "dead", "mismatch-op", "mismatch-size", "mismatch-dtype", "order", "stuck"}

_OTHER_OP = {
    "all_reduce": "_all_gather_base",
    "_all_gather_base": "all_reduce",
    "_reduce_scatter_base": "all_reduce",
    "all_to_all": "all_reduce",
    "allreduce_coalesced": "all_reduce",
}
_OTHER_DTYPE = {"BFloat16": "Float", "Float": "BFloat16", "Half": "Float"}


class FaultError(ValueError):
    """The requested fault cannot be placed on this layout / these ranks."""


@dataclass
class Deviation:
    """How one faulty rank's hang-step program differs from its stage's program."""

    phases: list[int]
    roles: list[int]
    stop: int | None = None  # it issues nothing from this position on
    never_starts: int | None = None  # this call's kernel never starts
    override: dict[int, dict[str, Any]] = field(default_factory=dict)  # position -> fields
    # ^ a faulty call's fields, and per-rank fields every rank has (uneven all_to_all
    #   splits); a call whose override changes what its op requires to agree never completes


@dataclass
class FaultPlan:
    fault: str
    ranks: list[int]
    phase: int | None = None  # the faulty call's phase in the hang step
    deviations: dict[int, Deviation] = field(default_factory=dict)
    straggler_ms: float = 30.0
    peers_fail: bool = False  # dead: the peers' ops fail and are recorded completed (Gloo)

    @property
    def hangs(self) -> bool:
        return self.fault in HANGS


def participants(schedule: Schedule, phase: int) -> np.ndarray:
    """Global ranks that take part in a phase (all ranks of the stages involved)."""
    ph = schedule.phases[phase]
    stages = schedule.layout.stages()
    if ph.is_p2p:
        mask = (stages == ph.src_stage) | (stages == ph.dst_stage)
        return np.nonzero(mask)[0]
    return np.arange(schedule.layout.world_size)


def _position(schedule: Schedule, rank: int, phase: int) -> int:
    prog = schedule.program(schedule.layout.stage(rank))
    return prog.phases.index(phase)


def plan_fault(
    schedule: Schedule,
    fault: str,
    ranks: list[int] | None,
    rng: np.random.Generator,
    n_faulty: int = 1,
    straggler_ms: float = 30.0,
) -> FaultPlan:
    """Choose where the fault happens (the phase and, unless given, the ranks), and give
    every rank its own token splits in the hang step's all_to_alls."""
    plan = _plan_fault(schedule, fault, ranks, rng, n_faulty, straggler_ms)
    if fault == "dead":
        plan.peers_fail = bool(rng.random() < 0.5)
    _uneven_all_to_all(schedule, plan, rng)
    return plan


def _uneven_all_to_all(schedule: Schedule, plan: FaultPlan, rng: np.random.Generator) -> None:
    """Per-rank sizes of the hang step's token all_to_alls: dispatch sends the same number
    of tokens from every rank and receives what the router assigned to this rank's experts;
    combine sends them back. Each group's received counts add up to what it sent."""
    layout = schedule.layout
    phases = schedule.phases
    uneven = [p for p, ph in enumerate(phases) if ph.split and ph.op == "all_to_all"]
    if not uneven:
        return
    got: dict[tuple[int, int], int] = {}  # (phase, rank) -> tokens received by dispatch
    for p in uneven:
        ph = phases[p]
        sent = int(ph.input_sizes[0][0])
        for members in layout.members[ph.kind].tolist():
            n = len(members)
            share = rng.dirichlet(np.full(n, 4.0))
            counts = rng.multinomial(sent * n - n, share) + 1
            for m, c in zip(members, counts.tolist(), strict=True):
                got[(p, m)] = int(c)
    for rank in range(layout.world_size):
        dev = plan.deviations.get(rank)
        if dev is None:
            prog = schedule.program(layout.stage(rank))
            dev = Deviation(list(prog.phases), list(prog.roles))
        for pos, p in enumerate(dev.phases):
            if (p, rank) not in got:
                continue
            ph = phases[p]
            ov = dev.override.setdefault(pos, {})
            if "input_sizes" in ov or "op" in ov:
                continue  # the faulty call keeps its own fields
            rows = [got[(p, rank)], *ph.input_sizes[0][1:]]
            own = [list(ph.input_sizes[0])]
            if ph.split == "dispatch":
                ov["input_sizes"], ov["output_sizes"] = own, [rows]
            else:
                ov["input_sizes"], ov["output_sizes"] = [rows], own
        if dev.override or rank in plan.deviations:
            plan.deviations[rank] = dev


def must_agree_changed(phase: Any, fields: dict[str, Any]) -> bool:
    """Whether overriding ``phase``'s call with ``fields`` changes something its op requires
    to agree across members (so the call never completes)."""
    op = fields.get("op", phase.op)
    if family_of(op) is not family_of(phase.op):
        return True
    sem = semantics(op)
    if "dtype" in fields and fields["dtype"] != phase.dtype and sem.checks(INPUT_DTYPES):
        return True
    for key, attr, base in (
        ("input_sizes", INPUT_SIZES, phase.input_sizes),
        ("output_sizes", OUTPUT_SIZES, phase.output_sizes),
    ):
        changed = key in fields and [list(x) for x in fields[key]] != [list(x) for x in base]
        if changed and sem.checks(attr):
            return True
    return False


def _plan_fault(
    schedule: Schedule,
    fault: str,
    ranks: list[int] | None,
    rng: np.random.Generator,
    n_faulty: int = 1,
    straggler_ms: float = 30.0,
) -> FaultPlan:
    layout = schedule.layout
    n = layout.world_size
    if fault not in FAULTS:
        raise FaultError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    if ranks:
        bad = [r for r in ranks if not 0 <= r < n]
        if bad:
            raise FaultError(f"fault rank {bad[0]} is outside the world (0..{n - 1})")
        ranks = sorted(set(ranks))
    if fault == "healthy":
        return FaultPlan(fault, [])
    count = len(ranks) if ranks else n_faulty
    if fault == "straggler":
        if not ranks:
            ranks = sorted(int(r) for r in rng.choice(n, size=count, replace=False))
        return FaultPlan(fault, ranks, straggler_ms=straggler_ms)

    phases = schedule.phases
    if fault == "order":
        return _plan_order(schedule, ranks, rng, count)

    def eligible(p: int) -> bool:
        ph = phases[p]
        size = 2 if ph.is_p2p else layout.size(ph.kind)
        if fault == "mismatch-size" and not semantics(ph.op).checks(INPUT_SIZES):
            return False  # per-rank sizes are legal there (all_to_all)
        if fault.startswith("mismatch"):
            return not ph.is_p2p and size >= 3
        if fault == "stuck":
            return not ph.is_p2p
        return True

    candidates = [p for p in range(len(phases)) if eligible(p)]
    if ranks:
        members_ok = []
        for p in candidates:
            part = set(participants(schedule, p).tolist())
            if all(r in part for r in ranks) and _separable(schedule, fault, ranks, p):
                members_ok.append(p)
        candidates = members_ok
        if not candidates:
            raise FaultError(
                f"no call of the step fits a {fault} fault on ranks {ranks} "
                "(mismatches need a group of 3+ ranks; two faulty ranks in one group need 5+)"
            )
        phase = int(rng.choice(candidates))
    else:
        if not candidates:
            raise FaultError(f"this layout has no call that fits a {fault} fault")
        for _ in range(100):
            phase = int(rng.choice(candidates))
            part = participants(schedule, phase)
            ranks = sorted(
                int(r) for r in rng.choice(part, size=min(count, len(part)), replace=False)
            )
            if _separable(schedule, fault, ranks, phase):
                break
        else:
            raise FaultError(f"could not place {count} {fault} faults on this layout")

    plan = FaultPlan(fault, ranks, phase=phase)
    for r in ranks:
        prog = schedule.program(layout.stage(r))
        dev = Deviation(list(prog.phases), list(prog.roles))
        pos = _position(schedule, r, phase)
        if fault in ("missing", "dead"):
            dev.stop = pos
        elif fault == "stuck":
            dev.never_starts = pos
        else:
            dev.override[pos] = _mismatch_fields(schedule, fault, phase, rng)
        plan.deviations[r] = dev
    return plan


def _separable(schedule: Schedule, fault: str, ranks: list[int], phase: int) -> bool:
    """Two faulty ranks must leave their fault observable: a mismatch needs a majority."""
    if len(ranks) < 2 or not fault.startswith("mismatch"):
        return True
    layout = schedule.layout
    kind = schedule.phases[phase].kind
    groups = [int(layout.group_of[kind][r]) for r in ranks]
    if len(set(groups)) == len(groups):
        return True
    return layout.size(kind) >= 2 * len(ranks) + 1


def _mismatch_fields(
    schedule: Schedule, fault: str, phase: int, rng: np.random.Generator
) -> dict[str, Any]:
    ph = schedule.phases[phase]
    if fault == "mismatch-op":
        op = _OTHER_OP.get(ph.op, "all_reduce")
        ins = [list(ph.input_sizes[0])]
        outs = ins if op == "all_reduce" else [[ph.input_sizes[0][0] * 2, *ph.input_sizes[0][1:]]]
        return {"op": op, "input_sizes": ins, "output_sizes": outs, "site": "user_branch"}
    if fault == "mismatch-size":
        extra = int(rng.integers(1, 17))
        size = schedule.layout.size(ph.kind)
        grow_in = extra * size if ph.op == "_reduce_scatter_base" else extra
        grow_out = extra * size if ph.op == "_all_gather_base" else extra
        ins = [[s[0] + grow_in, *s[1:]] for s in ph.input_sizes]
        outs = [[s[0] + grow_out, *s[1:]] for s in ph.output_sizes]
        return {"input_sizes": ins, "output_sizes": outs, "site": "user_branch"}
    return {"dtype": _OTHER_DTYPE.get(ph.dtype, "Float"), "site": "user_branch"}


def _plan_order(
    schedule: Schedule, ranks: list[int] | None, rng: np.random.Generator, count: int
) -> FaultPlan:
    layout = schedule.layout
    world_phase = len(schedule.phases) - 1  # the step's last call: the default-group all-reduce
    if not ranks:
        ranks = sorted(int(r) for r in rng.choice(layout.world_size, size=count, replace=False))
    plan = FaultPlan("order", ranks, phase=world_phase)
    for r in ranks:
        prog = schedule.program(layout.stage(r))
        if len(prog) < 2:
            raise FaultError(f"rank {r} makes only one call per step; nothing to reorder")
        phases, roles = list(prog.phases), list(prog.roles)
        # swap the final default-group all-reduce with the call before it
        phases[-1], phases[-2] = phases[-2], phases[-1]
        roles[-1], roles[-2] = roles[-2], roles[-1]
        plan.deviations[r] = Deviation(phases, roles)
    return plan


@dataclass
class HangOutcome:
    """Per rank, after the hang step ran as far as it could."""

    done: np.ndarray  # calls of the hang step that completed
    issued: np.ndarray  # calls of the hang step that were issued (done <= issued)
    length: np.ndarray  # calls the rank's hang-step program has


def simulate_hang(schedule: Schedule, plan: FaultPlan, rng: np.random.Generator) -> HangOutcome:
    """Run the hang step: which calls complete, which are left waiting, on every rank."""
    layout = schedule.layout
    n = layout.world_size
    stages = layout.stages()
    lengths = np.array([len(schedule.program(int(s))) for s in stages], dtype=np.int64)
    if not plan.hangs:
        return HangOutcome(lengths.copy(), lengths.copy(), lengths)

    phases = schedule.phases
    stage_phases = [p.phases for p in schedule.programs]
    devs = plan.deviations
    group_of = {k: v.tolist() for k, v in layout.group_of.items()}
    members_cache: dict[str, list[list[int]]] = {}

    def members_of(kind: str) -> list[list[int]]:
        if kind not in members_cache:
            members_cache[kind] = layout.members[kind].tolist()
        return members_cache[kind]

    stage_list = stages.tolist()
    limit = lengths.copy()
    poisoned: set[tuple[int, int]] = set()
    for r, dev in devs.items():
        if dev.stop is not None:
            limit[r] = dev.stop
        bad = [
            pos
            for pos, ov in dev.override.items()
            if must_agree_changed(phases[dev.phases[pos]], ov)
        ]
        if dev.never_starts is not None:
            bad.append(dev.never_starts)
        for pos in bad:
            p = dev.phases[pos]
            poisoned.add((p, group_of[phases[p].kind][r]))
    limit_list = limit.tolist()

    def prog_of(r: int) -> list[int]:
        dev = devs.get(r)
        return dev.phases if dev is not None else stage_phases[stage_list[r]]

    def key_at(r: int, i: int) -> tuple[int, int]:
        p = prog_of(r)[i]
        return p, group_of[phases[p].kind][r]

    def instance_members(key: tuple[int, int]) -> list[int]:
        p, g = key
        ph = phases[p]
        row = members_of(ph.kind)[g]
        if ph.is_p2p:
            return [row[ph.src_stage], row[ph.dst_stage]]
        return row

    def instance_size(key: tuple[int, int]) -> int:
        ph = phases[key[0]]
        return 2 if ph.is_p2p else layout.size(ph.kind)

    pos = [0] * n
    count: dict[tuple[int, int], int] = {}
    ready: list[tuple[int, int]] = []

    def arrive(r: int) -> None:
        i = pos[r]
        if i >= limit_list[r]:
            return
        key = key_at(r, i)
        c = count.get(key, 0) + 1
        count[key] = c
        if c == instance_size(key) and key not in poisoned:
            ready.append(key)

    for r in range(n):
        arrive(r)
    while ready:
        key = ready.pop()
        for m in instance_members(key):
            pos[m] += 1
            arrive(m)

    done = np.array(pos, dtype=np.int64)
    if plan.peers_fail:
        # Gloo: the dead rank's connections close; every op blocked on it (and, as the
        # survivors exit, every op blocked on them) raises and is recorded completed; a
        # rank that raised issues nothing more.
        failing = done < limit
        dead = [r for r, dev in devs.items() if dev.stop is not None]
        failing[dead] = False
        done = np.where(failing, done + 1, done)
        return HangOutcome(done, done.copy(), lengths)
    ahead = rng.integers(0, 3, size=n)
    issued = np.minimum(limit, done + 1 + ahead)
    issued = np.maximum(issued, done)
    return HangOutcome(done, issued, lengths)


def roles_of(schedule: Schedule, plan: FaultPlan, rank: int) -> tuple[list[int], list[int]]:
    dev = plan.deviations.get(rank)
    if dev is not None:
        return dev.phases, dev.roles
    prog = schedule.program(schedule.layout.stage(rank))
    return prog.phases, prog.roles


__all__ = [
    "COLL",
    "FAULTS",
    "HANGS",
    "RECV",
    "SEND",
    "VERDICT_KIND",
    "Deviation",
    "FaultError",
    "FaultPlan",
    "HangOutcome",
    "participants",
    "plan_fault",
    "roles_of",
    "simulate_hang",
]
