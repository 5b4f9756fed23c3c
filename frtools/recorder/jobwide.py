"""The in-process side of job-wide dumps and of the stall hand-off.

``enable()`` calls ``start(...)`` once the default process group exists. A daemon thread
then polls the job's own TCPStore (one ``add(key, 0)`` round trip per poll, default every
0.5 s, on its own client connection so it never queues behind the training thread's store
calls) and the local black box's stall flag:

* a **dump request** (``frtools dump --job-wide``, or another rank's stall) → write this
  rank's snapshot (``rank_<R>.frt``, a consistent copy of the live black box) and all
  threads' Python stacks (``rank_<R>.stacks``) into the requested directory, and record the
  answer in the store;
* a **stall** (the native watchdog set the header's stall flag) → write the same into
  ``FRTOOLS_DUMP_DIR`` (default ``<FRTOOLS_DIR>/<job>/dumps``), and, for the first rank to
  notice, ask every other rank to do the same, wait briefly for their answers and write
  ``manifest.json`` there. One line on stderr names the directory.

A rank whose Python threads cannot run (another thread holds the GIL) cannot answer here;
its black box stays on its host, where ``frtools dump`` (per host) still collects it.
Nothing here may hurt the job: every failure warns once and the thread goes on or stops.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from frtools.config import DUMP_DIR, JOBWIDE, JOBWIDE_POLL, STORE_PREFIX
from frtools.formats import store_protocol as protocol
from frtools.formats.manifest import BOX_SUFFIX, STACKS_SUFFIX, Manifest, rank_file_name
from frtools.recorder.notices import note
from frtools.recorder.shutdown import before_finalization

# how long the rank that saw the stall waits for the others before writing the manifest
STALL_GATHER_S = 5.0
# a stall seen by another rank less than this long ago is the same episode
STALL_QUIET_S = 10.0
_MAX_FAILURES = 20  # consecutive store errors before the watcher gives up (job ending)


_started: JobWideWatcher | None = None
_starting = threading.Lock()  # enable()'s starter thread and start_job_wide_watcher() race


def _own_connection(store: Any) -> Any:
    raw = protocol.unwrap_store(store)
    clone = getattr(raw, "clone", None)
    if clone is not None:
        try:
            return clone()
        except Exception:
            pass
    return raw


def write_rank_dump(
    rank: int, blackbox_path: str | os.PathLike[str], directory: str | os.PathLike[str]
) -> list[str]:
    """Write this process's snapshot and all threads' stacks into ``directory``; returns the
    file names written. Called from a Python thread, so faulthandler writes the stacks
    directly (the main thread shows where it stands)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    stacks = out / rank_file_name(rank, STACKS_SUFFIX)
    tmp = out / f".{stacks.name}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    os.replace(tmp, stacks)
    files.append(stacks.name)
    dst = out / rank_file_name(rank, BOX_SUFFIX)
    tmp = out / f".{dst.name}.{os.getpid()}.tmp"
    try:
        from frtools.formats.blackbox import copy_consistent
    except ImportError:
        shutil.copyfile(blackbox_path, tmp)
    else:
        copy_consistent(str(blackbox_path), str(tmp))
    os.replace(tmp, dst)
    files.append(dst.name)
    return files


def default_dump_dir(blackbox_path: str | os.PathLike[str]) -> Path:
    """``FRTOOLS_DUMP_DIR``, else ``dumps/`` next to the black box (``<FRTOOLS_DIR>/<job>``)."""
    configured = DUMP_DIR.read()
    return Path(configured) if configured else Path(blackbox_path).parent / "dumps"


