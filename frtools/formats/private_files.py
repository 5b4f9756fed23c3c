"""Folders and files frtools writes on a shared host: the folder ours and private, every file
new, never through a link.

Another user may have prepared the folder a command is told to write into (``frtools dump
-o DIR``, the pytest plugin's ``--frtools-dir``), or planted a symlink where a file goes. So
the folder is created 0700, or when it exists it must be a directory (not a link) of this
user that nobody else can write into (``Unsafe`` otherwise, naming it); each file is written
under a temporary name ``tempfile.mkstemp`` makes in the same folder (``O_CREAT|O_EXCL|
O_NOFOLLOW``, mode 0600) and renamed over the destination (``os.replace`` replaces a link
planted there, never writes through it).

The recorder's own folders (``frtools/recorder/private.py``) keep the same checks.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["FILE_MODE", "Unsafe", "check_ours", "new_file", "own_folder", "write_new"]

FOLDER_MODE = 0o700
FILE_MODE = 0o600


class Unsafe(OSError):
    """A folder or file frtools must not write into; the message says which and why."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_ours(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """``Unsafe`` unless ``st`` (an ``lstat`` or ``fstat``) is a directory of this user that
    no other user can write into."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(f"{path} is a symbolic link; refusing to write through it")
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{path} is not a directory")
    if st.st_uid != uid:
        raise Unsafe(
            f"{path} belongs to another user ({_describe(st)}; this process runs as uid "
            f"{uid}); refusing to write into it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unsafe(f"{path} is writable by other users ({_describe(st)}); refusing to use it")


def own_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder of ours: created 0700 (its missing parents as usual), or the one
    there checked (``check_ours``, on the folder itself and on what was opened). Returns the
    absolute path."""
    folder = Path(os.path.abspath(path))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, FOLDER_MODE)
    check_ours(folder, os.lstat(folder))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_ours(folder, os.fstat(fd))  # the folder checked is the folder opened
    finally:
        os.close(fd)
    return folder


@contextlib.contextmanager
def new_file(dst: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """A file object to write ``dst`` through: a new 0600 file under a name ``mkstemp``
    chose beside it, renamed over ``dst`` when the block ends without an error (removed
    otherwise). What was at ``dst`` — a file, a planted link — is replaced, never opened."""
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_new(dst: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` as ``dst`` through ``new_file``."""
    with new_file(dst, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(dst)
