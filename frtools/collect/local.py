"""``frtools dump`` on one host: collect every rank file of a job from ``FRTOOLS_DIR``.

For each ``rank_<R>.frt``: if its process (pid in the header) is alive on this host, ask
it for a dump through the file itself (``request_dump``: its native watchdog raises the
stack signal, faulthandler writes every thread's stack — even while another thread holds
the GIL — and acknowledges). All ranks are asked at once and waited for together, bounded
by one timeout. Then every file is copied consistently (``copy_consistent``), dead ranks'
included: the kernel kept their mapping. Only the part of ``rank_<R>.stacks`` written for
this request is kept when the rank answered (the file is appended to on every request).
Ranks still alive also have their native stacks taken by py-spy, all at once and bounded
(``frtools.collect.native_stacks``: ``rank_<R>.native``, or one line saying how to get them).

The job folder may hold files someone else planted (docs/security.md): a link, a FIFO or a
device named like a rank file or a stacks file is refused for that rank, never followed,
waited on or copied; every copy holds what was read, at most the limits of
``frtools.formats.limits``, never the size a header claims.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools.collect import device_facts, native_stacks
from frtools.config import DIR
from frtools.formats import limits
from frtools.formats.manifest import Manifest, RankEntry, rank_in_file_name, stacks_path
from frtools.formats.private_files import new_file, own_folder, write_new
from frtools.model.ranks import valid_world_size


def frtools_dir() -> Path:
    return Path(DIR.read())


def find_jobs(root: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Job id -> job folder, for every folder under ``root`` holding rank files."""
    base = Path(root) if root is not None else frtools_dir()
    jobs: dict[str, Path] = {}
    if not base.is_dir():
        return jobs
    for child in sorted(base.iterdir()):
        if child.is_dir() and any(rank_in_file_name(p.name) is not None for p in child.iterdir()):
            jobs[child.name] = child
    return jobs


