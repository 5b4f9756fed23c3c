"""A Trace as Parquet, for pandas, DuckDB and Spark (``frtools export``).

Three files, so that a query can join them by ``rank`` / ``pg_name``:

* ``entries.parquet`` - one row per recorded call of any rank (``frtools.model.trace.ENTRY_SCHEMA``);
* ``<stem>.ranks.parquet`` - one row per rank: identity, dump provenance, ``pg_status``;
* ``<stem>.process_groups.parquet`` - one row per group: desc, member ranks.

The entries file also carries the world size and the input files' fate in its Parquet
key-value metadata (``frtools.world_size``, ``frtools.inputs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from frtools.model.trace import Trace


def side_paths(entries_path: Path) -> tuple[Path, Path]:
    """Where the ranks and process-group tables go next to ``entries_path``."""
    stem = (
        entries_path.name[: -len(".parquet")]
        if entries_path.name.endswith(".parquet")
        else entries_path.name
    )
    if stem == "entries":
        return entries_path.with_name("ranks.parquet"), entries_path.with_name(
            "process_groups.parquet"
        )
    return (
        entries_path.with_name(f"{stem}.ranks.parquet"),
        entries_path.with_name(f"{stem}.process_groups.parquet"),
    )


def write_parquet(
    trace: Trace, entries_path: Path, compression: str = "zstd"
) -> tuple[Path, Path, Path]:
    """Write a ``Trace``'s three tables; returns the three paths."""
    ranks_path, pgs_path = side_paths(entries_path)
    entries = trace.entries
    meta = dict(entries.schema.metadata or {})
    meta[b"frtools.world_size"] = json.dumps(trace.world_size).encode()
    meta[b"frtools.inputs"] = json.dumps([i.to_dict() for i in trace.inputs]).encode()
    pq.write_table(entries.replace_schema_metadata(meta), entries_path, compression=compression)

    infos = [trace.ranks[r] for r in sorted(trace.ranks)]
    ranks = pa.table(
        {
            "rank": pa.array([i.rank for i in infos], pa.int32()),
            "source": [i.source for i in infos],
            "format": [i.format for i in infos],
            "version": [i.version for i in infos],
            "host": [i.host for i in infos],
            "pid": pa.array([i.pid for i in infos], pa.int64()),
            "local_rank": pa.array([i.local_rank for i in infos], pa.int32()),
            "device": [i.device for i in infos],
            "device_id": [i.device_id for i in infos],
            "world_size": pa.array([i.world_size for i in infos], pa.int32()),
            "comm_lib_version": [i.comm_lib_version for i in infos],
            "pg_status": [json.dumps(i.pg_status, sort_keys=True) for i in infos],
            "dump_time_ns": pa.array([i.dump_time_ns for i in infos], pa.int64()),
            "stalled": pa.array([i.stalled for i in infos], pa.bool_()),
            "alive": pa.array([i.alive for i in infos], pa.bool_()),
            "wrapped": pa.array([i.wrapped for i in infos], pa.bool_()),
            "stacks": [i.stacks for i in infos],
        }
    )
    pq.write_table(ranks, ranks_path, compression=compression)

    groups = [trace.process_groups[name] for name in sorted(trace.process_groups, key=_name_key)]
    pgs = pa.table(
        {
            "pg_name": [g.name for g in groups],
            "pg_desc": [g.desc for g in groups],
            "size": pa.array([len(g.ranks) for g in groups], pa.int32()),
            "ranks": pa.array([list(g.ranks) for g in groups], pa.list_(pa.int32())),
            "inferred": pa.array([g.inferred for g in groups], pa.bool_()),
        }
    )
    pq.write_table(pgs, pgs_path, compression=compression)
    return entries_path, ranks_path, pgs_path


def _name_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)
