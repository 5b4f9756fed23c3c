"""The fault scenarios of ``faulty_job.py``: how to run each one and the verdict it must get.

Shared by ``scripts/make_sample_dumps.py`` (regenerates ``sample_dumps/``) and
``tests/test_scenarios.py`` (runs them and checks ``frtools analyze``). Importing this module
does not import torch: the jobs run as subprocesses through ``tests/jobs.py``.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
FAULTY_JOB = REPO / "examples" / "faulty_job.py"
WORLD = (0, 1, 2, 3)


@dataclass(frozen=True)
class Scenario:
    """One dump set: the fault injected and the verdict ``frtools analyze`` owes it."""

    case: str  # directory name under sample_dumps/
    fault: str  # faulty_job.py --fault
    rank: int | None  # the faulty rank (None: healthy)
    kinds: tuple[str, ...]  # acceptable verdict kinds, the preferred one first
    guilty: tuple[int, ...]  # exact guilty rank set
    groups: tuple[tuple[int, ...], ...] | None  # acceptable process groups (member ranks);
    # None: not checked (a straggler is late everywhere)
    what: str  # one line for the README
    fault_at: str = "loss"  # faulty_job.py --fault-at
    stacks: bool = False  # faulty_job.py --stacks: rank_<R>.stacks next to each dump
    fr_buffer: int | None = None  # TORCH_FR_BUFFER_SIZE (None: faulty_job.py's 2000)

    @property
    def exit_code(self) -> int:
        return 0 if self.kinds == ("healthy",) else 1


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("healthy", "none", None, ("healthy",), (), None, "no fault; every rank completes"),
    Scenario(
        "missing",
        "compute",
        1,
        ("missing",),
        (1,),
        (WORLD,),
        "rank 1 hangs in compute (time.sleep) before the step-2 loss all_reduce on the world "
        "group; ranks 0, 2, 3 wait in it",
    ),
    Scenario(
        "missing-chain",
        "compute",
        1,
        ("missing",),
        (1,),
        ((0, 1), (1, 3)),
        "rank 1 hangs in compute at the start of step 2: rank 0 waits for it on "
        "tensor-parallel [0, 1], rank 3 on data-parallel [1, 3], and rank 2 waits on "
        "data-parallel [0, 2] for rank 0, a victim (rank 0 must not be blamed)",
        fault_at="forward",
    ),
    Scenario(
        "missing-stacks",
        "compute",
        1,
        ("missing",),
        (1,),
        (WORLD,),
        "the 'missing' fault with each rank's Python stacks (faulthandler, written by the "
        "watchdog thread) in rank_<R>.stacks: rank 1's main thread sleeps in stall()",
        stacks=True,
    ),
    Scenario(
        "missing-wrapped",
        "compute",
        1,
        ("missing",),
        (1,),
        (WORLD,),
        "the 'missing' fault with TORCH_FR_BUFFER_SIZE=4: every ring buffer dropped older "
        "entries, and rank 1's keeps no world-group op at all (only its pg_status says it "
        "stopped at world collective #2)",
        fr_buffer=4,
    ),
    Scenario(
        "skipped",
        "skip",
        2,
        ("mismatch", "missing"),
        (2,),
        ((2, 3),),
        "rank 2 skips the step-2 tensor-parallel all_reduce; its next TP op (all_gather) meets "
        "rank 3's all_reduce at the same collective_seq_id and both hang; ranks 0, 1 wait in "
        "their data-parallel all_reduce",
    ),
    Scenario(
        "dead",
        "exit",
        2,
        ("dead",),
        (2,),
        (WORLD,),
        "rank 2 exits (status 1, no dump) before the step-2 loss all_reduce; a forked child "
        "keeps its Gloo sockets open, so ranks 0, 1, 3 block in that all_reduce as NCCL peers "
        "of a dead GPU rank would, until their watchdogs dump. (Not rank 3: a Gloo dump "
        "states no world size, so a missing highest rank is invisible)",
    ),
    Scenario(
        "dead-partner",
        "exit",
        2,
        ("dead",),
        (2,),
        None,  # the group shows as [3]: Gloo dumps do not list members (checked in the test)
        "rank 2 exits (no dump, sockets kept open) at the start of step 2's forward; its "
        "tensor-parallel partner rank 3 blocks in the TP all_reduce and rank 1 waits for "
        "rank 3. No Gloo dump lists group members, so TP group [2, 3] looks like [3] and the "
        "op looks stuck on its only member; the absent rank is named dead (60%)",
        fault_at="forward",
    ),
    Scenario(
        "order",
        "order",
        1,
        ("order",),
        (1,),
        ((1, 3), WORLD),
        "rank 1 issues the world loss all_reduce before the data-parallel gradient all_reduce, "
        "its peers the other way round: rank 1 waits for rank 3 on the world group, rank 3 "
        "for rank 1 on data-parallel [1, 3]",
    ),
    Scenario(
        "size-mismatch",
        "size",
        2,
        ("mismatch",),
        (2,),
        (WORLD,),
        "rank 2 passes a [16] buffer to the step-2 world broadcast, its peers [8]; Gloo "
        "completes it silently and the job finishes",
    ),
    Scenario(
        "op-mismatch",
        "op",
        3,
        ("mismatch",),
        (3,),
        (WORLD,),
        "rank 3 calls broadcast where its peers call the step-2 loss all_reduce (world "
        "group); all hang",
    ),
    Scenario(
        "straggler",
        "late",
        2,
        ("straggler",),
        (2,),
        None,
        "rank 2 sleeps 80 ms before every collective; the job completes",
    ),
)

# A hang case with damaged inputs: the analyzer must still answer and list the bad files.
DAMAGED_FROM = "missing"
DAMAGED_TRUNCATED = 0  # rank whose dump is cut to half its length
DAMAGED_REMOVED = 2  # rank whose dump is deleted
DAMAGED = Scenario(
    "damaged",
    "compute",
    1,
    ("missing",),
    (1,),
    (WORLD,),
    f"the 'missing' set with rank_{DAMAGED_TRUNCATED}.pkl truncated, "
    f"rank_{DAMAGED_REMOVED}.pkl removed and a README.txt added",
)

BY_CASE = {s.case: s for s in (*SCENARIOS, DAMAGED)}

# Job parameters shared by the sample dumps and the tests.
STEPS = 3
FAULT_STEP = 2
HANG_SECONDS = 4.0
JOB_TIMEOUT = 90.0


_import_lock = threading.Lock()


def _jobs_module() -> ModuleType:
    """``tests/jobs.py``, the one launcher of real multi-process jobs, imported by path
    (under a lock: scenarios run from several threads)."""
    with _import_lock:
        return _import_jobs()


def _import_jobs() -> ModuleType:
    name = "frtools_test_jobs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "jobs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_scenario(scenario: Scenario, out: Path, timeout: float = JOB_TIMEOUT):  # noqa: ANN201
    """Run the 4-rank job with the scenario's fault; dumps land in ``out/rank_<R>.pkl``.

    Returns ``tests/jobs.py``'s ``JobResult`` (every process is gone when it returns)."""
    jobs = _jobs_module()
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "--fault",
        scenario.fault,
        "--rank",
        str(scenario.rank if scenario.rank is not None else 0),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--fault-step",
        str(FAULT_STEP),
        "--hang-seconds",
        str(HANG_SECONDS),
        "--fault-at",
        scenario.fault_at,
        *(["--stacks"] if scenario.stacks else []),
    ]
    env = {"TORCH_FR_BUFFER_SIZE": str(scenario.fr_buffer)} if scenario.fr_buffer else None
    return jobs.run_job(
        FAULTY_JOB, world_size=len(WORLD), args=args, env=env, timeout=timeout, cwd=REPO
    )


