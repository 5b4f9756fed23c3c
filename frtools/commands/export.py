"""``frtools export DIR -o entries.parquet``: the Trace as Parquet, for pandas and DuckDB
(the files: ``frtools.formats.parquet``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from frtools.commands._common import fail, first_line, guarded, path_argument, workers_option

ERROR = "frtools export: error"


@click.command("export")
@path_argument
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("entries.parquet"),
    show_default=True,
    help="Entries file; the ranks and process-group tables are written next to it.",
)
@workers_option
@click.option(
    "--compression",
    type=click.Choice(["zstd", "snappy", "gzip", "none"]),
    default="zstd",
    show_default=True,
)
@guarded(ERROR)
def export(path: Path, output: Path, workers: int | None, compression: str) -> int:
    """Export the entries of the dumps under PATH to Parquet (plus ranks and process-group
    tables next to it), for pandas, DuckDB or Spark."""
    from frtools.analyze.readers import UnusableInput, load_trace
    from frtools.formats.parquet import write_parquet

    try:
        trace = load_trace(path, workers=workers, progress=sys.stderr.isatty())
    except UnusableInput as e:
        fail(ERROR, first_line(e, "unusable input"))
    if not output.parent.exists():
        fail(ERROR, f"cannot write {output}: directory {output.parent} does not exist")
    try:
        paths = write_parquet(trace, output, compression=compression)
    except OSError as e:
        fail(ERROR, f"cannot write {e.filename or output}: {e.strerror or e}")
    click.echo(
        f"Wrote {trace.entries.num_rows:,} entries of {len(trace.ranks)} ranks to {paths[0]} "
        f"(+ {paths[1].name}, {paths[2].name})"
    )
    for i in trace.inputs:
        if i.status == "error":
            click.echo(f"  skipped {i.path}: {i.reason}", err=True)
    return 0
