"""Seeing every process group a job creates: hooks on each (torch >= 2.15), or routing each
through a ``RecordingProcessGroup`` (older torch).

``install(opener, mode)`` picks the path: ``hooks`` where torch calls process-group hooks
(``FRTOOLS_CAPTURE`` may force ``wrap``), else ``wrap``. The hooks path wraps the function
that publishes every group and attaches a pre/post hook pair to each (``hooks``), and wraps
the one-sided window methods. On the wrap path, ``install()`` registers a c10d backend plugin named ``frtools`` and wraps the function through
which every group is created (``c10d_internals.group_creation_helper``). For a group whose
backends are all ``gloo``/``nccl`` the wrapper asks the helper for backend ``frtools``
instead, and afterwards puts the user's backend name back (``dist.get_backend(group)`` still
answers ``gloo``/``nccl``; ``pg.name()`` too). The plugin's creator builds the real backends
(with the same options, sequence numbers and NCCL split source as the helper would) and
returns a ``RecordingProcessGroup`` holding them.

A group whose backend is neither gloo nor nccl (mpi, ucc, xccl, a third-party plugin) is left
unwrapped and unrecorded, with one warning. Any failure here creates the user's group plainly.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

# not torch.distributed: enable() may run while that package is still being imported (the
# bootstrap calls it right after distributed_c10d is loaded)
import torch.distributed.distributed_c10d as c10d

from frtools.recorder.capture import c10d_internals, hooks
from frtools.recorder.capture.process_group import RecordingProcessGroup
from frtools.recorder.capture.recorder import Recorder
from frtools.recorder.notices import note, recording_disabled

BACKEND_NAME = "frtools"
_WRAPPABLE = ("gloo", "nccl")


class _Installation:
    """This process's recording switchboard (one per process)."""

    def __init__(self) -> None:
        # opener(rank, world_size, backend) -> Recorder | None, called at the first group
        self.opener: Callable[[int, int, str], Recorder | None] | None = None
        self.recorder: Recorder | None = None
        self.open_failed = False
        self.paused = False  # new groups are created plainly
        self.original_helper: Callable[..., Any] | None = None
        self.original_registration: Callable[..., Any] | None = None
        self.mode: str | None = None  # "hooks" or "wrap", fixed at the first install


_installed = _Installation()
# what the creator needs for the group being built on this thread (set by the wrapper)
_building = threading.local()


def install(opener: Callable[[int, int, str], Recorder | None], mode: str | None = None) -> str:
    """Record every process group created from now on; returns the path taken, ``hooks``
    or ``wrap``.

    ``opener(rank, world_size, backend)`` is called once, at the first group this process
    creates, and returns the Recorder (or None after warning: the job goes on unrecorded).
    ``mode``: ``hooks``, ``wrap``, or None for hooks where this torch has them.
    """
    _installed.opener = opener
    _installed.paused = False
    if _installed.mode is None:
        _installed.mode = _choose(mode)
        if _installed.mode == "hooks":
            _install_hooks()
        else:
            _install_wrap()
    return _installed.mode


def capture_mode() -> str | None:
    """The path installed (``hooks``, ``wrap``), None before ``install``."""
    return _installed.mode


def _choose(mode: str | None) -> str:
    if mode == "wrap":
        return "wrap"
    if hooks.available():
        return "hooks"
    if mode == "hooks":
        note("FRTOOLS_CAPTURE=hooks: this torch has no process-group hooks; wrapping groups")
    return "wrap"


def _install_wrap() -> None:
    c10d_internals.register_backend_plugin(BACKEND_NAME, _create)
    original = c10d_internals.group_creation_helper()
    _installed.original_helper = original
    c10d_internals.replace_group_creation_helper(_wrapped_helper(original))


def _install_hooks() -> None:
    original = c10d_internals.group_registration()
    _installed.original_registration = original
    c10d_internals.replace_group_registration(_hooking_registration(original))
    hooks.wrap_windows(c10d_internals.window_class(), c10d_internals.ProcessGroup, _group_state)


def _group_state(pg: Any) -> Any:
    """The recording state of a group, on either path (None: not recorded)."""
    if isinstance(pg, RecordingProcessGroup):
        return pg._frs
    return hooks.hooked(pg)


def _hook(pg: Any, backend: Any) -> None:
    """Attach our hooks to ``pg`` (opening the black box at the first group)."""
    if _installed.paused or hooks.hooked(pg) is not None:
        return
    first = c10d_internals.is_default_group_pending()
    recorder = _recorder_for(pg.rank(), pg.size(), first, str(backend))
    if recorder is None or not recorder.enabled:
        return
    hooks.attach(pg, recorder, hooks.backend_prefix(pg, backend))


