"""Every use the recorder makes of torch.distributed beyond its public API, in one place.

torch (checked on 2.13) has no public way to: see every group a job creates before it is
built (``_new_process_group_helper`` is the one function all of ``init_process_group``,
``new_group``, ``new_subgroups`` … go through); build a real Gloo/NCCL backend exactly as
that helper would (sequence numbers, the NCCL split source and color, private option
fields); attach backends to a Python ``ProcessGroup`` (``_register_backend``,
``_set_default_backend``); make ``dist.get_backend(group)`` answer the user's backend for a
group built through the ``frtools`` plugin (``_world``); or reach the default group's store.
Each function says which private name it needs; a torch release that renames one breaks it
here, and the recorder then warns once and lets the job run unrecorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup


def group_creation_helper() -> Callable[..., Any]:
    """``_new_process_group_helper``: the function every group of a job is created by."""
    return c10d._new_process_group_helper


def replace_group_creation_helper(helper: Callable[..., Any]) -> None:
    c10d._new_process_group_helper = helper


def register_backend_plugin(name: str, creator: Callable[..., Any]) -> None:
    """Register ``creator`` as the c10d backend ``name`` (extended API), once per process.
    (``register_backend`` is public; whether a name is taken is only in ``_plugins``.)"""
    if name.upper() not in c10d.Backend._plugins:
        c10d.Backend.register_backend(name, creator, extended_api=True, devices=["cpu", "cuda"])


def device_backend_map(backend: Any) -> dict[str, str]:
    """device -> backend name (``gloo``, ``nccl`` …) that ``backend`` stands for."""
    mapping = c10d.BackendConfig(c10d.Backend(str(backend))).get_device_backend_map()
    return {dev: str(b).lower() for dev, b in mapping.items()}


def nccl_split_source(backend: Any = "nccl") -> Any:
    """The default group's NCCL backend new groups split from, as the helper would choose
    (``_get_split_source``: ``(pg)`` up to torch 2.14, ``(pg, requested_backend)`` from
    2.15); None when it would not split."""
    if not (c10d.is_initialized() and c10d._get_default_group().bound_device_id):
        return None
    source = c10d._get_split_source
    try:
        if len(inspect.signature(source).parameters) >= 2:
            return source(c10d._get_default_group(), backend)
        return source(c10d._get_default_group())
    except Exception:
        return None


# torch's helper sets a new backend's sequence number up to 2.14; in 2.15 the call is a no-op
# that warns ("setSequenceNumberForGroup() is deprecated") on every group
_SETS_SEQUENCE_NUMBER = torch.torch_version.TorchVersion(torch.__version__) < (2, 15)


def _set_sequence_number(backend: Any) -> None:
    if _SETS_SEQUENCE_NUMBER:
        backend._set_sequence_number_for_group()


def make_backend(
    backend_str: str, store: Any, rank: int, size: int, timeout: Any, opts: Any, **nccl: Any
) -> tuple[Any, Any]:
    """(backend type, real backend) built the way ``_new_process_group_helper`` does:
    sequence numbers set for the group (``_set_sequence_number_for_group``, before 2.15) and, for NCCL,
    the options' timeout (``_timeout``), split source and color (``_process_group_color``).
    ``nccl``: ``backend_options`` (the user's ``ProcessGroupNCCL.Options`` or None) and
    ``split_from``."""
    ranks = list(opts.global_ranks_in_group)
    group_name = opts.group_id
    if backend_str == "gloo":
        backend = c10d.ProcessGroupGloo(store, rank, size, timeout=timeout)
        backend.options.global_ranks_in_group = ranks
        backend.options.group_name = group_name
        _set_sequence_number(backend)
        return ProcessGroup.BackendType.GLOO, backend
    options = nccl.get("backend_options")
    if options is None:
        options = c10d.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    options._timeout = timeout
    split_from = nccl.get("split_from")
    if split_from is not None:
        options.split_from = split_from
        options.split_color = c10d._process_group_color(ranks)
    options.global_ranks_in_group = ranks
    options.group_name = group_name
    backend = c10d.ProcessGroupNCCL(store, rank, size, options)
    _set_sequence_number(backend)
    return ProcessGroup.BackendType.NCCL, backend


def attach_backends(pg: ProcessGroup, backends: list[tuple[str, Any, Any]]) -> None:
    """Register each (device, backend type, backend) for its device, the first type as the
    default (``_register_backend``, ``_set_default_backend``): DDP's start-up checks and
    ``pg._get_backend(device)`` then find the real backends."""
    first_type = None
    for device, backend_type, backend in backends:
        pg._register_backend(torch.device(device), backend_type, backend)
        first_type = first_type or backend_type
    if first_type is not None:
        pg._set_default_backend(first_type)


def keep_user_backend(pg: ProcessGroup, backend: Any, prefix_store: Any) -> None:
    """Record ``backend`` (the user's, not ``frtools``) as the group's in ``_world``, so that
    ``dist.get_backend(group)`` answers ``gloo``/``nccl``."""
    world = c10d._world
    world.pg_map[pg] = (backend, prefix_store)
    world.pg_backend_config[pg] = str(c10d.BackendConfig(c10d.Backend(str(backend))))


# -- torch >= 2.15: process-group hooks and one-sided windows ---------------------------------


def has_process_group_hooks() -> bool:
    """``ProcessGroup.register_pre_hook``/``register_post_hook`` exist (torch 2.15)."""
    return hasattr(ProcessGroup, "register_pre_hook") and hasattr(
        ProcessGroup, "register_post_hook"
    )


def hook_op_names() -> Any:
    """The enum of op names the hooks report (``HookOpName``)."""
    from torch._C import _distributed_c10d

    return _distributed_c10d.HookOpName


def group_registration() -> Callable[..., Any]:
    """``_register_pg_in_world``: every group of a job is published through it (2.15:
    ``init_process_group``, ``new_group``, ``new_subgroups``, ``split_group``,
    ``shrink_group``), once built — the one place to see each group (there is no global
    hook nor a group-creation callback)."""
    return c10d._register_pg_in_world


def replace_group_registration(fn: Callable[..., Any]) -> None:
    c10d._register_pg_in_world = fn


def existing_groups() -> list[Any]:
    """The groups this process has already created (``_world.pg_map``), default first."""
    groups = list(c10d._world.pg_map)
    default = c10d._get_default_group() if c10d.is_initialized() else None
    return sorted(groups, key=lambda pg: pg is not default)


def backend_names(pg: Any) -> list[str]:
    """The names of a group's real backends, one per device type (``gloo``, ``nccl2``)."""
    names = []
    try:
        for device in pg._device_types:
            names.append(str(pg._get_backend(device).name()).lower())
    except Exception:
        pass
    return names


def backend_of(pg: Any) -> str:
    """The backend name a group was created with (``_world.pg_map``)."""
    return str(c10d._world.pg_map.get(pg, ("", None))[0])


def group_members(pg: Any) -> list[int] | None:
    """A group's global ranks in group-rank order (``_world.pg_group_ranks``, which torch
    fills right after publishing a group); None while unknown."""
    mapping = c10d._world.pg_group_ranks.get(pg)
    if mapping:
        return sorted(mapping, key=mapping.__getitem__)
    if c10d.is_initialized() and pg is c10d._get_default_group():
        return list(range(pg.size()))
    return None


def is_default_group_pending() -> bool:
    """No default group yet: the group being published is the job's first (its rank and
    size are the process's global ones)."""
    return not c10d.is_initialized()


def window_class() -> Any:
    """The one-sided window class (``Window``), or None before torch 2.15."""
    from torch._C import _distributed_c10d

    return getattr(_distributed_c10d, "Window", None)


def default_store() -> Any:
    """The default group's store (``_get_default_store``), once ``init_process_group`` ran."""
    return c10d._get_default_store()


# -- start-up phases (frtools.recorder.startup) ---------------------------------------------


def replace_init_process_group(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap ``init_process_group`` where callers find it: ``distributed_c10d`` and, once it
    has copied the name, ``torch.distributed`` (``enable()`` may run before that copy, while
    the package is being imported: it then copies the wrapper)."""
    import sys

    wrapped = wrap(c10d.init_process_group)
    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "init_process_group", None) is (
        c10d.init_process_group
    ):
        package.init_process_group = wrapped
    c10d.init_process_group = wrapped


def replace_rendezvous(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap the ``rendezvous`` that ``init_process_group`` calls (a global of
    ``distributed_c10d``, imported from ``torch.distributed.rendezvous``)."""
    c10d.rendezvous = wrap(c10d.rendezvous)
