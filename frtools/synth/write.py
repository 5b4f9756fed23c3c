"""Every rank's file, written by the writer of the chosen format, in a pool of forked
workers.

A writer module has ``file_name(params, rank)`` and ``rank_bytes(job, rank)``; ``WRITERS``
names them by ``WriteParams.format``. ``"summary"`` writes one packed host summary per
host instead (``summary_writer``: ``file_name(params, host)``, ``host_bytes(job, host)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from . import snapshot_writer, summary_writer, torch_writer
from .job import RANKS_PER_HOST, Job

WRITERS: dict[str, ModuleType] = {
    "torch": torch_writer,
    "frtools": snapshot_writer,
    "summary": summary_writer,
}

# set in the parent before forking the pool; workers read it
_JOB: Job | None = None
_OUT: Path | None = None


def _write_ranks(ranks: list[int]) -> int:
    assert _JOB is not None and _OUT is not None
    writer = WRITERS[_JOB.params.format]
    written = 0
    if writer is summary_writer:  # ``ranks`` are hosts here
        for h in ranks:
            data = summary_writer.host_bytes(_JOB, h, _JOB.params.window)
            (_OUT / summary_writer.file_name(_JOB.params, h)).write_bytes(data)
            written += len(data)
        return written
    for r in ranks:
        data = writer.rank_bytes(_JOB, r)
        (_OUT / writer.file_name(_JOB.params, r)).write_bytes(data)
        written += len(data)
    return written


def write_dumps(job: Job, out_dir: Path, workers: int | None = None) -> int:
    """Write every rank's dump (but the omitted ones) into ``out_dir``; returns bytes."""
    global _JOB, _OUT
    ranks = [r for r in range(job.layout.world_size) if r not in job.params.omit_ranks]
    if job.params.format == "summary":  # one file per host
        ranks = sorted({r // RANKS_PER_HOST for r in ranks})
    workers = workers or min(os.cpu_count() or 1, 16)
    _JOB, _OUT = job, out_dir
    try:
        if workers <= 1 or len(ranks) < 32:
            return _write_ranks(ranks)
        import multiprocessing as mp

        chunk = max(1, min(64, len(ranks) // (workers * 4)))
        chunks = [ranks[i : i + chunk] for i in range(0, len(ranks), chunk)]
        ctx = mp.get_context("fork")
        with ctx.Pool(workers) as pool:
            return sum(pool.imap_unordered(_write_ranks, chunks))
    finally:
        _JOB, _OUT = None, None
