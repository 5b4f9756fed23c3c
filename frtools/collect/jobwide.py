"""``frtools dump --job-wide``: ask every rank, on every host, through the job's TCPStore.

The requester connects to the store torchrun / ``init_process_group`` already runs (as a
client), publishes a request (a number and a label, no place), and waits (bounded) for the
ranks' watcher threads (``frtools.recorder.jobwide``) to write their snapshots and stacks
into their own dump folders; then it copies them from there. Ranks that do not answer are
named in the manifest with the host and path of their black box, which ``frtools dump`` run
on that host still collects.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from frtools.collect import device_facts
from frtools.config import DIR, DUMP_DIR, STORE_PREFIX, job_folder_name
from frtools.formats import store_protocol as protocol
from frtools.formats.manifest import (
    BOX_SUFFIX,
    STACKS_SUFFIX,
    Manifest,
    RankEntry,
    rank_file_name,
)
from frtools.formats.private_files import new_file, own_folder

# a rank's copy bigger than this is not copied (a black box of 2**20 slots is ~140 MB)
MAX_COPY_BYTES = 1 << 32


class StoreUnavailable(Exception):
    """The job's store cannot be reached; the message is one line for the user."""


def parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"store address must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def connect_store(addr: str, timeout: float = 5.0) -> Any:
    """A client connection to the job's TCPStore at ``HOST:PORT``."""
    host, port = parse_address(addr)
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise StoreUnavailable(f"job-wide dumps need torch installed ({exc})") from None
    try:
        return TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=max(1.0, timeout)),
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises DistStoreError / RuntimeError / TimeoutError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreUnavailable(f"cannot reach the job's store at {addr}: {first}") from None


def dump_job_wide(
    store_addr: str,
    out_dir: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    timeout: float = 5.0,
    job_id: str | None = None,
) -> Manifest:
    """Ask every rank of the job behind ``store_addr`` to write its snapshot and stacks into
    its own dump folder (``FRTOOLS_DUMP_DIR``, default ``<FRTOOLS_DIR>/<job>/dumps``), then
    copy what this user can read from there into ``out_dir``.

    The request names no place: the store is not authenticated, so nothing read from it may
    choose where a rank writes, nor what this command reads. A rank's files are read from
    this command's own idea of where it writes (``FRTOOLS_DUMP_DIR``; with ``job_id``,
    ``<FRTOOLS_DIR>/<job>/dumps``) or from the folder the rank's answer names, but only when
    that folder is this user's own (checked like the recorder's) — on one host, or on a
    shared file system that every host mounts at the same path.
    """
    prefix = prefix if prefix is not None else STORE_PREFIX.read()
    out = own_folder(Path(out_dir).resolve())
    store = connect_store(store_addr, timeout)
    started = time.monotonic()
    seq = protocol.issue_request(
        store,
        prefix,
        {
            "kind": "request",
            "reason": "frtools dump --job-wide",
            "by": f"pid {os.getpid()}",
            "time_ns": time.time_ns(),
        },
    )
    manifest = Manifest(job_id=job_id or store_addr, mode="job-wide")
    devices = device_facts.start(manifest.host)  # this host's, while the ranks answer
    answers: dict[int, dict[str, Any]] = {}
    protocol.gather_answers(store, prefix, seq, manifest, timeout, answers)
    for rank, answer in sorted(answers.items()):
        _collect_rank(manifest.ranks[rank], answer, out, job_id)
    _copy_device_files(answers, out, job_id, manifest.host)
    if devices is not None:
        devices.finish(out, manifest, deadline_s=timeout)
    _native_stacks_here(manifest, out, timeout)
    unread = [r for r in manifest.ranks_answered if not manifest.ranks[r].files]
    if unread:
        manifest.notes.append(
            "ranks "
            + ", ".join(map(str, unread))
            + " wrote their snapshot into their own dump folder, which this command cannot "
            "read here: run `frtools dump` on their hosts, or give every rank and this command "
            "the same FRTOOLS_DUMP_DIR on a shared file system"
        )
    manifest.elapsed_s = time.monotonic() - started
    manifest.write(out)
    return manifest


