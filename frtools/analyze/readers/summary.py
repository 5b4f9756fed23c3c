"""Reader for rank summaries (``rank_<R>.summary.json``, docs/summary-format.md).

A summary is the part of a black box a verdict needs (``frtools.formats.summary``); this
reader maps it onto the Trace exactly as the snapshot reader maps the box it came from, so
that a folder of summaries gives the verdict the boxes give. ``frtools.recovery`` writes
the summaries its ranks agreed on into each incident folder: ``frtools analyze`` of that
folder shows how the verdict was reached.

``read`` takes a file with one rank's summary; ``read_all`` also takes a host summary (many
ranks in one document) and returns one ``RankDump`` per rank.
"""

from __future__ import annotations

from pathlib import Path

from frtools.formats import limits
from frtools.formats.summary import (
    RankSummary,
    SummaryError,
    decode,
    looks_like_summary,
)
from frtools.model.ops import op_name
from frtools.model.trace import ProcessGroup, RankInfo, entries_table

from .base import DumpError, RankDump, read_content
from .frtools_snapshot import ALL_RANKS_ABOVE, call_site_of

FORMAT = "frtools-summary"


def sniff(path: Path, head: bytes) -> bool:
    return looks_like_summary(head)


def read(path: Path) -> RankDump:
    """One rank's summary -> RankDump (a host summary of one rank too)."""
    dumps = read_all(path)
    if len(dumps) != 1:
        raise DumpError(
            f"host summary of {len(dumps)} ranks: read it with readers.summary.read_all"
        )
    return dumps[0]


def read_all(path: Path) -> list[RankDump]:
    """Every rank summary in the file (one, or a host summary's list)."""
    data, stored = read_content(path)
    try:
        limits.check_json(data, stored=stored)  # what parsing it costs, as for a JSON dump
        summaries = decode(data)
    except (SummaryError, limits.InputRefused) as e:
        raise DumpError(str(e)) from None
    return [summary_to_rank_dump(s, str(path)) for s in summaries]


def summary_to_rank_dump(summary: RankSummary, source: str) -> RankDump:
    """Map a summary onto the Trace model (as ``frtools_snapshot`` maps a black box)."""
    ident = summary.identity
    backend = ident.get("backend") or None
    info = RankInfo(
        rank=summary.rank,
        source=source,
        format=FORMAT,
        version="1",
        host=ident.get("host") or None,
        pid=ident.get("pid") if isinstance(ident.get("pid"), int) else None,
        local_rank=ident.get("local_rank") if isinstance(ident.get("local_rank"), int) else None,
        device=ident.get("device") or None,
        device_id=ident.get("device_id") or None,
        world_size=summary.world_size,
        comm_lib_version=ident.get("comm_lib_version") or None,
        pg_status={
            g.name: {
                "last_enqueued_collective": g.last_enqueued_collective,
                "last_started_collective": g.last_started_collective,
                "last_completed_collective": g.last_completed_collective,
            }
            for g in summary.groups
        },
        stacks=summary.stacks,
        dump_time_ns=summary.heartbeat_ns,
        stalled=summary.stalled,
        alive=summary.alive,
        wrapped=summary.wrapped,
        exit_kind=summary.exit_kind,
        exit_detail=summary.exit_detail,
        last_heartbeat_ns=summary.heartbeat_ns,
    )
    world = summary.world_size
    default_pg_all = False
    process_groups = {}
    for g in summary.groups:
        ranks = g.ranks
        is_default = g.name == "0" or g.desc == "default_pg"
        big = world is not None and world > ALL_RANKS_ABOVE
        if is_default and big and ranks == tuple(range(world)):
            default_pg_all = True
            ranks = ()
        process_groups[g.name] = ProcessGroup(name=g.name, desc=g.desc, ranks=ranks)
    sites: dict[str, str | None] = {}

    def site(stack: str) -> str | None:
        if stack not in sites:
            sites[stack] = call_site_of(stack) if stack else None
        return sites[stack]

    groups = summary.groups
    es = summary.entries
    columns = {
        "rank": [summary.rank] * len(es),
        "record_id": [e.record_id for e in es],
        "pg_name": [groups[e.group].name if e.group >= 0 else None for e in es],
        "pg_desc": [groups[e.group].desc if e.group >= 0 else None for e in es],
        "collective_seq_id": [e.collective_seq_id for e in es],
        "p2p_seq_id": [e.p2p_seq_id for e in es],
        "is_p2p": [e.is_p2p for e in es],
        "op": [op_name(e.op) for e in es],
        "profiling_name": [
            e.op if (":" in e.op or not backend or not e.op) else f"{backend}:{e.op}" for e in es
        ],
        "peer": [e.peer for e in es],
        "input_sizes": [e.input_sizes for e in es],
        "output_sizes": [e.output_sizes for e in es],
        "input_dtypes": [e.input_dtypes for e in es],
        "output_dtypes": [e.output_dtypes for e in es],
        "state": [e.state for e in es],
        "time_created_ns": [e.time_created_ns for e in es],
        "time_started_ns": [e.time_started_ns for e in es],
        "time_completed_ns": [e.time_completed_ns for e in es],
        "duration_ms": [e.duration_ms for e in es],
        "retired": [e.state == "completed" for e in es],
        "thread_id": [e.thread_id for e in es],
        "thread_name": [e.thread_name or None for e in es],
        "call_site": [site(e.stack) for e in es],
        "stack": [e.stack or None for e in es],
        "error": [e.error or None for e in es],
    }
    created = columns["time_created_ns"]
    return RankDump(
        rank_info=info,
        entries=entries_table(columns),
        process_groups=process_groups,
        notes=list(summary.notes),
        max_time_created_ns=max(created) if created else None,
        default_pg_all=default_pg_all,
    )
