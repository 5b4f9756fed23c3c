"""``frtools run``: any command, every Python process in it set up to record, same exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from frtools.commands.run import BOOTSTRAP_DIR


def frtools_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.timeout(60)
def test_exit_code_is_the_commands() -> None:
    proc = frtools_run("--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert proc.returncode == 7


@pytest.mark.timeout(60)
def test_child_python_gets_recording_env_without_importing_torch(tmp_path: Path) -> None:
    code = (
        "import os, sys; "
        "print(os.environ['FRTOOLS_RECORD'], os.environ['FRTOOLS_DIR'], "
        "os.environ['FRTOOLS_STALL_SECONDS'], os.environ['PYTHONPATH'].split(os.pathsep)[0]); "
        "print('torch' in sys.modules)"
    )
    proc = frtools_run(
        "--dir", str(tmp_path), "--stall-seconds", "5", "--", sys.executable, "-c", code
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.split() == ["1", str(tmp_path), "5.0", BOOTSTRAP_DIR]
    assert second == "False"  # a process that never imports torch pays nothing
    assert proc.stderr == ""


@pytest.mark.timeout(60)
def test_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path))
    proc = frtools_run(
        "--", sys.executable, "-c", "import builtins; print(builtins.USER_SITE_RAN)", env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


@pytest.mark.timeout(60)
def test_torch_distributed_import_turns_recording_on(tmp_path: Path) -> None:
    code = "import torch.distributed, frtools.recorder as r; print(r.is_enabled())"
    proc = frtools_run("--dir", str(tmp_path), "--", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert list(tmp_path.iterdir()) == []  # no file until a process group exists


@pytest.mark.timeout(60)
def test_missing_command_is_one_line_and_127() -> None:
    proc = frtools_run("--", "no-such-command-frtools")
    assert proc.returncode == 127
    assert proc.stderr.strip().splitlines() == [
        "frtools run: cannot run 'no-such-command-frtools': No such file or directory"
    ]


@pytest.mark.timeout(60)
def test_no_command_is_a_usage_error() -> None:
    proc = frtools_run()
    assert proc.returncode == 2


NEVER_INIT_JOB = """
import os, time
from datetime import timedelta
import torch.distributed as dist
if os.environ["RANK"] == "2":
    while True:  # never reaches init_process_group
        time.sleep(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
"""


def _analyze(path: Path) -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(path), "--format", "json"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    return json.loads(proc.stdout)["verdict"]


@pytest.mark.timeout(120)
def test_a_rank_that_never_calls_init_process_group_is_named(tmp_path: Path) -> None:
    """Under ``frtools run`` the black box exists from process start: rank 2 of 3 never
    calls init_process_group, rank 0 waits in rendezvous, rank 1 in Gloo's connect. Its box
    says 'started': missing [2], the others wait; without its box (the others' headers give
    the world size) it is dead [2]."""
    import shutil
    import time

    from jobs import free_port, rank_env, stop

    from frtools.formats.blackbox import SnapshotError, read_snapshot

    script = tmp_path / "job.py"
    script.write_text(NEVER_INIT_JOB)
    rec = tmp_path / "rec"
    port = free_port()
    argv = [sys.executable, "-m", "frtools", "run", "--dir", str(rec), "--job-id", "j", "--",
            sys.executable, str(script)]  # fmt: skip
    procs = [
        subprocess.Popen(argv, env=rank_env(r, 3, port), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(3)
    ]  # fmt: skip
    try:
        boxes = [rec / "j" / f"rank_{r}.frt" for r in range(3)]
        want = ["rendezvous", "connect", "started"]
        deadline = time.monotonic() + 60
        phases: list = []
        while time.monotonic() < deadline:
            if all(b.exists() for b in boxes):
                try:
                    phases = [read_snapshot(b).startup_phase for b in boxes]
                except SnapshotError as e:  # a box just created: its header comes next
                    assert "incomplete (file being created?)" in str(e), e
                    time.sleep(0.05)
                    continue
                if phases == want:
                    break
            time.sleep(0.2)
        assert phases == want
        verdict = _analyze(rec / "j")
        assert (verdict["kind"], [g["rank"] for g in verdict["guilty"]]) == ("missing", [2])
        assert verdict["waiting"] == [0, 1]
        assert "never called init_process_group" in verdict["headline"]
        alone = tmp_path / "without-rank-2"
        alone.mkdir()
        for b in boxes[:2]:
            shutil.copy(b, alone / b.name)
        verdict = _analyze(alone)
        assert (verdict["kind"], [g["rank"] for g in verdict["guilty"]]) == ("dead", [2])
    finally:
        stop(procs)
