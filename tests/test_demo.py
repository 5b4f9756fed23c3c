"""``frtools demo`` end to end: a real 4-rank Gloo job hangs on purpose, the recorder
notices, ``dump`` collects, ``analyze`` names the injected rank; nothing is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(pid))
    return pids


@pytest.mark.timeout(150)
def test_demo_names_the_injected_rank_and_leaves_no_process(tmp_path):
    work = tmp_path / "demo"
    t = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "frtools", "demo", "--fault-rank", "1", "--keep", str(work)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - t
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Rank 1" in res.stdout
    assert "stall detected" in res.stdout
    assert elapsed < 60
    assert _processes_mentioning(str(work)) == []
    # the collected dump stays for a second look
    assert sorted(p.name for p in (work / "dump").glob("rank_*.frt")) == [
        f"rank_{r}.frt" for r in range(4)
    ]


@pytest.mark.timeout(30)
def test_demo_rejects_a_fault_rank_outside_the_job():
    res = subprocess.run(
        [sys.executable, "-m", "frtools", "demo", "--fault-rank", "7"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert res.returncode == 2
    assert "--fault-rank must be in 0..3" in res.stderr
