"""The frtools recorder: every c10d op of this process into a crash-proof black-box file.

Turn it on in one of three ways:

* ``frtools.recorder.enable()`` in the training script, before ``init_process_group``. Called
  later, it records the groups created from then on (the default group stays unrecorded).
* ``FRTOOLS_RECORD=1`` with ``frtools/recorder/_bootstrap`` on ``PYTHONPATH``: its
  ``sitecustomize`` calls ``enable()`` as soon as ``torch.distributed`` is imported.
* ``frtools run [--dir D] -- CMD ...`` does the above for every Python process of CMD.

The file, ``<FRTOOLS_DIR>/<job_id>/rank_<R>.frt`` (default ``FRTOOLS_DIR``:
``/dev/shm/frtools-<uid>``), is created by ``enable()`` when a launcher states the rank
(``RANK``, ``WORLD_SIZE``) and no group exists yet — the start-up phases are recorded from
then on (``recorder.startup``) — else at the first process group this process creates (when
the rank is known): private to this user, new, never through a link (``recorder.private``). Any failure — no native module, unwritable
directory, unknown backend — prints one line ``frtools: recording disabled: <reason>`` and
the job runs on unrecorded. Settings: the ``FRTOOLS_*`` variables of ``frtools.config``.

This module imports neither torch nor the native part until ``enable()`` is called.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

from frtools.recorder import private

__all__ = ["enable", "disable", "is_enabled", "output_path", "start_job_wide_watcher"]

_session: dict[str, Any] = {}

# the black box's string table (op names, shapes, call stacks: each text once)
STRINGS_BYTES = 4 << 20


def _identity(rank: int, world_size: int, backend: str, job_id: str) -> dict[str, Any]:
    import torch

    device, device_id = ("cpu" if backend else None), None  # no backend yet: not known
    if "nccl" in backend and torch.cuda.is_available():
        try:
            index = torch.cuda.current_device()
            device = f"cuda:{index}"
            device_id = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            device = "cuda"
    local_rank = os.environ.get("LOCAL_RANK", "")
    return {
        "job_id": job_id,
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "local_rank": int(local_rank) if local_rank.isdigit() else None,
        "device": device,
        "device_id": device_id,
        "torch_version": torch.__version__,
        "backend": backend,
    }


def _open(rank: int, world_size: int, backend: str) -> Any:
    """The Recorder of this process's first group: on the box opened at process start (its
    identity restated with the backend and device now known), else on a new box; None
    (after one line) when there is none."""
    from frtools.recorder import capture
    from frtools.recorder.notices import note

    box = _session.get("box")
    if box is None:
        box = _open_box(rank, world_size, backend)
        if box is None:
            return None
    else:
        if (rank, world_size) != (_session["rank"], _session["world_size"]):
            note(
                f"rank {rank} of {world_size} records in the box opened as rank "
                f"{_session['rank']} of {_session['world_size']} (the launcher's environment)"
            )
        try:
            identity = _identity(_session["rank"], world_size, backend, _session["config"].job_id)
            box.set_identity(json.dumps(identity))
        except Exception as exc:  # a bonus: the box keeps the identity it opened with
            note(f"identity not restated: {exc}")
    cfg = _session["config"]
    recorder = capture.Recorder(box, poll_ms=max(5, min(cfg.poll_ms, 100)), stacks=cfg.stacks)
    _session["recorder"] = recorder
    return recorder


def _open_at_process_start() -> None:
    """Under a launcher (``RANK``/``WORLD_SIZE`` set) and before any group exists, open the
    box now and record the start-up phases (``frtools.recorder.startup``): a rank that never
    reaches ``init_process_group`` is then recorded too, and its peers' wait in rendezvous."""
    from frtools.recorder import startup
    from frtools.recorder.capture import c10d_internals

    if _session.get("box") is not None or not c10d_internals.is_default_group_pending():
        return
    ids = startup.launcher_rank(dict(os.environ))
    if ids is None:
        return
    from frtools.formats.manifest import rank_file_name

    if os.path.lexists(os.path.join(_session["config"].job_dir, rank_file_name(ids[0]))):
        # a process the rank started (a spawned DataLoader worker inherits RANK) or an earlier
        # run of the rank: not this one's box; the first group decides, as without a launcher
        return
    box = _open_box(*ids, "")
    if box is not None:
        startup.watch(box)


