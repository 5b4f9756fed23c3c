"""The recorder's two ways of speaking to the user: the one warning when recording stops, and
one-line notes on stderr. Neither ever raises: the recorder must not hurt the job."""

from __future__ import annotations

import contextlib
import sys

from frtools.config import RECORD

_warned = False


def recording_disabled(reason: str) -> None:
    """``frtools: recording disabled: <reason>``, once per process; the job itself goes on."""
    global _warned
    if _warned:
        return
    _warned = True
    msg = f"frtools: recording disabled: {reason}"
    try:
        if RECORD.read():
            # launched by `frtools run`: one plain line, not a multi-line Python warning
            note_line(msg)
            return
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    except Exception:
        note_line(msg)


def note(msg: str) -> None:
    """``frtools: <msg>`` on stderr (a stall seen, a part of the recorder not started)."""
    note_line(f"frtools: {msg}")


def note_line(line: str) -> None:
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)