def _candidate_dirs(answer: dict[str, Any], job_id: str | None) -> list[tuple[Path, bool]]:
    """Where a rank's copy may be, as (folder, named by this command's own configuration):
    ``FRTOOLS_DUMP_DIR``, ``<FRTOOLS_DIR>/<JOB>/dumps``, then the folder the answer names
    (read from the store: untrusted, checked before use)."""
    dirs = []
    configured = DUMP_DIR.read()
    if configured:
        dirs.append((Path(configured), True))
    if job_id:
        dirs.append((Path(DIR.read()) / job_folder_name(job_id) / "dumps", True))
    named = answer.get("dir")
    if isinstance(named, str) and named and "\0" not in named:
        dirs.append((Path(named), False))
    return dirs


def _folder_owner(path: Path, configured: bool) -> int | None:
    """The owner of a folder the copies may be read from, or None when it may not be.

    A folder from this command's configuration only has to be a directory (its files must
    then belong to its owner: root collecting a user's job); one named by the store must be
    this user's own: absolute, no link anywhere in its path, owned by us, writable by nobody
    else — so a store client cannot make us read anything of someone else's."""
    try:
        if configured:
            st = os.stat(path)
            return st.st_uid if stat.S_ISDIR(st.st_mode) else None
        if not path.is_absolute() or os.path.realpath(path) != os.path.normpath(path):
            return None
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    if (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        return st.st_uid
    return None


def _copy_file_of(owner: int, src: Path, dst: Path) -> bool:
    """Copy a regular file of ``owner``'s (never through a link, never a FIFO), bounded by
    ``MAX_COPY_BYTES``; False when ``src`` is not such a file."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_size > MAX_COPY_BYTES:
            return False
        with new_file(dst) as w:
            shutil.copyfileobj(f, w)
    return True


def _collect_rank(entry: RankEntry, answer: dict[str, Any], out: Path, job_id: str | None) -> None:
    """Copy one answered rank's files into ``out``; ``entry.files`` lists what was copied.
    The names are the rank's own (``rank_<R>.frt``, ``rank_<R>.stacks``), never the store's."""
    names = [rank_file_name(entry.rank, BOX_SUFFIX), rank_file_name(entry.rank, STACKS_SUFFIX)]
    entry.files = []
    for directory, configured in _candidate_dirs(answer, job_id):
        owner = _folder_owner(directory, configured)
        if owner is None:
            continue
        if directory.resolve() == out:
            entry.files = [n for n in names if (out / n).is_file()]
        else:
            entry.files = [n for n in names if _copy_file_of(owner, directory / n, out / n)]
        if entry.files:
            return
    where = answer.get("dir") if isinstance(answer.get("dir"), str) else "its dump folder"
    entry.note = "; ".join(
        x for x in (entry.note, f"wrote into {where[:300]} on {entry.host}, not readable here") if x
    )


def _copy_device_files(
    answers: dict[int, dict[str, Any]], out: Path, job_id: str | None, here: str
) -> None:
    """Other hosts' ``device_<host>.json`` from the ranks' dump folders (written there by the
    recorder's hand-off), checked as the rank files are; this host's is collected here."""
    from frtools.formats.device_facts import file_name, is_device_file

    own = file_name(here)
    seen: set[Path] = set()
    for answer in answers.values():
        for directory, configured in _candidate_dirs(answer, job_id):
            owner = _folder_owner(directory, configured)
            if owner is None or directory in seen or directory.resolve() == out:
                continue
            seen.add(directory)
            try:
                names = sorted(n for n in os.listdir(directory) if is_device_file(n))[:256]
            except OSError:
                continue
            for name in names:
                if name != own and not (out / name).exists():
                    _copy_file_of(owner, directory / name, out / name)


def _native_stacks_here(manifest: Manifest, out: Path, timeout: float) -> None:
    """py-spy's native stacks of the answered ranks that run on this host. The store is not
    authenticated: a pid it names is sampled only when the rank's copied black box names the
    same pid and that process is alive here."""
    from frtools.collect import native_stacks
    from frtools.collect.local import pid_alive
    from frtools.formats.blackbox import SnapshotError, read_header

    here, pids = socket.gethostname(), {}
    for rank, entry in manifest.ranks.items():
        box = rank_file_name(rank, BOX_SUFFIX)
        if not entry.answered or entry.host != here or not entry.pid or box not in entry.files:
            continue
        try:
            header = read_header(out / box)
        except (OSError, SnapshotError):
            continue
        ident = header.get("identity") if isinstance(header.get("identity"), dict) else {}
        if entry.pid in (ident.get("pid"), header.get("owner_pid")) and pid_alive(entry.pid):
            pids[rank] = entry.pid
    native = native_stacks.take_for(pids, manifest, timeout)
    for rank, result in native.items():
        native_stacks.keep(result, manifest.ranks[rank], out)
