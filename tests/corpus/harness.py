"""Run one corpus case: a real multi-rank Gloo job with its fault, recorded one of two ways,
ended after a bounded time, its dumps in one directory ready for ``frtools analyze``.

* ``fr``: the job writes PyTorch's own Flight Recorder dumps in-process
  (``train.py --fr-dir``): at the end, on a collective error, or from its watchdog thread
  after ``FR_HANG_SECONDS`` without progress. A rank that died or holds the GIL writes none.
* ``frtools``: every rank runs under ``frtools run --dir REC --job-id corpus -- python
  train.py`` (the recorder on through the bootstrap ``sitecustomize``); when the job has
  ended or hung, ``frtools dump corpus --dir REC -o DUMPS`` collects it, as a user would.

A hang is seen from outside, as an on-call engineer sees it: once every rank is training
(its heartbeat file ``train.py --heartbeat-dir`` exists: set-up is over), no rank has made
progress for ``HANG_AFTER`` seconds. Then (fr) the in-process
watchdogs have already dumped, or (frtools) ``frtools dump`` collects the live job; then every
rank's process group is SIGKILLed. Every process is gone when ``run_case`` returns, whatever
happened (``tests/jobs.py``'s ``stop``), and ``JOB_LIMIT`` bounds the whole run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.corpus.cases import Case
from tests.jobs import free_port, rank_env, stop

REPO = Path(__file__).resolve().parent.parent.parent
TRAIN = Path(__file__).resolve().parent / "train.py"
JOB_ID = "corpus"

FR_HANG_SECONDS = 3.0  # train.py's Flight Recorder watchdog dumps after this long idle
FR_DUMP_GRACE = 6.0  # after a hang is seen, how long the harness waits for those dumps
HANG_AFTER = 4.5  # the harness calls the job hung after this long without any heartbeat
STALL_SECONDS = 2.0  # FRTOOLS_STALL_SECONDS: the recorder marks a stall (frtools recorder)
STARTUP_LIMIT = 90.0  # every rank must have started (torch imported) by then
# a case.startup_hang job: rendezvous and connect of 4 loaded ranks take seconds; longer is a hang
STARTUP_GRACE = 5.5
JOB_LIMIT = 150.0  # the whole job, start to kill
TEARDOWN_LIMIT = 20.0  # ranks past their training loop get this long to exit
DUMP_TIMEOUT = 5.0  # frtools dump --timeout
ANALYZE_TIMEOUT = 120.0


@dataclass
class CaseRun:
    """What one run of a case left: where its dumps are and how each rank ended."""

    case: str
    dumps: str
    ending: str  # "exited" (every rank ended by itself), "hung", "limit" (JOB_LIMIT)
    returncodes: dict[int, int | None]  # None: still running when the harness killed the job
    dumped_ranks: list[int]  # ranks with a file in ``dumps``
    wall_s: float
    dump_output: str = ""
    logs: dict[int, str] = field(default_factory=dict)

    def summary(self) -> str:
        rcs = ", ".join(f"{r}:{'killed' if c is None else c}" for r, c in self.returncodes.items())
        return f"{self.case}: {self.ending} after {self.wall_s:.1f}s; rc {rcs}; dumps {self.dumped_ranks}"

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- rank {r}\n{log[-chars:]}" for r, log in self.logs.items())


def train_args(case: Case, fr_dir: Path | None, hb: Path) -> list[str]:
    args = [
        str(TRAIN),
        "--shape",
        case.shape,
        "--fault",
        case.fault,
        "--fault-rank",
        str(case.fault_rank if case.fault_rank is not None else -1),
        "--fault-step",
        str(case.fault_step),
        "--fault-at",
        case.fault_at,
        "--linger-on-error",
        str(case.linger_on_error),
        "--steps",
        str(case.steps),
        "--heartbeat-dir",
        str(hb),
        "--hang-seconds",
        str(FR_HANG_SECONDS),
    ]
    if fr_dir is not None:
        args += ["--fr-dir", str(fr_dir)]
    return args


def _frtools(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
    )


def _env() -> dict[str, str]:
    """This worktree's frtools first on the path, for every process the harness starts."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *parts])
    return env


def _idle(procs: list[subprocess.Popen], hb: Path) -> float:
    """Seconds since any rank last made progress (its heartbeat file), while some live rank
    is still training; 0 while a rank has not started, or when every live rank is past its
    training loop (tearing down, or blocked in the final barrier)."""
    training = [
        r for r, p in enumerate(procs) if p.poll() is None and not (hb / f"rank_{r}.done").exists()
    ]
    if not training:
        return 0.0
    freshest = 0.0
    for rank in range(len(procs)):
        try:
            freshest = max(freshest, (hb / f"rank_{rank}.hb").stat().st_mtime)
        except FileNotFoundError:
            if rank in training:
                return 0.0  # not started yet
    return time.time() - freshest if freshest else 0.0


