"""The live state of a running job, read from its black boxes without touching the job.

``frtools top`` and ``frtools metrics`` ask the same question many times a minute: which op
is each rank in, since when, did its watchdog flag a stall, is the process still there, and
who lags behind its group. Every answer is already in the rank's memory-mapped box; reading
it is a read of the file (``frtools.formats.blackbox.read_snapshot``), never a signal, a dump
request or a store write, so looking cannot hurt the job.

* ``read_rank(path)`` -> ``RankLive``: one box, its current (oldest unfinished) or last op.
* ``read_job(job_dir)`` -> ``JobLive``: every box of a job folder on this host, the job's
  state (running / stalled since T / exited) and the lagging ranks.
* ``read_job_wide(store_addr)`` -> ``JobLive``: every rank that registered in the job's
  TCPStore (read only: ``check``/``get``); ranks on this host read from their boxes, the
  others from the progress beacon each rank's recorder writes there (``formats.progress``),
  with its age.

A box is hostile data: an unreadable one is a ``RankLive`` with ``error`` naming the file
and the reason, and the others are still shown.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from frtools.formats import progress as beacon
from frtools.formats.blackbox import (
    FLAG_FAILED,
    STATE_NAMES,
    Snapshot,
    SnapshotError,
    owner_alive,
    read_snapshot,
)
from frtools.formats.limits import strict_int
from frtools.formats.manifest import rank_file_name, rank_in_file_name

# state byte of a finished slot
_COMPLETED = STATE_NAMES.index("completed")
# the most process groups, and distinct op names, one rank contributes to labels (bounded
# labels: a hostile box cannot make an exporter grow without bound)
MAX_GROUPS = 256
MAX_OPS = 32


@dataclass(kw_only=True)
class GroupLive:
    """One process group as this rank's box sees it: the last sequence ids it issued and
    completed (collectives), and where it lags behind the group's most advanced member."""

    name: str
    desc: str
    digest: str  # its member list's (``formats.progress.members_digest``)
    last_issued: int
    last_completed: int
    behind: int = 0  # ops the group's most advanced member (here) issued that this one did not

    @property
    def key(self) -> tuple[str, str]:
        """Groups are one group across ranks by name and member set (names can repeat)."""
        return (self.name, self.digest)


@dataclass(kw_only=True)
class RankLive:
    """One rank, now."""

    rank: int
    path: str
    host: str | None = None
    pid: int | None = None
    job: str | None = None
    op: str | None = None  # the oldest unfinished op, else the last one
    group: str | None = None
    seq: int | None = None
    state: str | None = None  # scheduled, started, completed, failed; None: no op yet
    pending: bool = False  # ``op`` has not finished
    last_progress_ns: int | None = None  # the newest time any record changed
    stalled: bool = False  # the recorder's watchdog flags a stall
    stall_time_ns: int | None = None
    alive: bool | None = None  # None: cannot be told from here (another host)
    ending: str | None = None  # running, clean, exit, exception, os_exit, signal, killed
    startup_phase: str | None = None
    groups: list[GroupLive] = field(default_factory=list)
    finished: np.ndarray | None = None  # (record_id, op string id, failed) of finished slots
    op_name: Callable[[int], str] | None = None  # an op string id of ``finished`` -> its name
    oldest_record: int = 0  # the oldest record id still in the ring
    error: str | None = None  # the box cannot be read: file and reason
    note: str | None = None

    def seconds_since_progress(self, now_ns: int | None = None) -> float | None:
        if self.last_progress_ns is None:
            return None
        now = time.time_ns() if now_ns is None else now_ns
        return max(0.0, (now - self.last_progress_ns) / 1e9)

    @property
    def lagging(self) -> list[GroupLive]:
        """The groups in which this rank has issued fewer ops than another member."""
        return [g for g in self.groups if g.behind > 0]


