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
