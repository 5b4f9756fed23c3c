"""Collect PyTorch's own Flight Recorder from a job that runs without the frtools recorder.

PyTorch offers three ways to ask a live rank for its trace, and which exist depends on the
build and the backend (checked on torch 2.13):

* **Worker-server unix sockets** (``torch.distributed.elastic.control_plane.worker_main``
  starts a ``_WorkerServer`` on ``TORCH_WORKER_SERVER_SOCKET``): HTTP over a unix socket,
  ``POST /handler/<name>``. Every build has ``fr_trace_json`` (the generic recorder that
  Gloo feeds when ``TORCH_FR_BUFFER_SIZE`` > 0) and ``dump_traceback`` (all Python stacks);
  CUDA builds add ``dump_nccl_trace_pickle`` / ``dump_nccl_trace_json``. torch 2.15 keeps
  one recorder per backend and ``fr_trace_json?backend=<name>`` picks one (Gloo's by
  default; c10d's hook records nccl2 groups into ``nccl2``'s); 2.13 ignores the argument.
  A CUDA build answers ``dump_nccl_trace_pickle`` with an empty trace when the job has no
  ProcessGroupNCCL (Gloo, or nccl2 on 2.15). So every recorder is asked, and each answer
  that holds ops is kept (a byte-identical second answer is dropped); the analyzer merges
  a rank's files that record different groups.
* **Debug servers** (``torch.distributed.debug.start_debug_server``): the same handlers on
  TCP; each rank publishes ``http://host:port`` under ``debug_server/rank<R>`` in the job's
  TCPStore.
* **Debug-info pipes** (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<prefix>``): ProcessGroupNCCL's
  monitor thread makes the FIFO ``<prefix><rank>.pipe`` and, when a byte arrives, writes the
  trace pickle to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``. NCCL only: neither Gloo nor a
  CPU-only build creates the pipe.

Each collected trace lands as ``rank_<R>.pkl`` or ``rank_<R>.json`` (the bytes as PyTorch
wrote them; never unpickled here) and the stacks as ``rank_<R>.stacks``, so
``frtools analyze DIR`` reads them.

What answers may be hostile (docs/security.md): every socket read runs against one
deadline for the whole request (a server dripping a byte at a time cannot hold the
collection past ``--timeout``) and an answer is at most ``response_bytes``; a debug-info
pipe is written only when it is a FIFO (a planted regular file or link is left alone); a
dump file is taken only when it is a regular file (not a link) owned by the user who asked,
written after the request, and copied up to what was read.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import http.client
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from frtools.formats import limits
from frtools.formats.manifest import STACKS_SUFFIX, Manifest, RankEntry, rank_file_name
from frtools.formats.private_files import own_folder, write_new
from frtools.formats.torch_fr import DUMP_FILE_PREFIX
from frtools.model.ranks import MAX_WORLD_SIZE, valid_rank

# Every recorder a rank may hold, and the file each answer lands in (``rank_<R><suffix>``).
_TRACE_HANDLERS = (
    ("dump_nccl_trace_pickle", ".pkl"),  # ProcessGroupNCCL's (richer: call sites)
    ("fr_trace_json", ".json"),  # the generic one: Gloo's
    ("fr_trace_json?backend=nccl2", ".nccl2.json"),  # torch 2.15: nccl2 groups (hook)
)
# PyTorch writes an empty trace as ``"entries":[]`` or without the key (JSON), and as
# ``X\x07\x00\x00\x00entries`` + a memo put + EMPTY_LIST MARK APPENDS (pickle).
_EMPTY_JSON = re.compile(rb'"entries"\s*:\s*\[\s*\]')
_EMPTY_PICKLE = re.compile(rb"\x07\x00\x00\x00entries(?:q.|r....)?\]\(e", re.DOTALL)


def holds_ops(body: bytes) -> bool:
    """Whether a trace answer may hold an op: False only when it surely holds none (an
    answer that cannot be told is kept; the analyzer reads it for real)."""
    if b"entries" not in body:
        return False
    return not (_EMPTY_JSON.search(body) or _EMPTY_PICKLE.search(body))


_STACKS_HANDLER = "dump_traceback"
DEFAULT_NCCL_DUMP_PREFIX = f"/tmp/{DUMP_FILE_PREFIX}"


class ResponseTooLarge(OSError):
    """An answer longer than the ``response_bytes`` limit."""


class _DeadlineSocket(socket.socket):
    """A socket whose every read waits at most until one deadline for the whole request
    (not a timeout per read: a server sending a byte every half second would otherwise
    never time out) and that refuses to receive more than ``max_bytes``."""

    deadline: float = 0.0
    max_bytes: int = 0
    received: int = 0

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        self.settimeout(remaining)

    def recv_into(self, buffer, nbytes=0, flags=0):  # type: ignore[no-untyped-def,override]
        self._arm()
        n = super().recv_into(buffer, nbytes, flags)
        self._count(n)
        return n

    def recv(self, bufsize, flags=0):  # type: ignore[no-untyped-def,override]
        self._arm()
        data = super().recv(bufsize, flags)
        self._count(len(data))
        return data

    def _count(self, n: int) -> None:
        self.received += n
        if self.received > self.max_bytes:
            raise ResponseTooLarge(
                f"answer larger than {limits.size_text(self.max_bytes)} "
                "(limit response_bytes); refused"
            )


def _deadline_socket(family: int, deadline: float, max_bytes: int) -> _DeadlineSocket:
    sock = _DeadlineSocket(family, socket.SOCK_STREAM)
    sock.deadline, sock.max_bytes = deadline, max_bytes
    return sock


class _DeadlineConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (``unix_path``) or TCP, every read bounded by one deadline
    and the answer by ``max_bytes``."""

    def __init__(
        self, host: str, port: int | None, deadline: float, max_bytes: int, unix_path: str = ""
    ) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self._deadline, self._max_bytes, self._unix_path = deadline, max_bytes, unix_path

    def connect(self) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        if self._unix_path:
            sock = _deadline_socket(socket.AF_UNIX, self._deadline, self._max_bytes)
            try:
                sock.settimeout(remaining)
                sock.connect(self._unix_path)
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return
        error: OSError | None = None
        for family, _, _, _, addr in socket.getaddrinfo(
            self.host, self.port, 0, socket.SOCK_STREAM
        ):
            sock = _deadline_socket(family, self._deadline, self._max_bytes)
            try:
                sock.settimeout(max(self._deadline - time.monotonic(), 0.001))
                sock.connect(addr)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            self.sock = sock
            return
        raise error or OSError(f"cannot connect to {self.host}:{self.port}")