@dataclass(kw_only=True)
class JobLive:
    """A job, now: its ranks (by rank) and its state."""

    job: str
    ranks: dict[int, RankLive] = field(default_factory=dict)
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        """``exited`` (no rank runs), ``stalled`` (a watchdog flags a stall), ``running``, or
        ``unknown`` (no rank seen yet)."""
        if not self.ranks:
            return "unknown"
        readable = [r for r in self.ranks.values() if r.error is None]
        if readable and all(r.alive is False for r in readable):
            return "exited"
        if any(r.stalled and r.alive is not False for r in readable):
            return "stalled"
        return "running"

    @property
    def stalled_since_ns(self) -> int | None:
        times = [r.stall_time_ns for r in self.ranks.values() if r.stalled and r.stall_time_ns]
        return min(times) if times else None

    @property
    def lagging(self) -> list[int]:
        return sorted(rank for rank, r in self.ranks.items() if r.lagging)


def _int(value: object) -> int | None:
    return strict_int(value, lo=1, hi=(1 << 31) - 1)  # the one rule for an int read back


def _text(value: object, limit: int = 256) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def read_rank(path: str | os.PathLike[str], rank: int | None = None) -> RankLive:
    """One black box as a ``RankLive``; ``error`` says why when it cannot be read."""
    path = os.fspath(path)
    if rank is None:
        rank = rank_in_file_name(os.path.basename(path))
    live = RankLive(rank=rank if rank is not None else -1, path=path)
    try:
        snap = read_snapshot(path)
    except (OSError, SnapshotError) as exc:
        live.error = f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
        return live
    header, ident = snap.header, snap.identity
    live.host, live.job = _text(ident.get("host")), _text(ident.get("job_id"))
    live.pid = _int(ident.get("pid")) or _int(header.get("owner_pid"))
    live.alive = owner_alive(header, ident)
    live.ending, _ = snap.ending(live.alive)
    live.startup_phase = snap.startup_phase
    try:
        _take(live, beacon.of_snapshot(snap))
        _read_ops(live, snap)
    except SnapshotError as exc:  # a string beyond the limits: the rank, without its ops
        _take(live, beacon.of_snapshot(snap, ops=False))
        live.note = f"{path}: ops not read: {exc}"
    return live


def _take(live: RankLive, now: beacon.Progress) -> None:
    """What ``now`` (a box's progress, or a remote rank's beacon) says, into ``live``."""
    live.op, live.group, live.seq, live.state = now.op, now.group, now.seq, now.state
    live.pending, live.last_progress_ns = now.pending, now.last_progress_ns
    live.stalled, live.stall_time_ns = now.stalled, now.stall_time_ns
    live.groups = [
        GroupLive(
            name=g.name,
            desc=g.desc,
            digest=g.digest,
            last_issued=g.last_issued,
            last_completed=g.last_completed,
        )
        for g in now.groups[:MAX_GROUPS]
    ]


def _read_ops(live: RankLive, snap: Snapshot) -> None:
    """The finished slots (for the exporter's op counters), from the ring in numpy."""
    slots = snap.slots
    if not len(slots):
        return
    failed = (slots["flags"] & FLAG_FAILED) != 0
    done = (slots["state"] == _COMPLETED) | failed
    live.oldest_record = int(slots["record_id"][0])
    live.op_name = snap.string
    live.finished = np.rec.fromarrays(
        [slots["record_id"][done], slots["op"][done], failed[done]],
        names="record_id,op,failed",
    )


def mark_lagging(ranks: list[RankLive]) -> None:
    """Set each group's ``behind``: how many ops the group's most advanced member among
    ``ranks`` issued that this one did not (the rank that never issued an op its peers wait
    in is the one to look at)."""
    most: dict[tuple[str, tuple[int, ...]], int] = {}
    for r in ranks:
        for g in r.groups:
            most[g.key] = max(most.get(g.key, g.last_issued), g.last_issued)
    for r in ranks:
        for g in r.groups:
            g.behind = most[g.key] - g.last_issued


def read_job(job_dir: str | os.PathLike[str]) -> JobLive:
    """Every rank box of one job folder on this host."""
    job_dir = Path(job_dir)
    job = JobLive(job=job_dir.name)
    try:
        names = sorted(os.listdir(job_dir))
    except OSError as exc:
        job.notes.append(f"{job_dir}: {exc.strerror or exc}")
        return job
    for name in names:
        rank = rank_in_file_name(name)
        if rank is not None:
            job.ranks[rank] = read_rank(job_dir / name, rank)
    _settle(job)
    return job