def _hooking_registration(original: Callable[..., Any]) -> Callable[..., Any]:
    def _register_pg_in_world(pg: Any, backend_name: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(pg, backend_name, *args, **kwargs)
        try:
            _hook(pg, backend_name)
        except Exception as exc:  # a recorder bug must not stop group creation
            _installed.open_failed = True
            recording_disabled(f"{type(exc).__name__}: {exc}")
        return result

    _register_pg_in_world.__wrapped__ = original  # type: ignore[attr-defined]
    return _register_pg_in_world


def uninstall() -> None:
    """Stop recording: existing groups stop recording, new groups are plain ones."""
    recorder = _installed.recorder
    if recorder is not None:
        recorder.pause()
    _installed.paused = True


def current_recorder() -> Recorder | None:
    return _installed.recorder


def recording() -> bool:
    """Ops are being recorded, or will be from the first group on (the box is not open yet)."""
    recorder = _installed.recorder
    if recorder is None:
        return not _installed.open_failed
    return recorder.enabled


def open_if_job_running() -> None:
    """Enabled after ``init_process_group``: open the black box now (the rank is known). With
    hooks, the groups that exist are recorded from now on too; wrapping groups, the default
    group stays unrecorded, the groups created from now on are recorded."""
    if not c10d.is_initialized():
        return
    if _installed.mode == "hooks":
        for pg in c10d_internals.existing_groups():
            try:
                _hook(pg, c10d_internals.backend_of(pg))
            except Exception as exc:
                recording_disabled(f"{type(exc).__name__}: {exc}")
                return
    elif _installed.recorder is None:
        _recorder_for(c10d.get_rank(), c10d.get_world_size(), False, str(c10d.get_backend()))


def _recorder_for(group_rank: int, group_size: int, is_default: bool, backend: str) -> Any:
    """The process's Recorder, opened at the first group it creates (None: not recording)."""
    recorder = _installed.recorder
    if recorder is not None or _installed.open_failed:
        return recorder
    opener = _installed.opener
    if opener is None:
        return None
    if is_default:
        rank, world_size = group_rank, group_size
    else:  # enabled after init_process_group: the default group exists, unrecorded
        rank, world_size = c10d.get_rank(), c10d.get_world_size()
    recorder = opener(rank, world_size, backend)
    if recorder is None:
        _installed.open_failed = True
    _installed.recorder = recorder
    return recorder


def _real_backend_map(backend: Any) -> dict[str, str] | None:
    """device -> backend the user asked for; None when it is not one we can wrap."""
    try:
        result = c10d_internals.device_backend_map(backend)
    except Exception:
        return None
    if not result or any(b not in _WRAPPABLE for b in result.values()):
        return None
    return result


def _prepare(
    group_size: int,
    group_rank: int,
    global_ranks_in_group: list[int],
    backend: Any,
    group_name: Any,
) -> dict[str, Any] | None:
    """What the ``frtools`` creator needs to build this group; None: create it plainly."""
    if _installed.paused:
        return None
    mapping = _real_backend_map(backend)
    if mapping is None:
        warnings.warn(
            f"frtools: process group {group_name!r} with backend {str(backend)!r} is not "
            "recorded (only gloo and nccl are)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    try:
        recorder = _recorder_for(group_rank, group_size, not global_ranks_in_group, str(backend))
    except Exception as exc:
        _installed.open_failed = True
        recording_disabled(f"{type(exc).__name__}: {exc}")
        return None
    if recorder is None or not recorder.enabled:
        return None
    return {
        "map": mapping,
        "backend_name": str(backend),
        "recorder": recorder,
        "split_from": c10d_internals.nccl_split_source(),
    }


def _create(dist_opts: Any, backend_options: Any) -> Any:
    """The ``frtools`` backend creator: real backends inside a RecordingProcessGroup."""
    pending = getattr(_building, "pending", None)
    if pending is None:
        raise RuntimeError("the frtools backend is only used through frtools.recorder.enable()")
    store = dist_opts.store
    rank, size, timeout = dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout
    backends = []
    made: dict[str, tuple[Any, Any]] = {}
    for device, backend_str in pending["map"].items():
        if backend_str not in made:
            made[backend_str] = c10d_internals.make_backend(
                backend_str,
                c10d.PrefixStore(f"{backend_str}/", store),
                rank,
                size,
                timeout,
                dist_opts,
                backend_options=backend_options,
                split_from=pending["split_from"],
            )
        backend_type, backend = made[backend_str]
        backends.append((device, backend_type, backend))
    ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    return RecordingProcessGroup(
        store, rank, size, pending["recorder"], backends, ranks, pending["backend_name"]
    )


def _wrapped_helper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _new_process_group_helper(
        group_size: int,
        group_rank: int,
        global_ranks_in_group: list[int],
        backend: Any,
        store: Any,
        group_name: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def plain() -> Any:
            return original(
                group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                *args, **kwargs,
            )  # fmt: skip

        try:
            pending = _prepare(group_size, group_rank, global_ranks_in_group, backend, group_name)
        except Exception as exc:  # a recorder bug must not stop group creation
            _installed.open_failed = True
            recording_disabled(f"{type(exc).__name__}: {exc}")
            pending = None
        if pending is None:
            return plain()
        recorder = pending["recorder"]
        _building.pending = pending
        try:
            pg, prefix_store = original(
                group_size, group_rank, global_ranks_in_group, BACKEND_NAME, store, group_name,
                *args, **kwargs,
            )  # fmt: skip
        except Exception as exc:
            # building the wrapped group failed: the user's group, plainly, is what matters
            recorder.fail(exc)
            _installed.paused = True
            return plain()
        finally:
            _building.pending = None
        if isinstance(pg, RecordingProcessGroup):
            device_id = kwargs.get("device_id", args[3] if len(args) > 3 else None)
            if device_id is not None and pg.bound_device_id is None:
                pg.bound_device_id = device_id  # set on the helper's own pg object, not ours
            c10d_internals.keep_user_backend(pg, backend, prefix_store)
            try:
                pg.frtools_register(str(pg.group_name), str(pg.group_desc))
            except Exception as exc:
                recorder.fail(exc)
        return pg, prefix_store

    _new_process_group_helper.__wrapped__ = original  # type: ignore[attr-defined]
    return _new_process_group_helper
