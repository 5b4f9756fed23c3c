"""The analysis process's memory settings (``frtools.analyze.memory``), checked in a fresh
interpreter: they are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import ctypes, os
from frtools.analyze.memory import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.prctl(41, 0, 0, 0, 0)  # PR_SET_THP_DISABLE 0: an analysis earlier in the tests' process set it
before = libc.prctl(42, 0, 0, 0, 0)  # PR_GET_THP_DISABLE
kept = keep_freed_memory()
pid = os.fork()
if pid == 0:  # a reader process forked after it
    os._exit(libc.prctl(42, 0, 0, 0, 0))
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(before, kept, libc.prctl(42, 0, 0, 0, 0), child)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and prctl")
def test_the_analysis_and_its_readers_get_no_transparent_huge_pages() -> None:
    """Faulting in fresh memory as huge pages made each concatenated column of the
    alignment frame cost 5x more: the analysis turns them off for itself and its readers."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, kept, after, child = done.stdout.split()
    assert (before, kept, after, child) == ("0", "True", "1", "1")
