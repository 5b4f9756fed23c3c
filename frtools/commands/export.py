"""``frtools export DIR -o entries.parquet``: the Trace as Parquet, for pandas and DuckDB.

Three files, so that a query can join them by ``rank`` / ``pg_name``:

* ``entries.parquet`` - one row per recorded call of any rank (``frtools.model.trace.ENTRY_SCHEMA``);
* ``<stem>.ranks.parquet`` - one row per rank: identity, dump provenance, ``pg_status``;
* ``<stem>.process_groups.parquet`` - one row per group: desc, member ranks.

The entries file also carries the world size and the input files' fate in its Parquet
key-value metadata (``frtools.world_size``, ``frtools.inputs``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import click


def _fail(message: str) -> None:
    click.echo(f"frtools export: error: {message}", err=True)
    sys.exit(2)


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
    trace: object, entries_path: Path, compression: str = "zstd"
) -> tuple[Path, Path, Path]:
    """Write a ``Trace``'s three tables; returns the three paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from frtools.model.trace import Trace

    assert isinstance(trace, Trace)
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


@click.command("export")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("entries.parquet"),
    show_default=True,
    help="Entries file; the ranks and process-group tables are written next to it.",
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Processes reading dump files."
)
@click.option(
    "--compression",
    type=click.Choice(["zstd", "snappy", "gzip", "none"]),
    default="zstd",
    show_default=True,
)
def export(path: Path, output: Path, workers: int | None, compression: str) -> None:
    """Export the entries of the dumps under PATH to Parquet (plus ranks and process-group
    tables next to it), for pandas, DuckDB or Spark."""
    try:
        from frtools.analyze.readers import UnusableInput, load_trace

        try:
            trace = load_trace(path, workers=workers, progress=sys.stderr.isatty())
        except UnusableInput as e:
            _fail(str(e).splitlines()[0] if str(e) else "unusable input")
            return
        if not output.parent.exists():
            _fail(f"cannot write {output}: directory {output.parent} does not exist")
        try:
            paths = write_parquet(trace, output, compression=compression)
        except OSError as e:
            _fail(f"cannot write {e.filename or output}: {e.strerror or e}")
            return
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _fail("interrupted")
        return
    except Exception as e:  # noqa: BLE001 - one line for the user, never a traceback
        if os.environ.get("FRTOOLS_DEBUG") == "1":
            traceback.print_exc()
        _fail(f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return
    problems = [i for i in trace.inputs if i.status == "error"]
    click.echo(
        f"Wrote {trace.entries.num_rows:,} entries of {len(trace.ranks)} ranks to {paths[0]} "
        f"(+ {paths[1].name}, {paths[2].name})"
    )
    for i in problems:
        click.echo(f"  skipped {i.path}: {i.reason}", err=True)
