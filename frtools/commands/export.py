"""``frtools export DIR -o entries.parquet``: the Trace as Parquet, for pandas and DuckDB
(the files: ``frtools.formats.parquet``)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click


def _fail(message: str) -> None:
    click.echo(f"frtools export: error: {message}", err=True)
    sys.exit(2)


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
        from frtools.formats.parquet import write_parquet

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
