"""``frtools dump --job-wide``: ask every rank, on every host, through the job's TCPStore.

The requester connects to the store torchrun / ``init_process_group`` already runs (as a
client), publishes a request naming a shared directory, and waits (bounded) for the ranks'
watcher threads (``frtools.recorder.jobwide``) to write their snapshots and stacks there.
Ranks that do not answer are named in the manifest with the host and path of their black
box, which ``frtools dump`` run on that host still collects.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from frtools.config import STORE_PREFIX
from frtools.formats import store_protocol as protocol
from frtools.formats.manifest import Manifest


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
    """Ask every rank of the job behind ``store_addr`` to write its snapshot and stacks
    into ``out_dir`` (a directory every host can write: a shared file system)."""
    prefix = prefix if prefix is not None else STORE_PREFIX.read()
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = connect_store(store_addr, timeout)
    started = time.monotonic()
    seq = protocol.issue_request(
        store,
        prefix,
        {
            "dir": str(out),
            "reason": "frtools dump --job-wide",
            "by": f"pid {os.getpid()}",
            "time_ns": time.time_ns(),
        },
    )
    manifest = Manifest(job_id=job_id or store_addr, mode="job-wide")
    protocol.gather_answers(store, prefix, seq, manifest, timeout)
    manifest.elapsed_s = time.monotonic() - started
    manifest.write(out)
    return manifest
