"""The readers' fuzz target (tests/fuzz_readers.py) on a short budget: mutated real dumps are
read or refused, never crash, hang or run out of 1 GiB. The long run is on demand:
``python tests/fuzz_readers.py --seconds 3600`` (docs/security.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BUDGET_S = 40


@pytest.mark.timeout(BUDGET_S + 60)
def test_mutated_real_dumps_are_read_or_refused(tmp_path: Path) -> None:
    got = subprocess.run(
        [sys.executable, str(HERE / "fuzz_readers.py"), "--seconds", str(BUDGET_S),
         "--save", str(tmp_path / "failures")],
        capture_output=True, text=True, timeout=BUDGET_S + 50,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]
    assert "read or refused" in got.stdout
