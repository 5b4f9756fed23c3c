"""The phases of a process's start-up, in its black box, from the first moment on.

A rank that never reaches ``init_process_group`` leaves its peers inside rendezvous or the
backend's connect, where no group exists and no collective is recorded: only a record that
starts with the process can name it. Under ``frtools run`` (the launcher's ``RANK`` and
``WORLD_SIZE`` in the environment) ``enable()`` opens the box as ``torch.distributed`` is
imported, and this module marks each phase in it (``BlackBox.set_phase``; the codes are
``frtools.formats.blackbox.PHASE_NAMES``):

* ``started``     the box is open: the process runs, no ``init_process_group`` yet;
* ``init``        ``init_process_group`` entered;
* ``rendezvous``  its rendezvous handler called: connecting to the store (the master waits
                  there for every rank to connect);
* ``connect``     the store is connected, the default group's backend is being built (Gloo
                  and NCCL exchange their peers' addresses through the store);
* ``ready``       ``init_process_group`` returned.

With ``init_process_group(store=...)`` there is no rendezvous: ``init`` covers the connect.
An ``init_process_group`` that raised (a timeout) keeps its phase, with ``startup_failed``.

The wrappers go through ``capture.c10d_internals``; each only marks the phase and calls on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from frtools.formats.blackbox import PHASE_NAMES

PHASE = {name: code for code, name in enumerate(PHASE_NAMES) if name}

_state: dict[str, Any] = {"box": None, "installed": False, "phase": "started", "pid": 0}


def launcher_rank(env: dict[str, str]) -> tuple[int, int] | None:
    """(rank, world size) as a launcher states them (torchrun, ``frtools run`` under it, the
    corpus harness: ``RANK``, ``WORLD_SIZE``); None when either is absent or no number."""
    rank, world = env.get("RANK", ""), env.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit()) or int(rank) >= int(world):
        return None
    return int(rank), int(world)


def mark(phase: str, failed: bool = False) -> None:
    """Record that the process entered ``phase`` now (nothing without a box; never raises)."""
    box = _state["box"]
    if box is None or _state["pid"] != os.getpid():  # a forked child: its parent's box
        return
    _state["phase"] = phase
    with contextlib.suppress(Exception):  # the phases are a bonus: never hurt the job
        box.set_phase(PHASE[phase], failed)


def watch(box: Any) -> None:
    """Mark start-up phases in ``box`` from now on: ``started`` at once, the others from
    wrappers around ``init_process_group`` and its rendezvous (installed once)."""
    _state["box"], _state["pid"] = box, os.getpid()
    mark("started")
    if _state["installed"]:
        return
    from frtools.recorder.capture import c10d_internals

    _state["installed"] = True
    c10d_internals.replace_init_process_group(_init_wrapper)
    c10d_internals.replace_rendezvous(_rendezvous_wrapper)


def _init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        mark("init")
        try:
            result = original(*args, **kwargs)
        except BaseException:
            mark(_state["phase"], failed=True)  # it stays in the phase it failed in
            raise
        mark("ready")
        return result

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    return init_process_group


def _rendezvous_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def rendezvous(*args: Any, **kwargs: Any) -> Any:
        mark("rendezvous")
        for item in original(*args, **kwargs):  # (store, rank, world_size) once connected
            mark("connect")
            yield item

    rendezvous.__wrapped__ = original  # type: ignore[attr-defined]
    return rendezvous