def _flush() -> None:
    """Mark the works that finished (at exit): the recorder's, once there is one."""
    recorder = _session.get("recorder")
    if recorder is not None:
        recorder.poll()


def _open_box(rank: int, world_size: int, backend: str) -> Any:
    """Create this rank's black box, stacks file and watchdog; None (after one line) if not."""
    from frtools.formats.manifest import rank_file_name, stacks_path
    from frtools.recorder.native import NativeUnavailable, load_native, register_stack_signal
    from frtools.recorder.notices import note, recording_disabled

    cfg = _session["config"]
    path = os.path.join(cfg.job_dir, rank_file_name(rank))
    try:
        native = load_native()
    except NativeUnavailable as exc:
        recording_disabled(str(exc))
        return None
    try:
        access = _prepare_job_dir(cfg, rank)
    except OSError as exc:
        recording_disabled(f"cannot create {path}: {exc}")
        return None
    try:
        identity = json.dumps(_identity(rank, world_size, backend, cfg.job_id))
        # a new file, never through what is at the path (see frtools.recorder.private)
        box = native.BlackBox(
            path,
            cfg.buffer_size,
            STRINGS_BYTES,
            identity,
            mode=access.file_mode,
            gid=-1 if access.gid is None else access.gid,
        )
    except Exception as exc:
        recording_disabled(f"cannot create {path}: {exc}")
        return None
    try:
        fd = private.create_file(str(stacks_path(path)), access, os.O_WRONLY | os.O_APPEND)
        stacks = os.fdopen(fd, "a")  # kept for the process
        # chains only to a real earlier handler: chaining to SIGUSR2's default would kill us
        register_stack_signal(cfg.stack_signal, stacks)
        _session["stacks_file"] = stacks
    except Exception as exc:  # stacks are a bonus: record without them
        note(f"no stacks file for rank {rank}: {exc}")
    try:
        box.start_watchdog(cfg.poll_ms, cfg.stall_seconds, cfg.stack_signal)
    except Exception as exc:
        note(f"watchdog not started: {exc}")
    _session.update(path=path, box=box, rank=rank, world_size=world_size, access=access)
    _start_jobwide_when_ready()
    _watch_exit(box)
    return box


def _watch_exit(box: Any) -> None:
    """Record how this process ends (exit status, exception, signal, os._exit) in its box."""
    from frtools.recorder import exits
    from frtools.recorder.notices import note

    try:
        exits.watch(box, flush=_flush)
    except Exception as exc:  # a bonus: the ops are recorded without it
        note(f"exit facts not recorded: {exc}")


def _prepare_job_dir(cfg: Any, rank: int) -> private.Access:
    """This job's folder, ours and private (see ``frtools.recorder.private``); the modes its
    files get. A share group this user cannot give files to leaves them private (one note)."""
    from frtools.config import DEFAULT_DIR
    from frtools.recorder.notices import note

    default_root = os.path.abspath(cfg.dir) == os.path.abspath(DEFAULT_DIR)
    access = private.access_for(cfg.share_gid)
    try:
        private.prepare_job_dir(cfg.dir, cfg.job_dir, access, default_root=default_root)
    except PermissionError as exc:
        if access.gid is None or isinstance(exc, private.Unsafe):
            raise
        note(
            f"rank {rank}: cannot give the records to group {access.gid} ({exc}); "
            "they stay private to this user"
        )
        access = private.PRIVATE
        private.prepare_job_dir(cfg.dir, cfg.job_dir, access, default_root=default_root)
    return access


