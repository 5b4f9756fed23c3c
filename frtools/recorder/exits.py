"""How this process ends, written into its black box: the facts its peers cannot see.

* Native (``BlackBox.watch_exit``): the exit status through glibc's ``on_exit`` (a clean end,
  ``sys.exit(n)``, the status of an uncaught exception), and fatal signals (SIGSEGV, SIGBUS,
  SIGFPE, SIGILL, SIGABRT; SIGTERM where nobody handles it) from a signal handler that only
  stores into a preallocated header field, then hands the signal to the handler that was
  there before (faulthandler's, torch's) or to the default action.
* Python, installed here: an uncaught exception (``sys.excepthook``: type, message,
  traceback), another thread's uncaught exception (``threading.excepthook``), ``os._exit(n)``
  (wrapped: record, then the real one). Each hook calls the one it replaced; none raises.

The first ending recorded wins (an exception, then the exit status 1 it causes, is an
exception). Before recording, ``flush`` (the completion poller's pass) runs, so the op whose
failure killed the process is marked failed first. A box never closed whose process is gone
recorded nothing: SIGKILL, the OOM killer, a lost node — the reader says ``killed``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from frtools.formats.blackbox import EXIT_KIND_NAMES

EXIT_EXCEPTION = EXIT_KIND_NAMES.index("exception")
EXIT_OS_EXIT = EXIT_KIND_NAMES.index("os_exit")
# frames of an exception's traceback kept, innermost first (as an op's call stack)
STACK_DEPTH = 32


class _Watch:
    box: Any = None
    flush: Callable[[], None] | None = None
    pid = 0
    installed = False
    previous_excepthook: Callable[..., Any] | None = None
    previous_thread_excepthook: Callable[..., Any] | None = None
    original_os_exit: Callable[[int], Any] | None = None


_watch = _Watch()


def watch(box: Any, flush: Callable[[], None] | None = None) -> None:
    """Record how this process ends in ``box`` (raises if the native part cannot)."""
    box.watch_exit()
    _watch.box, _watch.flush, _watch.pid = box, flush, os.getpid()
    if _watch.installed:
        return
    _watch.installed = True
    _watch.previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    _watch.previous_thread_excepthook = threading.excepthook
    threading.excepthook = _thread_excepthook
    _watch.original_os_exit = os._exit
    os._exit = _os_exit


def exception_text(exc_type: type[BaseException], exc: BaseException | None) -> str:
    """``RuntimeError: CUDA error: …`` as Python's traceback ends."""
    return "".join(traceback.format_exception_only(exc_type, exc)).strip()


def stack_text(tb: Any) -> str:
    """A traceback as the black box's stacks: ``file:line in func`` lines, innermost first."""
    frames = traceback.extract_tb(tb)[-STACK_DEPTH:]
    return "\n".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames))


def _box() -> Any:
    """The watched box, in the process that watches it (a forked child has none)."""
    if _watch.box is None or os.getpid() != _watch.pid:
        return None
    flush = _watch.flush
    if flush is not None:
        with contextlib.suppress(Exception):
            flush()
    return _watch.box


def _excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    with contextlib.suppress(Exception):
        box = _box()
        if box is not None:
            # status 1: what Python exits with; on_exit writes the real one
            box.mark_exit(EXIT_EXCEPTION, 1, exception_text(exc_type, exc), stack_text(tb))
    previous = _watch.previous_excepthook or sys.__excepthook__
    previous(exc_type, exc, tb)


def _thread_excepthook(args: Any) -> None:
    with contextlib.suppress(Exception):
        box = _box() if args.exc_type is not SystemExit else None
        if box is not None:
            name = args.thread.name if args.thread is not None else "a thread"
            text = exception_text(args.exc_type, args.exc_value)
            where = stack_text(args.exc_traceback).split("\n", 1)[0]
            box.note_thread_error(f"{name}: {text}" + (f" (at {where})" if where else ""))
    previous = _watch.previous_thread_excepthook or threading.__excepthook__
    previous(args)


def _os_exit(status: int) -> None:
    with contextlib.suppress(Exception):
        box = _box()
        if box is not None:
            box.mark_exit(EXIT_OS_EXIT, int(status))
    original = _watch.original_os_exit
    assert original is not None
    original(status)