class JobWideWatcher:
    """The watcher thread of one rank; ``start()`` builds and starts it."""

    def __init__(
        self,
        store: Any,
        rank: int,
        blackbox_path: str | os.PathLike[str],
        stacks_path: str | os.PathLike[str] | None = None,
        *,
        world_size: int | None = None,
        stalled: Callable[[], bool] | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
        prefix: str | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.store = _own_connection(store)
        self.rank = rank
        self.blackbox_path = str(blackbox_path)
        self.stacks_path = str(stacks_path) if stacks_path else None
        self.world_size = world_size
        self.stalled = stalled
        self.dump_dir = Path(dump_dir) if dump_dir else default_dump_dir(blackbox_path)
        self.prefix = prefix if prefix is not None else STORE_PREFIX.read()
        self.poll_s = poll_s or JOBWIDE_POLL.read()
        self.host = socket.gethostname()
        self.last_seq = 0
        self.was_stalled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frtools-jobwide", daemon=True)

    def start(self) -> JobWideWatcher:
        p = self.prefix
        self.last_seq = protocol.current_seq(self.store, p)
        protocol.register_rank(
            self.store, p, self.rank, host=self.host, pid=os.getpid(), blackbox=self.blackbox_path
        )
        if self.world_size:
            protocol.set_world_size(self.store, p, self.world_size)
        self._thread.start()
        before_finalization(lambda: self.stop(join_s=2.0))
        return self

    def stop(self, join_s: float = 0.0) -> None:
        """Stop polling; with ``join_s``, wait that long for the thread to end (at exit:
        see ``frtools.recorder.shutdown``)."""
        self._stop.set()
        thread = self._thread
        if join_s > 0 and thread.is_alive() and thread is not threading.current_thread():
            thread.join(join_s)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            if not _job_running():
                return  # the group was destroyed: the store may be gone with it
            try:
                self.poll_once()
                failures = 0
            except Exception as exc:
                failures += 1
                if failures == 1 and _job_running() and not _interpreter_ending():
                    note(f"rank {self.rank}: job-wide dump watcher: {type(exc).__name__}: {exc}")
                if failures >= _MAX_FAILURES:
                    return

    def poll_once(self) -> None:
        if self.stalled is not None:
            stalled = bool(self.stalled())
            if stalled and not self.was_stalled:  # a new stall episode
                self._on_stall()
            self.was_stalled = stalled
        latest = protocol.latest_request(self.store, self.prefix, self.last_seq)
        if latest is not None:
            self.last_seq, request = latest
            self._answer(self.last_seq, request)

    def _answer(self, seq: int, request: dict[str, Any]) -> Path:
        directory = Path(request["dir"]) if request.get("dir") else self.dump_dir
        files = write_rank_dump(self.rank, self.blackbox_path, directory)
        protocol.post_answer(
            self.store,
            self.prefix,
            seq,
            self.rank,
            host=self.host,
            pid=os.getpid(),
            directory=str(directory),
            files=files,
            blackbox=self.blackbox_path,
        )
        return directory

    def _on_stall(self) -> None:
        p = self.prefix
        if not self._claim_stall():
            files = write_rank_dump(self.rank, self.blackbox_path, self.dump_dir)
            note(
                f"rank {self.rank}: stall detected; snapshot and stacks written to "
                f"{self.dump_dir} ({', '.join(files)})"
            )
            return
        seq = protocol.issue_request(
            self.store,
            p,
            {
                "dir": None,
                "reason": f"stall detected on rank {self.rank}",
                "by": f"rank {self.rank} on {self.host}",
                "time_ns": time.time_ns(),
            },
        )
        self.last_seq = max(self.last_seq, seq)
        directory = self._answer(seq, {})
        note(
            f"rank {self.rank}: stall detected; every rank writes its snapshot and stacks "
            f"to {directory} (analyze with: frtools analyze {directory})"
        )
        self._write_stall_manifest(seq, directory)

    def _claim_stall(self) -> bool:
        """True for the one rank that asks everybody: the first to see a stall, unless
        another rank asked within the last ``STALL_QUIET_S`` seconds (same episode)."""
        key = protocol.stall_claim_key(self.prefix)
        now = time.time_ns()
        old = self.store.get(key) if self.store.check([key]) else b""
        if old and now - int(old or 0) < STALL_QUIET_S * 1e9:
            return False
        won = self.store.compare_set(key, old.decode(), str(now))
        return (won.decode() if isinstance(won, bytes) else str(won)) == str(now)

    def _write_stall_manifest(self, seq: int, directory: Path) -> None:
        job_id = Path(self.blackbox_path).parent.name
        manifest = Manifest(job_id=job_id, mode="stall", world_size=self.world_size)
        protocol.gather_answers(self.store, self.prefix, seq, manifest, STALL_GATHER_S)
        manifest.notes.append(f"requested by rank {self.rank} after its watchdog saw a stall")
        manifest.write(directory)


def _job_running() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is None or bool(dist.is_initialized())
    except Exception:
        return False


def _interpreter_ending() -> bool:
    return sys.is_finalizing()


def start(
    store: Any,
    rank: int,
    blackbox_path: str | os.PathLike[str],
    stacks_path: str | os.PathLike[str] | None = None,
    *,
    world_size: int | None = None,
    stalled: Callable[[], bool] | None = None,
) -> JobWideWatcher | None:
    """Start this rank's job-wide dump watcher (a daemon thread); never raises.

    ``store``: the default group's store (PrefixStores are unwrapped). ``stalled``: the black box's ``stalled`` method, to hand a watchdog stall
    to every rank. Returns None (after one warning) when the watcher cannot start.
    """
    global _started
    if not JOBWIDE.read():
        return None
    with _starting:
        if _started is not None:
            return _started
        try:
            _started = JobWideWatcher(
                store,
                rank,
                blackbox_path,
                stacks_path,
                world_size=world_size,
                stalled=stalled,
            ).start()
            return _started
        except Exception as exc:
            note(f"rank {rank}: job-wide dumps disabled: {type(exc).__name__}: {exc}")
            return None
