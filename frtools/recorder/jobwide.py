"""The in-process side of job-wide dumps and of the stall hand-off.

``enable()`` calls ``start(...)`` once the default process group exists. A daemon thread
then polls the job's own TCPStore (one ``add(key, 0)`` round trip per poll, default every
0.5 s, on its own client connection so it never queues behind the training thread's store
calls) and the local black box's stall flag:

* a **dump request** (``frtools dump --job-wide``, or another rank's stall) → write this
  rank's snapshot (``rank_<R>.frt``, a consistent copy of the live black box) and all
  threads' Python stacks (``rank_<R>.stacks``) into its own dump folder, and record the
  answer in the store;
* a **stall** (the native watchdog set the header's stall flag) → write the same there, and,
  for the first rank to notice, ask every other rank to do the same, wait briefly for their
  answers and write ``manifest.json`` there. One line on stderr names the directory.

The dump folder is the rank's own configuration's: ``FRTOOLS_DUMP_DIR``, default
``<FRTOOLS_DIR>/<job>/dumps``, a folder of this user's (``frtools.recorder.private``). The
store has no authentication: whoever reaches it can ask for dumps, so nothing read from it
chooses a path (a ``dir`` in a request is ignored), temporary files get unpredictable names
(``mkstemp``), and a rank writes at most one copy per ``FRTOOLS_DUMP_INTERVAL`` seconds — a
request in between is answered with the last copy — into fixed names (``rank_<R>.frt``,
``rank_<R>.stacks``: one copy per rank, the older one replaced).

Every ``FRTOOLS_PROGRESS_INTERVAL`` s (and at once when a stall is flagged) the thread also
writes this rank's *beacon* into the store: the op it is in and its groups' frontiers, read
from its own box (``frtools.formats.progress``), so ``frtools top --job-wide`` on any host shows
every rank. One small ``set`` per rank every 5 s beside the poll's ``add`` every 0.5 s.

A rank whose Python threads cannot run (another thread holds the GIL) cannot answer here;
its black box stays on its host, where ``frtools dump`` (per host) still collects it.
Nothing here may hurt the job: every failure warns once and the thread goes on or stops.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from frtools.config import (
    DEVICE_FACTS,
    DUMP_DIR,
    DUMP_INTERVAL,
    JOBWIDE,
    JOBWIDE_POLL,
    PROGRESS_INTERVAL,
    STORE_PREFIX,
)
from frtools.formats import progress as beacon
from frtools.formats import store_protocol as protocol
from frtools.formats.blackbox import read_snapshot
from frtools.formats.manifest import BOX_SUFFIX, STACKS_SUFFIX, Manifest, rank_file_name
from frtools.recorder import private
from frtools.recorder.notices import note
from frtools.recorder.shutdown import before_finalization

# how long the rank that saw the stall waits for the others before writing the manifest
STALL_GATHER_S = 5.0
# a stall seen by another rank less than this long ago is the same episode
STALL_QUIET_S = 10.0
_MAX_FAILURES = 20  # consecutive store errors before the watcher gives up (job ending)
# the device-facts child of a hand-off is killed after this long (its sources have their own,
# shorter deadlines: frtools.collect.device_facts)
DEVICE_FACTS_CHILD_S = 20.0


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
    rank: int,
    blackbox_path: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    access: private.Access = private.PRIVATE,
) -> list[str]:
    """Write this process's snapshot and all threads' stacks into ``directory`` (a folder of
    ours: see ``prepare_dump_dir``); returns the file names written. Called from a Python
    thread, so faulthandler writes the stacks directly (the main thread shows where it
    stands). Each file is written under a ``mkstemp`` name and renamed over the last copy:
    a reader sees the old copy or the new one, and nothing at a guessable name is opened."""
    out = Path(directory)
    files = []
    stacks = out / rank_file_name(rank, STACKS_SUFFIX)
    fd, tmp = tempfile.mkstemp(prefix=f".{stacks.name}.", suffix=".tmp", dir=out)
    try:
        private.set_file_access(fd, access)
        with os.fdopen(fd, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, stacks)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    files.append(stacks.name)
    dst = out / rank_file_name(rank, BOX_SUFFIX)
    # copy_consistent writes through names of its own: give it a private folder to write in
    work = tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=out)
    try:
        tmp = os.path.join(work, dst.name)
        try:
            from frtools.formats.blackbox import copy_consistent
        except ImportError:
            shutil.copyfile(blackbox_path, tmp)
        else:
            copy_consistent(str(blackbox_path), tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            private.set_file_access(fd, access)
        finally:
            os.close(fd)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
        access: private.Access | None = None,
        job_id: str | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.store = _own_connection(store)
        self.rank = rank
        self.blackbox_path = str(blackbox_path)
        self.stacks_path = str(stacks_path) if stacks_path else None
        self.world_size = world_size
        self.stalled = stalled
        # where this rank writes, from its own configuration only (never from the store)
        self.dump_dir_named = bool(dump_dir) or DUMP_DIR.is_set()
        self.dump_dir = Path(dump_dir) if dump_dir else default_dump_dir(blackbox_path)
        self.access = access or private.PRIVATE
        self.job_id = job_id or Path(self.blackbox_path).parent.name
        self.prefix = prefix if prefix is not None else STORE_PREFIX.read()
        self.poll_s = poll_s or JOBWIDE_POLL.read()
        self.interval_s = DUMP_INTERVAL.read() if interval_s is None else interval_s
        self.progress_s = PROGRESS_INTERVAL.read()
        self.next_beacon = 0.0  # time.monotonic() of the next progress beacon
        self.copy_seq: int | None = None  # the request whose copy is in dump_dir
        self.copy_time = 0.0  # time.monotonic() of that copy
        self.copy_files: list[str] = []
        self.host = socket.gethostname()
        self.last_seq = 0
        self.was_stalled = False
        self.device_facts_off = False  # FRTOOLS_DEVICE_FACTS=0, or its child failed to start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frtools-jobwide", daemon=True)

    def start(self) -> JobWideWatcher:
        p = self.prefix
        self.last_seq = protocol.current_seq(self.store, p)
        protocol.register_rank(
            self.store,
            p,
            self.rank,
            host=self.host,
            pid=os.getpid(),
            blackbox=self.blackbox_path,
            job=self.job_id,
        )
        if self.world_size:
            protocol.set_world_size(self.store, p, self.world_size)
        self._thread.start()
        # a stall's gather may be waiting STALL_GATHER_S for ranks that never answer (a
        # recovered job drops them and finishes): killed in a store call, we would abort
        before_finalization(lambda: self.stop(join_s=STALL_GATHER_S + 2.0))
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
                self.next_beacon = 0.0  # say so in the beacon at once
                self._on_stall()
            self.was_stalled = stalled
        if self.progress_s > 0 and time.monotonic() >= self.next_beacon:
            self.next_beacon = time.monotonic() + self.progress_s
            self._publish_progress()
        latest = protocol.latest_request(self.store, self.prefix, self.last_seq)
        if latest is not None:
            self.last_seq, request = latest
            self._answer(self.last_seq, request)

    def _publish_progress(self) -> None:
        """This rank's beacon (``formats.progress``) into the store, read from its own box.
        A failure here costs the beacons (one warning), never the dump requests."""
        try:
            now = beacon.of_snapshot(read_snapshot(self.blackbox_path))
            now.time_ns, now.interval_s = time.time_ns(), self.progress_s
            self.store.set(protocol.progress_key(self.prefix, self.rank), beacon.encode(now))
        except Exception as exc:
            self.progress_s = 0.0
            if _job_running() and not _interpreter_ending():
                note(f"rank {self.rank}: progress beacons off: {type(exc).__name__}: {exc}")

    def _write_copy(self, seq: int) -> tuple[list[str], str]:
        """This rank's snapshot and stacks in its dump folder for request ``seq``, unless a
        copy was written less than ``interval_s`` ago (then that one stands). Returns the
        files and a note (empty when written now)."""
        now = time.monotonic()
        if (
            self.copy_seq is not None
            and self.interval_s > 0
            and now - self.copy_time < self.interval_s
            and all((self.dump_dir / name).exists() for name in self.copy_files)
        ):
            return self.copy_files, (
                f"rate limited (FRTOOLS_DUMP_INTERVAL={self.interval_s:g}): the copy written "
                f"{now - self.copy_time:.1f} s ago for request {self.copy_seq} stands"
            )
        private.prepare_dump_dir(str(self.dump_dir), self.access, named=self.dump_dir_named)
        files = write_rank_dump(self.rank, self.blackbox_path, self.dump_dir, self.access)
        self.copy_seq, self.copy_time, self.copy_files = seq, time.monotonic(), files
        self._collect_device_facts()
        return files, ""

    def _collect_device_facts(self) -> None:
        """One rank per host (local rank 0) has the host's device facts written beside its
        copy: ``python -m frtools.collect.device_facts DIR`` as a detached child (the
        recorder may not import the collector, and nothing slow runs in this thread). A child
        that cannot start is one note, once; a child that overruns is killed."""
        if self.device_facts_off or os.environ.get("LOCAL_RANK", "0").strip() not in ("", "0"):
            return
        try:
            if not DEVICE_FACTS.read():
                self.device_facts_off = True
                return
            child = subprocess.Popen(
                [sys.executable, "-m", "frtools.collect.device_facts", str(self.dump_dir)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            threading.Thread(
                target=_reap, args=(child,), name="frtools-device-facts", daemon=True
            ).start()
        except Exception as exc:
            self.device_facts_off = True
            note(f"rank {self.rank}: device facts not collected: {type(exc).__name__}: {exc}")

    def _answer(self, seq: int, request: dict[str, Any]) -> Path:
        # a request is a knock on the door: what it says ("dir" or anything else) chooses
        # nothing; this rank writes where its own configuration says
        files, why = self._write_copy(seq)
        protocol.post_answer(
            self.store,
            self.prefix,
            seq,
            self.rank,
            host=self.host,
            pid=os.getpid(),
            directory=str(self.dump_dir),
            files=files,
            blackbox=self.blackbox_path,
            copy_seq=self.copy_seq if self.copy_seq is not None else seq,
            note=why,
        )
        return self.dump_dir

    def _on_stall(self) -> None:
        p = self.prefix
        if not self._claim_stall():
            files, _ = self._write_copy(protocol.current_seq(self.store, p))
            note(
                f"rank {self.rank}: stall detected; snapshot and stacks written to "
                f"{self.dump_dir} ({', '.join(files)})"
            )
            return
        seq = protocol.issue_request(
            self.store,
            p,
            {
                "kind": "stall",
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
        manifest = Manifest(job_id=self.job_id, mode="stall", world_size=self.world_size)
        protocol.gather_answers(self.store, self.prefix, seq, manifest, STALL_GATHER_S)
        manifest.notes.append(f"requested by rank {self.rank} after its watchdog saw a stall")
        manifest.write(directory)


def _reap(child: subprocess.Popen[bytes]) -> None:
    """Wait for the device-facts child (no zombie), killing it past ``DEVICE_FACTS_CHILD_S``."""
    try:
        child.wait(DEVICE_FACTS_CHILD_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            child.wait(5.0)
    except Exception:
        pass


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
    access: private.Access | None = None,
    job_id: str | None = None,
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
                access=access,
                job_id=job_id,
            ).start()
            return _started
        except Exception as exc:
            note(f"rank {rank}: job-wide dumps disabled: {type(exc).__name__}: {exc}")
            return None