# (deadline, max_bytes) -> a connection
ConnFactory = Callable[[float, int], http.client.HTTPConnection]


def _unix(path: str) -> ConnFactory:
    return lambda deadline, cap: _DeadlineConnection("localhost", None, deadline, cap, path)


def _tcp(host: str, port: int) -> ConnFactory:
    return lambda deadline, cap: _DeadlineConnection(host, port, deadline, cap)


def _post(conn_factory: ConnFactory, handler: str, deadline: float) -> bytes | None:
    """Body of ``POST /handler/<handler>``; None when the handler does not exist. The whole
    request (connecting, every read) ends by ``deadline``; an answer longer than
    ``response_bytes`` is refused (``ResponseTooLarge``)."""
    if deadline - time.monotonic() <= 0:
        raise TimeoutError("timed out")
    cap = limits.current().response_bytes
    conn = conn_factory(deadline, cap)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        if resp.length is not None and resp.length > cap:
            raise ResponseTooLarge(
                f"answer of {limits.size_text(resp.length)} announced "
                f"(limit response_bytes = {limits.size_text(cap)}); refused"
            )
        parts = []
        while True:  # in pieces: a length the server announces is never allocated at once
            part = resp.read(1 << 20)
            if not part:
                break
            parts.append(part)
        body = b"".join(parts)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}: {body[:200].decode(errors='replace').strip()}")
        return body
    finally:
        conn.close()


def rank_from_name(path: str) -> int | None:
    """The rank in a per-rank file name: the last number of its stem (``ws_3.sock`` → 3);
    None when it has none or one at or beyond ``MAX_WORLD_SIZE``."""
    numbers = re.findall(r"\d+", Path(path).name.split(".")[0])
    if not numbers or len(numbers[-1].lstrip("0")) > len(str(MAX_WORLD_SIZE)):
        return None
    rank = int(numbers[-1])
    return rank if valid_rank(rank) else None


_EMPTY_KEPT_BYTES = 64 * 1024  # an empty trace is a few hundred bytes


def _keep_trace(rank: int, suffix: str, body: bytes, out_dir: Path, entry: RankEntry) -> None:
    name = rank_file_name(rank, suffix)
    write_new(out_dir / name, body)
    entry.files.append(name)
    entry.answered = True


