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
"""

from __future__ import annotations

import errno
import glob
import http.client
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from frtools.formats.manifest import STACKS_SUFFIX, Manifest, RankEntry, rank_file_name
from frtools.formats.torch_fr import DUMP_FILE_PREFIX

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


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._unix_path)
        self.sock = sock


ConnFactory = Callable[[float], http.client.HTTPConnection]


def _post(conn_factory: ConnFactory, handler: str, deadline: float) -> bytes | None:
    """Body of ``POST /handler/<handler>``; None when the handler does not exist."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out")
    conn = conn_factory(remaining)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}: {body[:200].decode(errors='replace').strip()}")
        return body
    finally:
        conn.close()


def rank_from_name(path: str) -> int | None:
    """The rank in a per-rank file name: the last number of its stem (``ws_3.sock`` → 3)."""
    numbers = re.findall(r"\d+", Path(path).name.split(".")[0])
    return int(numbers[-1]) if numbers else None


def _collect_worker(
    rank: int,
    conn_factory: ConnFactory,
    out_dir: Path,
    entry: RankEntry,
    deadline: float,
) -> None:
    answers: list[tuple[str, bytes]] = []
    try:
        for handler, suffix in _TRACE_HANDLERS:
            body = _post(conn_factory, handler, deadline)
            if body is not None and all(body != b for _, b in answers):
                answers.append((suffix, body))
    except (OSError, http.client.HTTPException) as exc:
        if not answers:
            entry.note = f"no answer: {exc or type(exc).__name__}"
            return
    if not answers:
        entry.note = "no Flight Recorder handler on this worker"
    # each recorder that holds ops; an empty trace only when none does (the rank answered)
    kept = [a for a in answers if holds_ops(a[1])] or answers[-1:]
    for suffix, body in kept:
        name = rank_file_name(rank, suffix)
        (out_dir / name).write_bytes(body)
        entry.files.append(name)
        entry.answered = True
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
        (out_dir / name).write_bytes(stacks)
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted({p for pat in patterns for p in glob.glob(pat)} | _literal(patterns))
    manifest = Manifest(job_id="torch-fr", mode="torch-socket")
    targets: dict[int, ConnFactory] = {}
    for index, path in enumerate(paths):
        rank = rank_from_name(path)
        if rank is None or rank in manifest.ranks:
            manifest.notes.append(f"{path}: no rank number in the socket name, using {index}")
            rank = index
        manifest.ranks[rank] = RankEntry(rank=rank, host=manifest.host, note=path)
        targets[rank] = lambda t, p=path: _UnixHTTPConnection(p, t)
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

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = connect_store(store_addr, timeout)
    manifest = Manifest(job_id=store_addr, mode="torch-store")
    targets: dict[int, ConnFactory] = {}
    rank = 0
    while store.check([f"{prefix}rank{rank}"]):
        url = store.get(f"{prefix}rank{rank}").decode()
        m = re.match(r"https?://\[?([^\]/]+?)\]?:(\d+)", url)
        entry = RankEntry(rank=rank, note=url)
        manifest.ranks[rank] = entry
        if m:
            entry.host = m.group(1)
            host, port = m.group(1), int(m.group(2))
            targets[rank] = lambda t, h=host, p=port: http.client.HTTPConnection(h, p, timeout=t)
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_prefix = dump_prefix or os.environ.get(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", DEFAULT_NCCL_DUMP_PREFIX
    )
    manifest = Manifest(job_id="torch-fr", mode="torch-pipe")
    started = time.time()
    pending: dict[int, Path] = {}
    for path in sorted(glob.glob(glob.escape(prefix) + "*.pipe")):
        tail = path[len(prefix) : -len(".pipe")]
        if not tail.isdigit():
            continue
        rank = int(tail)
        entry = RankEntry(rank=rank, host=manifest.host)
        manifest.ranks[rank] = entry
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            entry.note = (
                "nobody reads the pipe (process gone?)" if exc.errno == errno.ENXIO else str(exc)
            )
            continue
        try:
            os.write(fd, b"1\n")
        finally:
            os.close(fd)
        pending[rank] = Path(f"{dump_prefix}{rank}")
    deadline = time.monotonic() + timeout
    sizes: dict[int, int] = {}
    while pending and time.monotonic() < deadline:
        for rank, dump in list(pending.items()):
            try:
                st = dump.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime >= started - 1 and st.st_size > 0 and sizes.get(rank) == st.st_size:
                name = rank_file_name(rank, ".pkl")
                shutil.copyfile(dump, out / name)
                manifest.ranks[rank].files.append(name)
                manifest.ranks[rank].answered = True
                del pending[rank]
            else:
                sizes[rank] = st.st_size
        time.sleep(0.1)
    for rank in pending:
        manifest.ranks[rank].note = f"no dump appeared at {dump_prefix}{rank}"
    if not manifest.ranks:
        manifest.notes.append(
            f"no {prefix}<rank>.pipe found: the pipe exists only with ProcessGroupNCCL "
            "and TORCH_NCCL_DEBUG_INFO_PIPE_FILE set"
        )
    return manifest
