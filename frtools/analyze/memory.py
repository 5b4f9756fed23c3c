"""Keep freed memory for reuse during one analysis.

Aligning millions of entries allocates and frees many arrays of hundreds of MB. glibc
serves each from a fresh ``mmap`` and unmaps it on free, so every one is faulted in again,
and numpy asks for transparent huge pages on each, which makes the kernel compact memory
on those faults. On a VM that system time dwarfed the work (4,096 ranks: align and
diagnose 5.2 s system + 2.6 s user; 0.8 s + 2.4 s with both settings below). The
alignment takes Arrow's buffers from the same heap. Only the
``frtools analyze`` process (and the reader processes it forks) does this; the recorder
never does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed memory, and numpy not
    to madvise huge pages; False where that is not glibc (the defaults then stay)."""
    if not sys.platform.startswith("linux"):
        return False
    _no_huge_pages()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def arrow_from_the_heap() -> None:
    """From now on, Arrow's buffers from glibc's heap too (with ``keep_freed_memory``),
    unless the user chose a pool (``ARROW_DEFAULT_MEMORY_POOL``). Its default pool
    (mimalloc) maps fresh memory for each large buffer a concatenation makes, and faulting
    it in cost more than the copy: the heap reuses what reading freed (131,072 ranks:
    each int64 column of the alignment frame 100-180 ms from mimalloc, ~20 ms from the
    heap; align 3.0 -> 2.5 s). Set before reading: set after it, the alignment found no
    freed heap to reuse and gained nothing."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    import pyarrow as pa

    with contextlib.suppress(Exception):  # a pyarrow without it keeps its default
        pa.set_memory_pool(pa.system_memory_pool())


def _no_huge_pages() -> None:
    import numpy as np

    for module in ("_core", "core"):
        setter = getattr(
            getattr(getattr(np, module, None), "multiarray", None), "_set_madvise_hugepage", None
        )
        if setter is not None:
            setter(False)
            return


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic GC off for a stage that builds many objects in no cycle, on again after.

    Reading: a dump parses into ~100 small containers per entry, which the collector would
    rescan again and again (half the read time on big dumps). Aligning and diagnosing
    after ``spare_the_collector``: on CPython 3.11 a frozen heap still leaves every young
    collection costly (131,072 ranks: one comprehension over the ranks' groups 0.22 s with
    the collector off, 1.4 s on; align 4.7 -> 3.2 s), and what those stages leave in cycles
    is a few pandas frames, collected when the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def spare_the_collector() -> None:
    """Take every object alive now out of the cyclic GC's scans (``gc.freeze``): what was
    read stays until the process ends, and aligning and diagnosing 131,072 ranks otherwise
    rescan it on every collection (facts: 4.3 s, 1.6 s without). Only commands that analyze
    and then exit call it."""
    gc.freeze()