def _collect_worker(
    rank: int,
    conn_factory: ConnFactory,
    out_dir: Path,
    entry: RankEntry,
    deadline: float,
) -> None:
    # Each answer is written (or dropped) as it arrives: one rank never holds more than one
    # answer in memory. An empty trace is kept only when no recorder holds ops (the rank
    # answered), and only if small; a byte-identical answer (2.13 ignores backend=) is dropped.
    seen: set[bytes] = set()
    empty: tuple[str, bytes] | None = None
    answered = False
    try:
        for handler, suffix in _TRACE_HANDLERS:
            body = _post(conn_factory, handler, deadline)
            if body is None:
                continue
            answered = True
            digest = hashlib.sha256(body).digest()
            if digest in seen:
                continue
            seen.add(digest)
            if holds_ops(body):
                _keep_trace(rank, suffix, body, out_dir, entry)
            elif empty is None and len(body) <= _EMPTY_KEPT_BYTES:
                empty = (suffix, body)
            del body
    except (OSError, http.client.HTTPException) as exc:
        if not answered:
            entry.note = f"no answer: {exc or type(exc).__name__}"
            return
    if not answered:
        entry.note = "no Flight Recorder handler on this worker"
    elif not entry.answered:
        if empty is not None:
            _keep_trace(rank, *empty, out_dir, entry)
        else:
            entry.note = "answered, but none of its Flight Recorders holds an op"
    try:
        stacks = _post(conn_factory, _STACKS_HANDLER, deadline)
    except (OSError, http.client.HTTPException) as exc:
        entry.note = (
            f"trace collected, but no stacks ({exc or type(exc).__name__}): the stacks "
            "handler needs the GIL, which a thread of this rank may be holding"
        )
        return
    if stacks:
        name = rank_file_name(rank, STACKS_SUFFIX)
        write_new(out_dir / name, stacks)
        entry.files.append(name)


def _collect_parallel(
    targets: dict[int, ConnFactory],
    manifest: Manifest,
    out_dir: Path,
    timeout: float,
) -> None:
    if not targets:
        return
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        for rank, factory in targets.items():
            pool.submit(_collect_worker, rank, factory, out_dir, manifest.ranks[rank], deadline)


def collect_sockets(
    patterns: Sequence[str], out_dir: str | os.PathLike[str], timeout: float = 5.0
) -> Manifest:
    """Ask every worker-server unix socket matching ``patterns`` (globs) for its trace and
    stacks. The rank is the last number in the socket's name."""
    out = own_folder(out_dir)
    paths = sorted({p for pat in patterns for p in glob.glob(pat)} | _literal(patterns))
    manifest = Manifest(job_id="torch-fr", mode="torch-socket")
    targets: dict[int, ConnFactory] = {}
    for index, path in enumerate(paths):
        rank = rank_from_name(path)
        if rank is None or rank in manifest.ranks:
            manifest.notes.append(f"{path}: no rank number in the socket name, using {index}")
            rank = index
        manifest.ranks[rank] = RankEntry(rank=rank, host=manifest.host, note=path)
        targets[rank] = _unix(path)
    _collect_parallel(targets, manifest, out, timeout)
    return manifest


def _literal(patterns: Sequence[str]) -> set[str]:
    return {p for p in patterns if not glob.has_magic(p) and os.path.exists(p)}


def collect_debug_servers(
    store_addr: str,
    out_dir: str | os.PathLike[str],
    timeout: float = 5.0,
    prefix: str = "debug_server/",
) -> Manifest:
    """Ask every rank's ``torch.distributed.debug`` worker server, found through the job's
    TCPStore (``<prefix>rank<R>`` → ``http://host:port``), for its trace and stacks."""
    from frtools.collect.jobwide import connect_store

    out = own_folder(out_dir)
    store = connect_store(store_addr, timeout)
    manifest = Manifest(job_id=store_addr, mode="torch-store")
    targets: dict[int, ConnFactory] = {}
    rank = 0
    # the store has no authentication: its keys are bounded like any hostile input (at most
    # MAX_WORLD_SIZE ranks, found within the timeout, addresses of a sane length)
    deadline = time.monotonic() + timeout
    while (
        rank < MAX_WORLD_SIZE
        and time.monotonic() < deadline
        and store.check([f"{prefix}rank{rank}"])
    ):
        url = store.get(f"{prefix}rank{rank}")[:512].decode(errors="replace")
        m = re.match(r"https?://\[?([^\]/]+?)\]?:(\d{1,5})(?:/|$)", url)
        entry = RankEntry(rank=rank, note=url)
        manifest.ranks[rank] = entry
        if m and int(m.group(2)) < 65536:
            entry.host = m.group(1)
            targets[rank] = _tcp(m.group(1), int(m.group(2)))
        else:
            entry.note = f"unusable address {url!r}"
        rank += 1
    manifest.world_size = rank or None
    _collect_parallel(targets, manifest, out, timeout)
    return manifest