def _stuck_in_startup(procs: list[subprocess.Popen], hb: Path) -> bool:
    """Every rank is past its set-up (``rank_<R>.up``), none training, the last one for
    ``HANG_AFTER`` + ``STARTUP_GRACE`` seconds: the job hangs in ``init_process_group``."""
    ups = [hb / f"rank_{r}.up" for r in range(len(procs))]
    if any((hb / f"rank_{r}.hb").exists() for r in range(len(procs))):
        return False
    try:
        latest = max(p.stat().st_mtime for p in ups)
    except FileNotFoundError:
        return False
    return time.time() - latest > HANG_AFTER + STARTUP_GRACE


def _ask_for_stacks(procs: list[subprocess.Popen]) -> None:
    """SIGUSR1: train.py's faulthandler writes every thread's stack into the rank's log."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)


def run_case(case: Case, work: Path) -> CaseRun:
    """Run ``case`` in ``work`` (created); its dumps end in ``work/dumps``."""
    work.mkdir(parents=True, exist_ok=True)
    dumps, hb, rec = work / "dumps", work / "hb", work / "rec"
    fr = case.recorder == "fr"
    argv = [sys.executable, *train_args(case, dumps if fr else None, hb)]
    if not fr:
        argv = [
            sys.executable,
            "-m",
            "frtools",
            "run",
            "--dir",
            str(rec),
            "--job-id",
            JOB_ID,
            "--stall-seconds",
            str(STALL_SECONDS),
            "--",
            *argv,
        ]
    port = free_port()
    base = _env()
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    ending = "limit"
    dump_output = ""
    teardown = 0.0
    try:
        for rank in range(case.ranks):
            env = rank_env(rank, case.ranks, port)
            env["PYTHONPATH"] = base["PYTHONPATH"]
            log = open(work / f"rank_{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        while time.monotonic() - t0 < JOB_LIMIT:
            time.sleep(0.1)
            if all(p.poll() is not None for p in procs):
                ending = "exited"
                break
            if case.startup_hang and _stuck_in_startup(procs, hb):
                ending = "hung"
                break
            started = all(p.poll() is not None or (hb / f"rank_{r}.hb").exists()
                          for r, p in enumerate(procs))  # fmt: skip
            if not started and time.monotonic() - t0 > STARTUP_LIMIT:
                break
            if started and _idle(procs, hb) > HANG_AFTER:
                ending = "hung"
                break
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            if all((hb / f"rank_{r}.done").exists() for r in alive):
                teardown = teardown or time.monotonic()
                if time.monotonic() - teardown > TEARDOWN_LIMIT:
                    ending = "exited"  # stuck on the way out: ended for our purpose
                    break
        if fr and ending == "hung":
            # the in-process watchdogs dump after FR_HANG_SECONDS; give the slow ones time
            # (a rank holding the GIL never will)
            deadline = time.monotonic() + FR_DUMP_GRACE
            while time.monotonic() < deadline and not all(
                p.poll() is not None or (dumps / f"rank_{r}.pkl").exists()
                for r, p in enumerate(procs)
            ):
                time.sleep(0.1)
        if not fr and ending != "limit":
            # the user's move: collect the job's black boxes (live ones answer with stacks)
            res = _frtools(
                "dump", JOB_ID, "--dir", str(rec), "--timeout", str(DUMP_TIMEOUT),
                "-o", str(dumps), timeout=60,
            )  # fmt: skip
            dump_output = res.stdout + res.stderr
    finally:
        killed = [r for r, p in enumerate(procs) if p.poll() is None]
        if ending != "exited":
            _ask_for_stacks([p for r, p in enumerate(procs)
                             if r in killed and not (hb / f"rank_{r}.done").exists()])  # fmt: skip
        stop(procs)
        for log in logs:
            log.close()
    wall = time.monotonic() - t0
    returncodes = {r: (None if r in killed else p.returncode) for r, p in enumerate(procs)}
    suffix = ".pkl" if fr else ".frt"
    dumped = sorted(
        int(p.name[len("rank_") : -len(suffix)]) for p in dumps.glob(f"rank_*{suffix}")
    ) if dumps.is_dir() else []  # fmt: skip
    run = CaseRun(
        case=case.id,
        dumps=str(dumps),
        ending=ending,
        returncodes=returncodes,
        dumped_ranks=dumped,
        wall_s=wall,
        dump_output=dump_output,
        logs={r: (work / f"rank_{r}.log").read_text(errors="replace") for r in range(case.ranks)},
    )
    (work / "run.json").write_text(json.dumps(asdict(run), indent=1))
    return run


def analyze(dumps: Path | str, *args: str) -> tuple[int, dict | None, str]:
    """``frtools analyze DUMPS --format json`` as a user runs it: exit code, report, stderr."""
    proc = _frtools("analyze", str(dumps), "--format", "json", *args, timeout=ANALYZE_TIMEOUT)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = None
    return proc.returncode, report, proc.stderr + ("" if report else proc.stdout[-2000:])
