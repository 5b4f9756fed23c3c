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

from frtools.formats import store_protocol as protocol
from frtools.formats.manifest import Manifest, RankEntry


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


def gather_answers(
    store: Any, prefix: str, seq: int, manifest: Manifest, timeout: float
) -> Manifest:
    """Wait up to ``timeout`` s for every registered rank to answer request ``seq``, then
    fill ``manifest`` with who answered and who did not (and where their black box is)."""
    world = None
    if store.check([protocol.world_size_key(prefix)]):
        raw = store.get(protocol.world_size_key(prefix)).decode()
        world = int(raw) if raw.isdigit() else None
    manifest.world_size = manifest.world_size or world
    deadline = time.monotonic() + timeout
    while world and time.monotonic() < deadline:
        if int(store.add(protocol.answered_key(prefix, seq), 0)) >= world:
            break
        time.sleep(0.1)
    ranks = range(world) if world else range(0)
    for rank in ranks:
        entry = RankEntry(rank=rank)
        manifest.ranks[rank] = entry
        if store.check([protocol.answer_key(prefix, seq, rank)]):
            answer = protocol.decode(store.get(protocol.answer_key(prefix, seq, rank)))
            entry.host, entry.pid = answer.get("host"), answer.get("pid")
            entry.answered, entry.alive = True, True
            entry.files = list(answer.get("files") or [])
            continue
        where = "its black box"
        if store.check([protocol.rank_key(prefix, rank)]):
            reg = protocol.decode(store.get(protocol.rank_key(prefix, rank)))
            entry.host, entry.pid = reg.get("host"), reg.get("pid")
            where = f"its black box {reg.get('blackbox')} on {reg.get('host')}"
            entry.note = (
                "did not answer through the store (process gone, or its Python threads "
                "cannot run, e.g. a thread holds the GIL); "
                f"{where} is collected by `frtools dump` run on that host"
            )
        else:
            entry.note = "never registered (recorder not enabled on this rank?)"
    if manifest.ranks_no_answer:
        manifest.notes.append(
            "ranks "
            + ", ".join(map(str, manifest.ranks_no_answer))
            + " did not answer: run `frtools dump -o DIR` on their hosts to collect their "
            "black boxes (see each rank's note)"
        )
    if not world:
        manifest.notes.append("no rank has registered in this store (is the recorder on?)")
    return manifest


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
    prefix = prefix if prefix is not None else protocol.prefix_from_env()
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
    gather_answers(store, prefix, seq, manifest, timeout)
    manifest.elapsed_s = time.monotonic() - started
    manifest.write(out)
    return manifest
