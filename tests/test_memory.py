"""The analysis process's memory settings (``frtools.analyze.memory``), checked in a fresh
interpreter: they are process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"

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


_KEEPS = """
import sys, weakref
from frtools.analyze import memory
from frtools.analyze.readers import load_trace

class Leftover:
    pass

freed = Leftover()
gone = weakref.ref(freed)
memory.keep_until_exit(freed)
del freed
load_trace(sys.argv[1])  # a library's analysis: nothing kept
library = (gone() is None, len(memory._KEPT))

memory.set_exits_at_once()
kept = Leftover()
alive = weakref.ref(kept)
memory.keep_until_exit(kept)
del kept
trace = load_trace(sys.argv[1])
dumps = {d.rank_info.rank for kept in memory._KEPT[1:] for d in kept[0] if d.entries is None}
print(*library, alive() is not None, dumps == set(trace.ranks))
"""


def test_what_a_command_read_is_kept_to_its_exit_and_a_library_keeps_nothing() -> None:
    """A command's own process ends with ``os._exit``: the per-rank objects reading left
    (131,072 ranks' dumps: ~0.3 s to free one at a time) stay to the end instead; a program
    that imports frtools gets them freed as usual."""
    done = subprocess.run(
        [sys.executable, "-c", _KEEPS, str(SAMPLES / "crashed")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0", "True", "True"]
