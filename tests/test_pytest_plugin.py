"""``pytest --frtools``: a distributed test that times out or fails gets the verdict in its
report, its records are kept, and no rank outlives the run.

The slow tests run pytest in a subprocess on a generated test file that starts a real
2-rank Gloo job: rank 1 stops in its own code (or dies) while rank 0 waits in an
all_reduce. Plugin autoloading is off in that subprocess and both plugins are named with
``-p``, so the run does not depend on what else is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frtools.pytest_plugin import job_id_for

ROOT = Path(__file__).resolve().parent.parent

RANK_SCRIPT = r"""
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
open(os.path.join(os.environ["JOB_MARKS"], f"ready_{rank}"), "w").close()
if rank == 1:
    if os.environ["JOB_FAULT"] == "hang":
        time.sleep(600)  # rank 1 stays in its own code: rank 0 waits in the all_reduce
    else:
        os._exit(3)  # rank 1 dies: rank 0's all_reduce fails
dist.all_reduce(t)
dist.destroy_process_group()
"""

TEST_FILE = r'''
import os, socket, subprocess, sys, time
from pathlib import Path
import pytest

HERE = Path(__file__).parent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(fault, marks):
    """Start the 2 ranks and wait until both are past their warm-up collectives (torch's
    import is slow on a busy machine; the timeout below then only measures the hang)."""
    marks.mkdir()
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), JOB_FAULT=fault, JOB_MARKS=str(marks),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "rank_job.py")], env=env))
    with open(HERE / "pids.txt", "a") as f:
        f.write("".join(f"{p.pid}\n" for p in procs))
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not all((marks / f"ready_{r}").exists() for r in range(2)):
        if any(p.poll() not in (None, 0) for p in procs) and fault == "hang":
            break
        time.sleep(0.2)
    return procs


@pytest.fixture
def hung_job(tmp_path):
    procs = _start("hang", tmp_path / "marks")
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def crashing_job(tmp_path):
    procs = _start("exit", tmp_path / "marks")
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.timeout(6, func_only=True)
def test_hang(hung_job):
    for p in hung_job:
        assert p.wait() == 0


def test_crash(crashing_job):
    codes = [p.wait(timeout=120) for p in crashing_job]
    assert codes == [0, 0]
'''


def _run_pytest(
    tmp_path: Path, method: str, select: str
) -> tuple[subprocess.CompletedProcess, Path]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "rank_job.py").write_text(RANK_SCRIPT)
    (project / "test_job.py").write_text(TEST_FILE)
    keep = tmp_path / "kept"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "frtools.pytest_plugin",
        "-p",
        "pytest_timeout",
        "--frtools",
        "--frtools-dir",
        str(keep),
        "-o",
        f"timeout_method={method}",
        "-p",
        "no:cacheprovider",
        "-q",
        "-k",
        select,
        "test_job.py",
    ]
    p = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=500)
    return p, project


def _assert_no_rank_left(project: Path) -> None:
    pids = [int(x) for x in (project / "pids.txt").read_text().split()]
    assert len(pids) >= 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    for pid in alive:  # never leave one behind, even when the assertion fails
        os.kill(pid, 9)
    assert not alive, f"ranks left running: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_timed_out_test_reports_the_guilty_rank_signal_method(tmp_path):
    """pytest-timeout's signal method: the plugin collects the hung ranks at the deadline
    (stacks included), the test fails with the verdict in its report section, and a test
    whose rank died gets a verdict too (collected after the failure)."""
    p, project = _run_pytest(tmp_path, "signal", "test_hang or test_crash")
    out = p.stdout + p.stderr
    try:
        assert p.returncode == 1, out
        assert "Timeout" in out
        hang = out[out.index("test_hang") :]
        assert "frtools verdict" in hang, out
        assert re.search(r"MISSING +Rank 1 .*never issued all_reduce", out), out
        assert "rank_job.py:" in out  # the guilty rank's call site
        kept = tmp_path / "kept" / job_id_for("test_job.py::test_hang")
        verdict = json.loads((kept / "verdict.json").read_text())["verdict"]
        assert verdict["kind"] == "missing"
        assert [g["rank"] for g in verdict["guilty"]] == [1]
        assert "in <module>" in (verdict["guilty"][0]["call_site"] or "")
        assert (kept / "report.html").stat().st_size > 0
        assert (kept / "rank_1.stacks").exists()  # collected while the ranks were alive
        crash = json.loads(
            (tmp_path / "kept" / job_id_for("test_job.py::test_crash") / "verdict.json").read_text()
        )["verdict"]
        assert crash["kind"] != "healthy"
        assert "test_job.py::test_crash: " in out  # the summary line
    finally:
        _assert_no_rank_left(project)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_timed_out_test_reports_the_guilty_rank_thread_method(tmp_path):
    """pytest-timeout's thread method ends pytest with os._exit: the verdict is printed
    before that, and the plugin kills the hung ranks the test could no longer stop."""
    p, project = _run_pytest(tmp_path, "thread", "test_hang")
    out = p.stdout + p.stderr
    try:
        assert p.returncode == 1, out
        assert "frtools verdict" in out, out
        assert out.index("frtools verdict") < out.index("Timeout")
        assert re.search(r"MISSING +Rank 1 .*never issued all_reduce", out), out
        kept = tmp_path / "kept" / job_id_for("test_job.py::test_hang")
        assert json.loads((kept / "verdict.json").read_text())["verdict"]["kind"] == "missing"
    finally:
        _assert_no_rank_left(project)


PLAIN_TESTS = r"""
import os

def test_env_is_set_for_the_ranks():
    assert os.environ["FRTOOLS_RECORD"] == "1"
    first = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    assert first.endswith(os.path.join("recorder", "_bootstrap"))
    assert os.environ["FRTOOLS_JOB_ID"].startswith("test_plain.py_test_env_is_set_for_the_ranks-")
    assert os.path.isdir(os.environ["FRTOOLS_DIR"])

def test_fails_without_ranks():
    assert False
"""


def _run_plain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_plain.py").write_text(PLAIN_TESTS)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("FRTOOLS_RECORD", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "frtools.pytest_plugin", "-q", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plugin_sets_the_recording_env_per_test_and_adds_nothing_without_ranks(tmp_path):
    p = _run_plain(
        tmp_path, "--frtools", "--frtools-dir", str(tmp_path / "kept"), "-p", "no:cacheprovider"
    )
    assert "1 failed, 1 passed" in p.stdout, p.stdout + p.stderr
    assert "frtools verdict" not in p.stdout
    assert not (tmp_path / "kept").exists()  # nothing recorded, nothing kept


def test_plugin_is_inert_without_the_flag(tmp_path):
    p = _run_plain(tmp_path, "-p", "no:cacheprovider")
    assert "2 failed" in p.stdout, p.stdout + p.stderr  # the env test fails: nothing set
    assert "frtools" not in p.stdout.replace("frtools.pytest_plugin", "")


def test_the_plugin_is_registered_by_installing_frtools():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"frtools": "frtools.pytest_plugin"}