def _start_jobwide_when_ready() -> None:
    """Start the job-wide dump watcher once the default group (and so its store) exists.

    ``_open`` runs while the first group is being built, before ``init_process_group`` has
    returned, so a short-lived daemon thread waits for it instead of blocking the job. It is
    stopped and joined before the interpreter finalizes (see ``shutdown``): a short job
    could otherwise end while it is inside a store call, and abort at exit.
    """
    import threading
    import time

    from frtools.recorder.notices import note
    from frtools.recorder.shutdown import before_finalization

    stop = threading.Event()

    def wait_then_start() -> None:
        try:
            import torch.distributed.distributed_c10d as c10d

            deadline = time.monotonic() + 3600
            while not c10d.is_initialized():
                if time.monotonic() > deadline or stop.wait(0.2):
                    return
            if not stop.is_set():
                start_job_wide_watcher()
        except Exception as exc:  # never hurt the job
            note(f"job-wide dump watcher not started: {exc}")

    starter = threading.Thread(target=wait_then_start, name="frtools-jobwide-start", daemon=True)

    def stop_starter() -> None:
        stop.set()
        if starter.is_alive() and starter is not threading.current_thread():
            starter.join(timeout=5.0)

    before_finalization(stop_starter)
    starter.start()


def start_job_wide_watcher() -> bool:
    """Start this rank's job-wide dump watcher now; returns whether it runs.

    ``enable()`` starts it by itself within 0.2 s of ``init_process_group`` returning (from a
    background thread); a job that must answer ``frtools dump --job-wide`` from its very
    first op calls this right after ``init_process_group``. Starting it twice is harmless.
    False when this process records nothing yet or the watcher cannot start (one line says
    why).
    """
    path, box = _session.get("path"), _session.get("box")
    if not path:
        return False
    from frtools.recorder.notices import note

    try:
        from frtools.formats.manifest import stacks_path
        from frtools.recorder import jobwide
        from frtools.recorder.capture.c10d_internals import default_store

        watcher = jobwide.start(
            default_store(),
            _session["rank"],
            path,
            stacks_path(path),
            world_size=_session["world_size"],
            stalled=box.stalled,
            access=_session.get("access"),
            job_id=_session["config"].job_id,
        )
    except Exception as exc:  # the watcher is a bonus: never hurt the job
        note(f"job-wide dump watcher not started: {exc}")
        return False
    return watcher is not None


def enable(
    dir: str | None = None,
    job_id: str | None = None,
    buffer_size: int | None = None,
    stall_seconds: float | None = None,
) -> bool:
    """Record every c10d op of the process groups created from now on.

    Arguments override the ``FRTOOLS_*`` environment variables. Returns False (after one
    warning line) when recording cannot start; the job is never stopped by it.
    """
    from frtools.config import ConfigError, recorder_config
    from frtools.recorder.notices import recording_disabled

    try:
        cfg = recorder_config(
            dir=dir, job_id=job_id, buffer_size=buffer_size, stall_seconds=stall_seconds
        )
    except ConfigError as exc:
        recording_disabled(str(exc))
        return False
    _session["config"] = cfg
    try:
        from frtools.recorder import capture

        capture.install(_open, cfg.capture)
        capture.open_if_job_running()
        _open_at_process_start()
    except Exception as exc:
        recording_disabled(f"{type(exc).__name__}: {exc}")
        return False
    _session["enabled"] = True
    return True


def disable() -> None:
    """Stop recording (existing groups stop recording; new groups are plain ones)."""
    if not _session.get("enabled"):
        return
    from frtools.recorder import capture

    capture.uninstall()
    _session["enabled"] = False


def is_enabled() -> bool:
    """True while ops are being recorded (or will be, from the first group on)."""
    if not _session.get("enabled"):
        return False
    from frtools.recorder import capture

    return capture.recording()


def output_path() -> str | None:
    """This process's black-box file, once it is open."""
    return _session.get("path")


def enable_on_torch_distributed_import() -> None:
    """Call ``enable()`` right after ``torch.distributed`` is imported (sitecustomize uses it).

    Importing torch in every Python process a launcher starts would be slow and pointless;
    this only costs a path-finder lookup per import until torch.distributed appears.
    """
    import importlib.abc
    import importlib.machinery

    target = "torch.distributed.distributed_c10d"

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target_mod: Any = None) -> Any:
            if fullname != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original_exec = loader.exec_module

            def exec_module(module: Any) -> None:
                original_exec(module)
                try:
                    enable()
                except Exception as exc:  # never break the import of torch
                    from frtools.recorder.notices import recording_disabled

                    recording_disabled(f"{type(exc).__name__}: {exc}")

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    if target in sys.modules:
        enable()
    else:
        sys.meta_path.insert(0, _Finder())