def collect_pipes(
    prefix: str,
    out_dir: str | os.PathLike[str],
    timeout: float = 5.0,
    dump_prefix: str | None = None,
) -> Manifest:
    """Write to every ``<prefix><rank>.pipe`` FIFO (ProcessGroupNCCL's debug-info pipe) and
    collect the dumps that appear at ``<dump_prefix><rank>``."""
    out = own_folder(out_dir)
    dump_prefix = dump_prefix or os.environ.get(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", DEFAULT_NCCL_DUMP_PREFIX
    )
    manifest = Manifest(job_id="torch-fr", mode="torch-pipe")
    # the file system's clock may lag this one by a tick: a dump written in answer is newer
    # than this (a planted file older than the request is not taken)
    requested_ns = time.time_ns() - 10_000_000
    pending: dict[int, Path] = {}
    for path in sorted(glob.glob(glob.escape(prefix) + "*.pipe")):
        tail = path[len(prefix) : -len(".pipe")]
        if not tail.isdigit() or len(tail) > len(str(MAX_WORLD_SIZE)):
            continue
        rank = int(tail)
        if not valid_rank(rank):
            continue
        entry = RankEntry(rank=rank, host=manifest.host)
        manifest.ranks[rank] = entry
        why = _poke_pipe(path)
        if why:
            entry.note = why
            continue
        pending[rank] = Path(f"{dump_prefix}{rank}")
    deadline = time.monotonic() + timeout
    sizes: dict[int, int] = {}
    while pending and time.monotonic() < deadline:
        for rank, dump in list(pending.items()):
            got = _answer_file(dump, requested_ns)
            if isinstance(got, str):
                manifest.ranks[rank].note = got
                continue
            if got is None:
                continue
            size = got.st_size
            if size > 0 and sizes.get(rank) == size:
                name = rank_file_name(rank, ".pkl")
                try:
                    _copy_answer(dump, out / name, requested_ns)
                except (OSError, limits.InputRefused) as exc:
                    manifest.ranks[rank].note = f"{dump}: not collected: {exc}"
                    del pending[rank]
                    continue
                manifest.ranks[rank].files.append(name)
                manifest.ranks[rank].answered = True
                manifest.ranks[rank].note = ""
                del pending[rank]
            else:
                sizes[rank] = size
        time.sleep(0.1)
    for rank in pending:
        note = manifest.ranks[rank].note
        manifest.ranks[rank].note = note or f"no dump appeared at {dump_prefix}{rank}"
    if not manifest.ranks:
        manifest.notes.append(
            f"no {prefix}<rank>.pipe found: the pipe exists only with ProcessGroupNCCL "
            "and TORCH_NCCL_DEBUG_INFO_PIPE_FILE set"
        )
    return manifest


def _poke_pipe(path: str) -> str:
    """Write one byte to a rank's debug-info pipe; the reason when nothing was written. Only
    a FIFO is written to: a regular file or a link planted where the pipe should be (the
    byte would land in whatever it names) is left alone, as is a device."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return str(exc)
    if not stat.S_ISFIFO(st.st_mode):
        return f"{path} is not a FIFO (a planted file or link?); not written to"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return "nobody reads the pipe (process gone?)"
        if exc.errno == errno.ELOOP:
            return f"{path} is a link, not a FIFO; not written to"
        return str(exc)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # swapped since the lstat
            return f"{path} is not a FIFO (a planted file or link?); not written to"
        os.write(fd, b"1\n")
    except BlockingIOError:
        return "the pipe is full (its reader is not reading)"
    except OSError as exc:
        return str(exc)
    finally:
        os.close(fd)
    return ""


def _answer_file(path: Path, requested_ns: int) -> os.stat_result | str | None:
    """The ``lstat`` of a dump file that may be the answer; None while it is not there yet
    (or older than the request: it may still be rewritten), the reason when it can never be
    one: not a regular file, or not owned by the user who asked (planted in a shared
    ``/tmp``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(exc)
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a planted link?); not taken"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (planted?); not taken"
    if st.st_mtime_ns < requested_ns:
        return None
    return st


def _copy_answer(src: Path, dst: Path, requested_ns: int) -> None:
    """Copy the answer, checked again on the opened file (regular, ours, newer than the
    request), at most ``dump_bytes``."""
    fd, st = limits.open_regular(src, follow_symlinks=False)
    with os.fdopen(fd, "rb") as f:
        if st.st_uid != os.getuid() or st.st_mtime_ns < requested_ns:
            raise limits.InputRefused("changed owner or age while collected; not taken")
        cap = limits.current().dump_bytes
        data = f.read(cap + 1)
        if len(data) > cap:
            raise limits.exceeded("dump file", "dump_bytes", cap)
    write_new(dst, data)
