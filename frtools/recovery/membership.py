"""Going on without some ranks: torch 2.15's two ways of rebuilding the default group.

* ``shrink_group`` where the backend supports shrinking (NCCL's ``supports_shrinking``):
  the survivors call ``dist.shrink_group(ranks_to_exclude, shrink_flags=SHRINK_ABORT)``
  (abort: survivors may still have ops queued with the dropped rank); it returns the new
  default group.
* ``_reconfigure`` elsewhere (Gloo: ``supports_shrinking`` is False, ``supports_reconfigure``
  True): every survivor publishes ``dist._get_reconfigure_handle()`` through the store and
  calls ``dist._reconfigure(uuid, handles in the new rank order)``. The default group object
  is rebuilt in place: ``dist.get_rank()`` / ``get_world_size()`` answer the new numbering
  and a DDP model built on it keeps working (checked on torch 2.15 with Gloo).

Both need torch >= 2.15: older torch has neither (``unavailable_reason`` says so). Gloo
releases survivors blocked with a hung rank only through the group's timeout (``work.wait
(timeout)`` leaves the op pending inside Gloo and ``abort()`` does nothing there), hence
``set_group_timeout``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from frtools.recovery.agreement import Agreement

TORCH_REQUIRED = "2.15"
SHRINK, RECONFIGURE = "shrink_group", "reconfigure"
# Gloo's reconfigure handle starts with the backend and the rank in the current group
# ("gloo:2:-1:2:", checked on torch 2.15); other backends' handles are opaque to us
HANDLE_RANK = re.compile(r"[A-Za-z0-9_]+:(-?[0-9]{1,9}):")


def _default_group() -> Any:
    return c10d._get_default_group()


def _backend_of(pg: Any) -> Any:
    device = getattr(pg, "bound_device_id", None)
    try:
        return pg._get_backend(device if device is not None else torch.device("cpu"))
    except Exception:
        return None


def method() -> str | None:
    """How this job's default group can drop ranks: ``shrink_group``, ``reconfigure``, or
    None when it cannot (torch < 2.15, or a backend that supports neither)."""
    pg = _default_group()
    backend = _backend_of(pg)
    if hasattr(dist, "shrink_group") and bool(getattr(backend, "supports_shrinking", False)):
        return SHRINK
    if hasattr(dist, "_reconfigure"):
        try:
            if dist._supports_reconfigure(pg):
                return RECONFIGURE
        except Exception:
            return None
    return None


def unavailable_reason() -> str | None:
    """Why this process cannot recover by dropping ranks; None when it can."""
    if not (dist.is_available() and dist.is_initialized()):
        return "call it after init_process_group (it works on the default process group)"
    if not hasattr(dist, "_reconfigure"):  # new in 2.15, with Gloo's reconfigure
        return (
            f"frtools.recovery needs torch >= {TORCH_REQUIRED} (dist._reconfigure, "
            f"dist.shrink_group); this is torch {torch.__version__}"
        )
    if method() is None:
        return (
            f"the default group's backend ({dist.get_backend()}) supports neither shrinking "
            "nor reconfiguring"
        )
    return None


def set_group_timeout(seconds: float) -> None:
    """Every collective of the default group fails after ``seconds`` (Gloo enforces it in
    its transport: the only way to release ranks blocked with a hung peer)."""
    dist.set_timeout(timedelta(seconds=seconds))


def rebuild(
    how: str,
    agreement: Agreement,
    before: Sequence[int],
    after: Sequence[int],
    uuid: int,
    timeout_s: float,
    deadline_ns: int,
) -> None:
    """Rebuild the default group with the members ``after`` (launch ranks, in the new rank
    order; a subset of ``before``). Only the survivors call it."""
    if how == SHRINK:
        exclude = [i for i, r in enumerate(before) if r not in after]
        dist.shrink_group(exclude, shrink_flags=c10d.SHRINK_ABORT)
        return
    handle = dist._get_reconfigure_handle()
    handles = agreement.exchange("handle", handle, list(after), deadline_ns)
    check_handles(handles, before, after)
    work = dist._reconfigure(uuid=uuid, handles=handles, timeout=timedelta(seconds=timeout_s))
    work.wait()


def check_handles(handles: Sequence[str], before: Sequence[int], after: Sequence[int]) -> None:
    """The handles read from the store (one per survivor, in the order of ``after``) name
    the survivors and nobody else: each once, and a handle that says its rank says the
    survivor's rank in the current group (``before``'s numbering). ValueError otherwise: a
    store client outside the job must not slip a process of its own into the group."""
    if len(set(handles)) != len(handles):
        raise ValueError("the same reconfigure handle is listed twice")
    for launch, handle in zip(after, handles, strict=True):
        m = HANDLE_RANK.match(handle)
        if m is not None and int(m.group(1)) != list(before).index(launch):
            raise ValueError(
                f"the reconfigure handle of rank {launch} names rank {m.group(1)}, not "
                f"{list(before).index(launch)}"
            )