def make_damaged(source: Path, out: Path) -> None:
    """Copy a dump set, then truncate one rank's file, remove another's, add a non-dump."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    truncated = out / f"rank_{DAMAGED_TRUNCATED}.pkl"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    (out / f"rank_{DAMAGED_REMOVED}.pkl").unlink()
    (out / "README.txt").write_text(
        "Not a dump: notes a user left next to the rank files.\n", encoding="utf-8"
    )


def generate(
    root: Path, scenarios: Iterable[Scenario] = SCENARIOS, parallel: int = 2
) -> dict[str, object]:
    """Run the scenarios ``parallel`` at a time into ``root/<case>/`` and build ``damaged``.

    Returns case -> JobResult."""
    scenarios = list(scenarios)
    root.mkdir(parents=True, exist_ok=True)
    for s in scenarios:
        if (root / s.case).exists():
            shutil.rmtree(root / s.case)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {s.case: pool.submit(run_scenario, s, root / s.case) for s in scenarios}
        results = {case: f.result() for case, f in futures.items()}
    for s in scenarios:
        for tmp in (root / s.case).glob(".*.tmp"):
            tmp.unlink()
    if DAMAGED_FROM in results:
        make_damaged(root / DAMAGED_FROM, root / DAMAGED.case)
    return results


def dumps_present(out: Path) -> set[int]:
    return {int(p.stem.split("_", 1)[1]) for p in out.glob("rank_*.pkl")}


def expected_dumps(scenario: Scenario) -> set[int]:
    """Ranks that must leave a dump: all but a rank that died."""
    if scenario.fault == "exit":
        return set(WORLD) - {scenario.rank}
    return set(WORLD)


def expected_returncodes(scenario: Scenario) -> dict[int, set[int]]:
    """Exit status each rank of ``faulty_job.py`` must end with in this scenario.

    A hang case must end by the watchdog (3) on every rank, a completing one with 0: anything
    else means the job did not do what the scenario says (e.g. a healthy rank timed out on an
    overloaded machine), and its dumps would not show the intended fault."""
    ok, died, hung = 0, 1, 3  # faulty_job.EXIT_OK, EXIT_DIED, EXIT_HUNG (EXIT_ERROR: 4)
    if scenario.fault in ("none", "size", "late"):
        return {r: {ok} for r in WORLD}
    if scenario.fault == "exit":
        # The dead rank's sockets stay open (faulty_job.die_keeping_sockets): the survivors
        # block until their watchdogs dump. A Gloo error (4) would mean its connections
        # closed, and the survivors' dumps may then show no pending op (the old flake).
        return {r: ({died} if r == scenario.rank else {hung}) for r in WORLD}
    return {r: {hung} for r in WORLD}


def unexpected_exits(scenario: Scenario, result) -> list[str]:  # noqa: ANN001
    """Ranks of a finished ``JobResult`` whose exit status the scenario does not expect."""
    want = expected_returncodes(scenario)
    return [
        f"rank {r.rank} exited {r.returncode}, expected {sorted(want[r.rank])}"
        for r in result.ranks
        if r.returncode not in want[r.rank]
    ]