def pid_alive(pid: int | None) -> bool:
    """True when ``pid`` is a running (not zombie) process on this host."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


@dataclass
class _RankFile:
    rank: int
    path: Path
    header: dict[str, Any] = field(default_factory=dict)
    entry: RankEntry | None = None
    seq: int | None = None
    stacks_offset: int = 0


def collect_job(
    job_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], timeout: float = 5.0
) -> Manifest:
    """Collect one job's rank files and stacks from ``job_dir`` into ``out_dir``."""
    from frtools.formats.blackbox import (
        SnapshotError,
        copy_consistent,
        dump_acknowledged,
        read_header,
        request_dump,
    )

    job_dir, out = Path(job_dir), own_folder(out_dir)
    host = socket.gethostname()
    manifest = Manifest(job_id=job_dir.name, mode="local", host=host)
    started = time.monotonic()
    devices = device_facts.start(host)  # in the background while the boxes are copied

    files: list[_RankFile] = []
    for path in sorted(job_dir.iterdir()):
        rank = rank_in_file_name(path.name)
        if rank is not None:
            files.append(_RankFile(rank=rank, path=path))

    # 1. who is alive: ask every live rank at once
    for rf in files:
        entry = RankEntry(rank=rf.rank)
        rf.entry = entry
        manifest.ranks[rf.rank] = entry
        try:
            rf.header = read_header(rf.path)
        except (OSError, SnapshotError) as exc:
            entry.error = f"{rf.path}: {exc}"
            continue
        ident = rf.header.get("identity") or {}
        entry.host = ident.get("host") if isinstance(ident.get("host"), str) else None
        entry.pid = _pid(ident.get("pid")) or _pid(rf.header.get("owner_pid"))
        world = ident.get("world_size")
        if valid_world_size(world):
            manifest.world_size = max(manifest.world_size or 0, world)
        if entry.host and entry.host != host:
            entry.note = f"written on host {entry.host}; liveness unknown here"
            continue
        entry.alive = pid_alive(entry.pid)
        if not entry.alive:
            entry.note = f"process {entry.pid} is gone; its black box is collected as it was left"
            continue
        rf.stacks_offset = _regular_size(stacks_path(rf.path))
        try:
            rf.seq = request_dump(rf.path)
        except (OSError, SnapshotError) as exc:
            entry.note = f"cannot request a dump: {exc}"

    # 2. wait for the acknowledgements together, bounded by the timeout
    pending = {rf.rank: rf for rf in files if rf.seq is not None}
    deadline = started + timeout
    while pending:
        for rank, rf in list(pending.items()):
            try:
                if dump_acknowledged(rf.path, rf.seq or 0):
                    assert rf.entry is not None
                    rf.entry.answered = True
                    del pending[rank]
            except (OSError, SnapshotError):
                del pending[rank]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    for rf in pending.values():
        assert rf.entry is not None
        if not pid_alive(rf.entry.pid):
            rf.entry.alive = False
            rf.entry.note = (
                f"process {rf.entry.pid} died while asked for its stacks (a stack signal "
                "without a handler terminates the process); black box collected as left"
            )
            continue
        rf.entry.note = (
            f"alive but did not acknowledge within {timeout:g} s (its native watchdog is not "
            "running?); black box copied as is, stacks may be old"
        )

    # 2b. native stacks (py-spy) of every rank still alive on this host, all at once
    alive = {rf.rank: rf.entry.pid for rf in files if rf.entry and rf.entry.alive and rf.entry.pid}
    native = native_stacks.take_for(alive, manifest, timeout)

    # 3. copy every file, dead or alive
    for rf in files:
        entry = rf.entry
        assert entry is not None
        dst = out / rf.path.name
        try:
            torn = copy_consistent(rf.path, dst)
            entry.files.append(dst.name)
            if torn:
                entry.note = _join(entry.note, f"{torn} slot(s) torn while copying, dropped")
        except (OSError, SnapshotError) as exc:
            try:  # keep the bytes: the reader says what is wrong with them
                _copy_bounded(rf.path, dst, limits.current().dump_bytes)
                entry.files.append(dst.name)
            except (OSError, limits.InputRefused):
                pass  # not a regular file: nothing of it is copied
            if not entry.error:
                entry.error = f"{rf.path}: not copied consistently: {exc}"
        stacks = stacks_path(rf.path)
        try:
            text = _read_from(stacks, rf.stacks_offset if entry.answered else 0)
            if entry.answered and not text.strip():
                text = _read_from(stacks, 0)
        except FileNotFoundError:
            text = ""
        except (OSError, limits.InputRefused) as exc:
            text = ""
            entry.note = _join(entry.note, f"{stacks.name} not collected: {exc}")
        if text.strip():
            write_new(out / stacks.name, text)
            entry.files.append(stacks.name)
        native_stacks.keep(native.get(rf.rank), entry, out)
    if not files:
        manifest.notes.append(f"no rank files in {job_dir}")
    if devices is not None:
        devices.finish(out, manifest, deadline_s=timeout)
    manifest.elapsed_s = time.monotonic() - started
    manifest.write(out)
    return manifest


def _pid(value: object) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31
    return value if ok else None  # type: ignore[return-value]


def _regular_size(path: Path) -> int:
    """The size of a regular file (0 when missing or not a regular file: never followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _read_from(path: Path, offset: int) -> str:
    """The text of a stacks file from ``offset``: a regular file only (no link, FIFO or
    device), its last ``stacks_bytes`` at most."""
    cap = limits.current().stacks_bytes
    fd, st = limits.open_regular(path, follow_symlinks=False)
    with os.fdopen(fd, "rb") as f:
        f.seek(max(offset, st.st_size - cap) if offset <= st.st_size else 0)
        return f.read(cap).decode("utf-8", errors="replace")


def _copy_bounded(src: Path, dst: Path, cap: int) -> None:
    """Copy a regular file (never a link, FIFO or device), at most ``cap`` bytes: the copy
    holds what was read, whatever size the file claims."""
    fd, _ = limits.open_regular(src, follow_symlinks=False)
    with os.fdopen(fd, "rb") as f, new_file(dst) as out:
        left = cap
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
