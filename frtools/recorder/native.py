"""Import the native black box, or say plainly why it cannot be used.

The recorder must never stop training: a machine without a compiler installs frtools without
the extension, and ``load_native()`` then raises ``NativeUnavailable`` with the reason so the
caller can warn once and run unrecorded.
"""

from __future__ import annotations

import faulthandler
import signal
from types import ModuleType
from typing import IO

__all__ = ["NativeUnavailable", "load_native", "register_stack_signal"]

_native: ModuleType | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The compiled ``frtools.recorder._blackbox`` module is missing or does not load."""


def load_native() -> ModuleType:
    """Return ``frtools.recorder._blackbox`` (cached), or raise ``NativeUnavailable``."""
    global _native, _failure
    if _native is not None:
        return _native
    if _failure is not None:
        raise NativeUnavailable(_failure)
    try:
        from frtools.recorder import _blackbox
    except ImportError as exc:
        _failure = (
            f"the native black box is not built ({exc}); reinstall frtools with a C++ "
            "compiler available (pip install -e .)"
        )
        raise NativeUnavailable(_failure) from None
    _native = _blackbox
    return _native


def register_stack_signal(signum: int, file: IO[str]) -> bool:
    """Have ``signum`` write every thread's Python stack to ``file`` (the watchdog raises it
    for a dump request); returns whether an earlier handler is chained.

    ``faulthandler.register(chain=True)`` re-raises the signal with the previous handler;
    when that is the default action (SIGUSR2's is "terminate") the process dies after writing
    its stacks. So chain only when a real handler was installed before.
    """
    previous = signal.getsignal(signum)
    chain = previous not in (signal.SIG_DFL, signal.SIG_IGN)
    faulthandler.register(signum, file=file, all_threads=True, chain=chain)
    return chain
