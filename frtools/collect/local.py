"""``frtools dump`` on one host: collect every rank file of a job from ``FRTOOLS_DIR``.

For each ``rank_<R>.frt``: if its process (pid in the header) is alive on this host, ask
it for a dump through the file itself (``request_dump``: its native watchdog raises the
stack signal, faulthandler writes every thread's stack — even while another thread holds
the GIL — and acknowledges). All ranks are asked at once and waited for together, bounded
by one timeout. Then every file is copied consistently (``copy_consistent``), dead ranks'
included: the kernel kept their mapping. Only the part of ``rank_<R>.stacks`` written for
this request is kept when the rank answered (the file is appended to on every request).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools.config import DIR
from frtools.formats.manifest import Manifest, RankEntry, rank_in_file_name, stacks_path


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
    if not pid or pid <= 0:
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

    job_dir, out = Path(job_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    manifest = Manifest(job_id=job_dir.name, mode="local", host=host)
    started = time.monotonic()

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
        entry.host = ident.get("host")
        entry.pid = ident.get("pid") or rf.header.get("owner_pid")
        if ident.get("world_size"):
            manifest.world_size = max(manifest.world_size or 0, int(ident["world_size"]))
        if entry.host and entry.host != host:
            entry.note = f"written on host {entry.host}; liveness unknown here"
            continue
        entry.alive = pid_alive(entry.pid)
        if not entry.alive:
            entry.note = f"process {entry.pid} is gone; its black box is collected as it was left"
            continue
        stacks = stacks_path(rf.path)
        rf.stacks_offset = stacks.stat().st_size if stacks.exists() else 0
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
                shutil.copyfile(rf.path, dst)
                entry.files.append(dst.name)
            except OSError:
                pass
            if not entry.error:
                entry.error = f"{rf.path}: not copied consistently: {exc}"
        stacks = stacks_path(rf.path)
        if stacks.exists():
            text = _read_from(stacks, rf.stacks_offset if entry.answered else 0)
            if entry.answered and not text.strip():
                text = _read_from(stacks, 0)
            if text.strip():
                (out / stacks.name).write_text(text)
                entry.files.append(stacks.name)
    if not files:
        manifest.notes.append(f"no rank files in {job_dir}")
    manifest.elapsed_s = time.monotonic() - started
    manifest.write(out)
    return manifest


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
