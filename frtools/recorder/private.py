"""The recorder's folders and files on a shared host: private, ours, never through a link.

/dev/shm and /tmp are shared by every user of a host. Another user could have made the
folder we are about to write into, or planted a symlink, a FIFO or a file of theirs where a
rank file goes. So:

* the per-user root (``/dev/shm/frtools-<uid>``), each job folder and each dump folder is
  created 0700 (0750 with ``FRTOOLS_SHARE_GROUP``) and, when it already exists, checked with
  ``lstat``: a directory, not a link, owned by this user, writable by nobody else — otherwise
  ``Unsafe`` (the recorder then warns once and records nothing; training goes on);
* a folder named by ``FRTOOLS_DIR`` or ``FRTOOLS_DUMP_DIR`` may itself be shared (``/tmp``),
  but then only if nobody else can rename what is in it (owned by us or root, and writable by
  others only with the sticky bit); the job folder inside is checked as above;
* files are created new: ``O_CREAT|O_EXCL|O_NOFOLLOW|O_NONBLOCK`` with mode 0600 (0640), a
  non-directory already at the path (a stale file of an earlier run, a symlink, a FIFO) is
  unlinked first — never opened, followed or truncated in place.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import NamedTuple

__all__ = [
    "PRIVATE",
    "Access",
    "Unsafe",
    "access_for",
    "create_file",
    "prepare_dump_dir",
    "prepare_job_dir",
    "prepare_root",
    "set_file_access",
]


class Unsafe(OSError):
    """A folder or file the recorder must not write into; the message says why."""


class Access(NamedTuple):
    """Modes (and group) of what the recorder creates."""

    dir_mode: int = 0o700
    file_mode: int = 0o600
    gid: int | None = None


PRIVATE = Access()


def access_for(share_gid: int | None) -> Access:
    """0700/0600, or 0750/0640 with group ``share_gid`` (``FRTOOLS_SHARE_GROUP``)."""
    return PRIVATE if share_gid is None else Access(0o750, 0o640, share_gid)


def _uid() -> int:
    return os.geteuid()


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _check_ours(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(f"{path} is a symbolic link; refusing to write through it")
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{path} is not a directory")
    if st.st_uid != _uid():
        raise Unsafe(
            f"{path} belongs to another user ({_describe(st)}; this process runs as uid "
            f"{_uid()}); refusing to write into it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unsafe(f"{path} is writable by other users ({_describe(st)}); refusing to use it")


def _own_dir(path: str, access: Access, *, enforce: bool) -> bool:
    """Create ``path`` (one level) or check the one that is there; returns whether it was
    created now. ``enforce``: set its mode and group to ``access`` even when it existed."""
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    _check_ours(path, os.lstat(path))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        _check_ours(path, st)  # the same folder as the one checked (not swapped meanwhile)
        mode = stat.S_IMODE(st.st_mode)
        if created or enforce:
            want = access.dir_mode
        else:  # an existing per-user root: only opened up to the share group, never narrowed
            want = mode | (0o050 if access.gid is not None else 0)
        if access.gid is not None and st.st_gid != access.gid:
            os.fchown(fd, -1, access.gid)
        if mode != want:
            os.fchmod(fd, want)
    finally:
        os.close(fd)
    return created


def _shared_parent_ok(path: str) -> None:
    """A folder someone named (``FRTOOLS_DIR``, ``FRTOOLS_DUMP_DIR``) holding our folder:
    nobody but us (or root) may rename or replace what is in it."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{path} is not a directory")
    if st.st_uid not in (_uid(), 0):
        raise Unsafe(
            f"{path} belongs to another user ({_describe(st)}), who could replace the job "
            "folder in it; choose a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise Unsafe(
            f"{path} is writable by other users without the sticky bit ({_describe(st)}); "
            "choose a folder of your own"
        )


def _named_dir(path: str, access: Access) -> None:
    """Make a folder the user named (and its missing parents); its last part becomes ours."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    _shared_parent_ok(parent)


def prepare_root(root: str, access: Access, *, default: bool) -> None:
    """The recorder's root folder: the per-user default (``default``) must be ours, private;
    a folder named by ``FRTOOLS_DIR`` may be shared, as long as nobody else can replace the
    job folder we make in it."""
    if default:
        _own_dir(root, access, enforce=False)
        return
    if not os.path.isdir(root):
        _named_dir(root, access)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
            with contextlib.suppress(OSError):  # opened to the group only when it is its
                if access.gid is not None:
                    os.chown(root, -1, access.gid)
                os.chmod(root, access.dir_mode)
    _shared_parent_ok(root)


def prepare_job_dir(root: str, job_dir: str, access: Access, *, default_root: bool) -> None:
    """``<root>/<job>``: created 0700 (0750), or checked to be ours and private."""
    prepare_root(root, access, default=default_root)
    _own_dir(job_dir, access, enforce=True)


def prepare_dump_dir(path: str, access: Access, *, named: bool) -> None:
    """Where this rank writes its snapshots: ``<job folder>/dumps`` (the job folder is
    already ours) or ``FRTOOLS_DUMP_DIR`` (``named``: its parent may be shared)."""
    if named:
        _named_dir(path, access)
    _own_dir(path, access, enforce=True)


def create_file(path: str, access: Access, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path`` (in a folder of ours), opened with ``flags``; returns the fd.

    Never opens what is already there: a non-directory at the path (a stale file of an
    earlier run, or a symlink or FIFO someone planted) is unlinked first, once. The file is
    a regular file of ours with exactly ``access.file_mode`` (and group); the fd is blocking.
    """
    flags |= os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, access.file_mode)
    except FileExistsError:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise Unsafe(f"{path} is a directory") from None
        os.unlink(path)
        fd = os.open(path, flags, access.file_mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid():
            raise Unsafe(f"{path} is not a regular file of ours ({_describe(st)})")
        os.fchmod(fd, access.file_mode)
        if access.gid is not None:
            os.fchown(fd, -1, access.gid)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def set_file_access(fd: int, access: Access) -> None:
    """Give a file we created (``mkstemp``) the recorder's mode and group."""
    os.fchmod(fd, access.file_mode)
    if access.gid is not None:
        os.fchown(fd, -1, access.gid)
