"""Stopping the recorder's Python threads before the interpreter finalizes.

A daemon thread still running Python when finalization starts is killed (``pthread_exit``)
as soon as it takes the GIL back; when that happens inside a pybind11 call that released
the GIL (a store round trip, the last reference to a Work or a ProcessGroup) the forced
unwind hits a ``noexcept`` frame and the process aborts: "terminate called without an active
exception", exit code -6. So every recorder thread is stopped and joined from here.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable


def before_finalization(fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit before the interpreter finalizes: in ``threading``'s shutdown hook
    (the main thread, before non-daemon threads are joined and before ``atexit``), or, where
    that private hook is missing, from ``atexit``."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(fn)
            return
        except RuntimeError:  # already shutting down
            pass
    atexit.register(fn)