def read_jobs(root: str | os.PathLike[str] | None = None, job: str | None = None) -> list[JobLive]:
    """The jobs under the recorder folder ``root`` (default ``FRTOOLS_DIR``), or the one
    named ``job`` (empty, with a note, until its first box appears)."""
    from frtools.collect.local import find_jobs

    jobs = find_jobs(root)
    if job is None:
        return [read_job(path) for path in jobs.values()]
    if job in jobs:
        return [read_job(jobs[job])]
    return [JobLive(job=job, notes=[f"no boxes of job {job!r} under this host's recorder folder"])]


def _from_beacon(live: RankLive, store: Any, key: str) -> str:
    """A rank of another host, as its last beacon says (``formats.progress``); the note
    says how old that is, and when the beacons stopped (threads that cannot run, or gone)."""
    now = beacon.decode(store.get(key)) if store.check([key]) else None
    if now is None:
        return f"runs on {live.host}: no progress beacon (`frtools top` there reads its box)"
    _take(live, now)
    if now.time_ns is None:
        return "from its beacon"
    age = max(0.0, (time.time_ns() - now.time_ns) / 1e9)
    every = now.interval_s or 5.0
    if age > max(3 * every, every + 10.0):
        return (
            f"no beacon for {age:.0f} s (every {every:g} s): its Python threads do not run "
            "(GIL held?), or it is gone"
        )
    return f"from its beacon {age:.0f} s ago"


def _settle(job: JobLive) -> None:
    readable = [r for r in job.ranks.values() if r.error is None]
    mark_lagging(readable)
    for r in readable:
        r.job = r.job or job.job
    if not job.ranks:
        job.notes.append("no rank files yet")


def connect(store_addr: str, timeout: float = 5.0) -> Any:
    """A client of the job's store (``collect.jobwide.connect_store``) with c10d's own
    C++ log lines kept off stderr: the failure is the one line ``StoreUnavailable`` says,
    and a live screen is not torn by a retry message."""
    from frtools.collect.jobwide import connect_store

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        return connect_store(store_addr, timeout)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def read_job_wide(
    store: Any, store_addr: str, *, prefix: str | None = None, root: str | None = None
) -> JobLive:
    """Every rank registered in the job's store (a ``connect``ed client), read only
    (``check``/``get``, never a request: the job is not asked to do anything). The store is
    not authenticated: what it says is shown, never used as a path; a rank on this host is
    read from the box in this user's own recorder folder (``FRTOOLS_DIR``) of the job it
    names."""
    from frtools.collect.local import find_jobs
    from frtools.config import STORE_PREFIX
    from frtools.formats import store_protocol as protocol

    prefix = prefix if prefix is not None else STORE_PREFIX.read()
    job = JobLive(job=store_addr)
    key = protocol.world_size_key(prefix)
    world = None
    if store.check([key]):
        raw = store.get(key).decode(errors="replace")
        world = int(raw) if raw.isdigit() and 0 < int(raw) <= protocol.MAX_WORLD_SIZE else None
    job.world_size = world
    if not world:
        job.notes.append(f"no rank has registered in the store at {store_addr} (recorder on?)")
        return job
    here, local_jobs = socket.gethostname(), find_jobs(root)
    for rank in range(world):
        key = protocol.rank_key(prefix, rank)
        reg = protocol.decode(store.get(key)) if store.check([key]) else {}
        host, pid, name = _text(reg.get("host")), _int(reg.get("pid")), _text(reg.get("job"))
        folder = local_jobs.get(name) if name else None
        if host == here and folder is not None and (folder / rank_file_name(rank)).exists():
            live = read_rank(folder / rank_file_name(rank), rank)
            if live.error is None and live.pid != pid:
                live.note = f"the store names pid {pid}, the box pid {live.pid}"
        else:
            live = RankLive(rank=rank, path="", host=host, pid=pid, job=name)
            live.note = (
                "never registered (recorder not on?)"
                if not reg
                else _from_beacon(live, store, protocol.progress_key(prefix, rank))
            )
        job.ranks[rank] = live
        if name and job.job == store_addr:
            job.job = name
    _settle(job)
    return job
