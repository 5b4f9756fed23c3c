"""Native stacks: ``frtools dump`` takes each live rank's C++ stack with py-spy, and the
analyzer shows where in c10d / Gloo a rank waits; without py-spy, one line says how.

One real 2-rank Gloo job under ``frtools run``: rank 0 waits in a barrier that rank 1 (asleep
in Python) never joins, so rank 0's main thread sits inside c10d's C++ wait. It is dumped once
with py-spy on PATH and once without, then killed. A py-spy that hangs or fails is played by a
small shell script: it is killed at the deadline, the rank is left running, the reason is one
line.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import start_ranks, stop

from frtools.analyze.diagnose import IN_FLIGHT_NS
from frtools.collect.native_stacks import HINT, MIN_SECONDS, find_py_spy, take

WORLD = 2
JOB_ID = "native"
PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(
    PY_SPY is None, reason="py-spy is not installed (pip install 'frtools[native-stacks]')"
)

JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    Path(sys.argv[1], f"rank_{rank}.ready").touch()
    if rank == 0:
        dist.barrier()  # rank 1 never joins: rank 0 waits inside c10d's C++ wait
    else:
        time.sleep(600)
    """
)


def frtools(
    *args: str, env: dict[str, str] | None = None, python: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python or sys.executable), "-m", "frtools", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture(scope="module")
def barrier_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job dumped twice: with py-spy (``with``) and with a PATH that lacks it
    (``without``)."""
    tmp = tmp_path_factory.mktemp("native")
    script, markers, rec = tmp / "job.py", tmp / "markers", tmp / "rec"
    script.write_text(JOB)
    markers.mkdir()
    argv = [sys.executable, "-m", "frtools", "run", "--dir", str(rec), "--job-id", JOB_ID, "--"]
    procs = start_ranks(
        [*argv, sys.executable, str(script), str(markers)], WORLD, env={"FRTOOLS_JOBWIDE": "0"}
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(markers.iterdir())) < WORLD:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("the job did not reach its barrier")
            time.sleep(0.1)
        # past the analyzer's in-flight window, rank 0's barrier is a hang, as an on-call
        # engineer would find it
        time.sleep(IN_FLIGHT_NS / 1e9 + 1)
        runs = {}
        if PY_SPY is not None:
            out = tmp / "with"
            runs["with"] = (out, frtools("dump", "--dir", str(rec), "-o", str(out)))
        # no py-spy on PATH nor beside the Python that runs frtools (a link to this one)
        bare = tmp / "bare-bin"
        bare.mkdir()
        (bare / "python").symlink_to(sys.executable)
        out = tmp / "without"
        env = {**os.environ, "PATH": str(bare)}
        runs["without"] = (
            out,
            frtools("dump", "--dir", str(rec), "-o", str(out), env=env, python=bare / "python"),
        )
    finally:
        stop(procs)
    return runs


@needs_py_spy
@pytest.mark.timeout(240)
def test_rank_waiting_in_c10d_shows_its_native_frames(barrier_job: dict) -> None:
    out, dump = barrier_job["with"]
    assert dump.returncode == 0, dump.stdout + dump.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    for rank in range(WORLD):
        native = out / f"rank_{rank}.native"
        assert f"rank_{rank}.native" in manifest["ranks"][str(rank)]["files"], manifest
        assert stat.S_IMODE(native.stat().st_mode) == 0o600
    assert HINT not in manifest["notes"]

    report = frtools("analyze", "-v", str(out))
    text = report.stdout
    assert "native stacks of 2 rank(s) (py-spy), grouped:" in text, text
    native_part = text[text.index("native stacks of 2 rank(s)") :]
    rank0 = next(line for line in native_part.splitlines() if " rank(s) 0 " in line)
    # the innermost frame that matters is c10d's wait, not libc's pthread_cond_wait
    assert "c10d::" in rank0 and "libtorch" in rank0, text
    rank1 = next(line for line in native_part.splitlines() if " rank(s) 1 " in line)
    assert "c10d" not in rank1, text


@pytest.mark.timeout(240)
def test_without_py_spy_one_line_says_how_to_get_native_stacks(barrier_job: dict) -> None:
    out, dump = barrier_job["without"]
    assert dump.returncode == 0, dump.stdout + dump.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["notes"].count(HINT) == 1
    assert not list(out.glob("*.native"))
    hint_lines = [line for line in dump.stdout.splitlines() if "pip install py-spy" in line]
    assert len(hint_lines) == 1 and "SYS_PTRACE" in hint_lines[0], dump.stdout
    # the Python stacks are still collected
    assert (out / "rank_0.stacks").is_file() and (out / "rank_1.stacks").is_file()


def _stand_in(tmp_path: Path, body: str) -> str:
    """A stand-in for a py-spy that misbehaves (the real one is exercised above)."""
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o700)
    return str(exe)


@pytest.mark.timeout(60)
def test_py_spy_past_its_deadline_is_killed_and_the_rank_left_running(tmp_path: Path) -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t = time.monotonic()
        (result,) = take({0: target.pid}, 0.1, py_spy=_stand_in(tmp_path, "exec sleep 30")).values()
        assert time.monotonic() - t < MIN_SECONDS + 3
        assert result.error == f"py-spy did not finish within {MIN_SECONDS:g} s"
        state = Path(f"/proc/{target.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state not in ("T", "t"), "the rank was left stopped"
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("echo 'Permission denied (os error 13)' >&2; exit 1", "--cap-add SYS_PTRACE"),
        ("echo 'Process 7: not json'", "printed no JSON stacks"),
        ("head -c 5000000 /dev/zero | tr '\\0' '['", "above native_stacks_bytes"),
    ],
)
def test_py_spy_that_fails_gives_a_one_line_reason(tmp_path: Path, body: str, reason: str) -> None:
    (result,) = take({0: os.getpid()}, 5, py_spy=_stand_in(tmp_path, body)).values()
    assert result.text == "" and reason in result.error and "\n" not in result.error
