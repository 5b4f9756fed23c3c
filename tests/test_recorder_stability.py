"""Recording never hangs a job nor crashes it at exit (real Gloo jobs, recorder on).

Two failures seen only with the recorder on, each caught here:

* a hang: a recorded op issued with the GIL held (pybind11's trampoline runs the C++ base op
  under the GIL when the override calls ``super()``) deadlocks with a Gloo worker thread that
  frees a finished Work under its queue lock and needs the GIL to free the Work's tensors.
  Many short all-reduces on fresh tensors make the window wide: the old code hung on almost
  every run of ``_HAMMER``;
* exit code -6, "terminate called without an active exception": the recorder's daemon
  poller thread was still running Python while the interpreter finalized, and was killed
  inside a pybind11 destructor (the last reference to a Work or ProcessGroup) that had
  released the GIL.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from jobs import run_job

import frtools

DEMO_JOB = str(Path(frtools.__file__).resolve().parent / "commands" / "demo_job.py")

_HAMMER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import frtools.recorder as recorder

    recorder.enable()
    dist.init_process_group("gloo")
    for _ in range(int(sys.argv[1])):
        dist.all_reduce(torch.ones(4))  # a fresh tensor each time, freed while Gloo holds it
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()
    """
)

_THREADS_AT_EXIT = textwrap.dedent(
    """
    import atexit
    import threading
    import time
    import torch
    import torch.distributed as dist
    import frtools.recorder as recorder

    def report():  # atexit: runs after threading's shutdown hooks, before finalization
        # the threads that call into torch (a pybind11 call that releases the GIL must not
        # be under way when the interpreter finalizes)
        names = ("frtools-poller", "frtools-jobwide")
        alive = sorted(t.name for t in threading.enumerate() if t.name in names)
        print("recorder threads at exit:", alive, flush=True)

    atexit.register(report)
    recorder.enable()
    dist.init_process_group("gloo")
    for _ in range(5):
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    time.sleep(1.0)  # long enough for the job-wide watcher (when on) to be running
    dist.destroy_process_group()
    """
)


_NO_DESTROY = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import frtools.recorder as recorder

    recorder.enable()
    dist.init_process_group("gloo")
    sub = dist.new_group([0])
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4), group=sub)
    print("done", flush=True)  # no destroy_process_group: torch frees the groups at exit
    """
)


def _recorder_env(tmp_path: Path, job_id: str) -> dict[str, str]:
    return {
        "FRTOOLS_DIR": str(tmp_path / "frt"),
        "FRTOOLS_JOB_ID": job_id,
        "FRTOOLS_JOBWIDE": "0",
    }


def _assert_clean(result, what: str) -> None:
    assert not result.timed_out, f"{what}: ranks {result.timed_out} hung\n{result.output()}"
    for r in result.ranks:
        assert "terminate called" not in r.stderr, f"{what}: rank {r.rank} aborted\n{r.stderr}"
        assert r.returncode == 0, f"{what}: rank {r.rank} exit {r.returncode}\n{r.stderr}"


@pytest.mark.timeout(60)
def test_a_thousand_recorded_all_reduces_on_fresh_tensors_do_not_hang(tmp_path: Path) -> None:
    script = tmp_path / "hammer.py"
    script.write_text(_HAMMER)
    result = run_job(
        script, world_size=2, args=["1000"], env=_recorder_env(tmp_path, "hammer"), timeout=40
    )
    _assert_clean(result, "1000 recorded all-reduces")
    assert all("done" in r.stdout for r in result.ranks)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("jobwide", ["0", "1"], ids=["poller", "poller+jobwide-watcher"])
def test_no_recorder_python_thread_is_alive_when_the_interpreter_finalizes(
    tmp_path: Path, jobwide: str
) -> None:
    script = tmp_path / "threads_at_exit.py"
    script.write_text(_THREADS_AT_EXIT)
    env = {**_recorder_env(tmp_path, "threads"), "FRTOOLS_JOBWIDE": jobwide}
    result = run_job(script, world_size=1, env=env, timeout=40)
    _assert_clean(result, "one recorded rank")
    assert "recorder threads at exit: []" in result.ranks[0].stdout, result.output()


@pytest.mark.timeout(90)
def test_back_to_back_short_recorded_jobs_all_exit_zero(tmp_path: Path) -> None:
    """Before the fix about half of such 4-rank jobs had a rank end with -6 (more: FRTOOLS_STABILITY_JOBS=N)."""
    jobs = int(os.environ.get("FRTOOLS_STABILITY_JOBS", "3"))
    for i in range(jobs):
        result = run_job(
            DEMO_JOB,
            world_size=4,
            args=["--fault", "none", "--steps", "3"],
            env=_recorder_env(tmp_path, f"job{i}"),
            timeout=40,
        )
        _assert_clean(result, f"job {i + 1} of {jobs}")


@pytest.mark.timeout(60)
def test_a_job_that_never_destroys_its_groups_exits_zero(tmp_path: Path) -> None:
    """torch 2.15 frees groups left alive after Python has finalized; a Python hook still on
    one then takes the GIL and the process segfaults (exit -11): the recorder's hooks must be
    off by then."""
    script = tmp_path / "no_destroy.py"
    script.write_text(_NO_DESTROY)
    result = run_job(script, world_size=1, env=_recorder_env(tmp_path, "nodestroy"), timeout=40)
    _assert_clean(result, "a job without destroy_process_group")
    assert "done" in result.ranks[0].stdout
