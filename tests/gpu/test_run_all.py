"""``tests/gpu/run_all.sh`` on a machine without CUDA: every check a row ``skip: no CUDA``,
exit 0; and every check's judgement imports without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CHECKS = [
    "cuda_events",
    "recorder_nccl",
    "fr_nccl2",
    "windows_nccl2",
    "shrink_group",
    "device_facts",
]


@pytest.mark.timeout(120)
def test_without_cuda_every_gpu_check_is_one_skipped_row() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", str(HERE / "run_all.sh")], capture_output=True, text=True, env=env, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["check", "result", "seconds", "detail"]
    rows = [line.split(None, 3) for line in lines[2:-1]]
    assert [r[0] for r in rows] == CHECKS
    assert all(r[1] == "skip" and r[3].startswith("no CUDA") for r in rows), proc.stdout


@pytest.mark.parametrize(
    ("script", "judgement"),
    [
        ("check_blackbox_cuda.py", "check_cuda_events"),
        ("check_recorder_gpu.py", "check_snapshot"),
        ("check_fr_nccl2.py", "check_collected"),
        ("check_windows_nccl2.py", "check_window_records"),
        ("check_shrink_group.py", "check_shrink_records"),
        ("check_device_facts.py", "check_device_facts"),
    ],
)
def test_each_gpu_check_imports_on_cpu(script: str, judgement: str) -> None:
    spec = importlib.util.spec_from_file_location(script[:-3], HERE / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, judgement))
