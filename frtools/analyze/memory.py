"""Keep freed memory for reuse during one analysis.

Aligning millions of entries allocates and frees many arrays of hundreds of MB. glibc
serves each from a fresh ``mmap`` and unmaps it on free, so every one is faulted in again,
and numpy asks for transparent huge pages on each, which makes the kernel compact memory
on those faults. On a VM that system time dwarfed the work (4,096 ranks: align and
diagnose 5.2 s system + 2.6 s user; 0.8 s + 2.4 s with both settings below). Arrow's
buffers still came as huge pages (its pool, mimalloc, and in an analysis the heap too),
so the process turns transparent huge pages off for itself (concatenating a 67 MB column
into fresh memory: 0.19 s -> 0.035 s; 131,072 ranks: align 3.0 -> 2.55 s). Only the
``frtools analyze`` process (and the reader processes it forks) does this; the recorder
never does.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_PR_SET_THP_DISABLE = 41


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed memory, numpy not to
    madvise huge pages and the kernel to give this process (and those it forks) no
    transparent huge pages; False where that is not glibc (the defaults then stay)."""
    if not sys.platform.startswith("linux"):
        return False
    _no_huge_pages()
    import ctypes  # here, not at import: every command's start-up imports this module
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    with contextlib.suppress(AttributeError):  # a kernel before 3.15 says EINVAL: no harm
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


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


# True when this process runs one command and ends with ``os._exit`` once its output is
# out (set by the entry point, frtools.__main__); False where a command runs inside another
# program. What ``keep_until_exit`` is given is kept to that end.
_EXITS_AT_ONCE = False
_KEPT: list[object] = []


def set_exits_at_once() -> None:
    global _EXITS_AT_ONCE
    _EXITS_AT_ONCE = True


def exits_at_once() -> bool:
    """This process is a command's own and ends with ``os._exit`` (``set_exits_at_once``)."""
    return _EXITS_AT_ONCE


def keep_until_exit(*objects: object) -> None:
    """Keep ``objects`` (a stage's leftovers: 131,072 ranks' dumps, ~0.3 s to free one
    object at a time) alive to the end of a process that ``exits_at_once``; elsewhere (a
    program that imports frtools) they are freed as usual."""
    if _EXITS_AT_ONCE:
        _KEPT.append(objects)


def spare_the_collector() -> None:
    """Take every object alive now out of the cyclic GC's scans (``gc.freeze``): what was
    read stays until the process ends, and aligning and diagnosing 131,072 ranks otherwise
    rescan it on every collection (facts: 4.3 s, 1.6 s without). Only commands that analyze
    and then exit call it."""
    gc.freeze()
