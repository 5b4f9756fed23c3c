"""``frtools summarize DIR -o HOST.summary``: the per-host step of a fleet analysis.

DIR is a host's recorder job folder (``$FRTOOLS_DIR/<job>``), an ``frtools dump`` folder or
PyTorch Flight Recorder dumps; the summary is what the verdict needs of each rank there
(docs/fleet.md). ``frtools analyze`` reads summaries like any dump. ``--merge A B ...``
merges packed summaries (files or folders of them) into one partial: a rack's, then the
job's (``analyze.summarize.merge_files``). Exit codes: 0 written, 2 nothing usable, a
refused file or a usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from frtools.commands._common import (
    OneLineCommand,
    fail,
    first_line,
    guarded,
    workers_option,
)
from frtools.formats.summary_packed import DEFAULT_HOST_WINDOW, host_file_name
from frtools.model.ranks import format_ranks


@click.command("summarize", cls=OneLineCommand)
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="File to write, '-' for stdout, or an existing directory (then DIR/<host>.summary). "
    "Default: ./<host>.summary.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 3840),
    default=DEFAULT_HOST_WINDOW,
    show_default=True,
    help="The last ops kept per rank (every op that did not complete is kept besides).",
)
@click.option("--host", help="The host name the summary goes by (default: the ranks' own).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["packed", "json"]),
    default="packed",
    show_default=True,
    help="packed: compact columnar file (docs/summary-format.md); json: the same as "
    "readable JSON (a host document of rank summaries), several times larger.",
)
@click.option(
    "--merge",
    is_flag=True,
    help="Merge the packed summaries at PATHS (files, or folders of *.summary) into one "
    "partial, e.g. a rack's: the same bytes whatever their order (docs/fleet.md).",
)
@workers_option
@guarded("frtools")
def summarize(
    paths: tuple[Path, ...],
    output: Path | None,
    window: int,
    host: str | None,
    fmt: str,
    merge: bool,
    workers: int | None,
) -> int:
    """Summarize one host's flight records under PATH for a fleet analysis, or with
    --merge, merge host summaries into one partial.

    Exit code 0: written; 2: no usable record, a refused file, or a usage error.
    """
    if merge:
        return _merge(paths, output)
    if len(paths) != 1:
        fail("frtools summarize", "error: summarize takes one PATH (several with --merge)")
    (path,) = paths
    from frtools.analyze.readers import UnusableInput
    from frtools.analyze.summarize import summarize_path

    try:
        result = summarize_path(path, window=window, host=host, workers=workers)
    except UnusableInput as e:
        fail("frtools summarize", f"error: {first_line(e, 'unusable input')}")
    if fmt == "json":
        from frtools.formats.summary import encode_host

        data = encode_host(result.summaries, result.host)
    else:
        data = result.encode()
    name = host_file_name(result.host)
    if fmt == "json":
        name = name.removesuffix(".summary") + ".summary.json"
    target = _write(data, output, name)
    bad = [i for i in result.inputs if i.status == "error"]
    ranks = [s.rank for s in result.summaries]
    where = "stdout" if str(target) == "-" else str(target)
    line = f"{result.host}: {len(ranks)} rank(s) {format_ranks(ranks)} -> {where}"
    line += f" ({len(data) / 1024:.1f} KB)"
    if bad:
        line += f"; {len(bad)} unusable file(s)"
    click.echo(line, err=True)
    for i in bad:
        click.echo(f"frtools summarize: {i.path}: {i.reason}", err=True)
    return 0


def _write(data: bytes, output: Path | None, name: str) -> Path:
    """Write to ``output`` (a file, '-' for stdout, a folder: FOLDER/``name``)."""
    target = output if output is not None else Path(name)
    if str(target) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return target
    if target.is_dir():
        target = target / name
    try:
        target.write_bytes(data)
    except OSError as e:
        fail("frtools summarize", f"error: cannot write {target}: {e.strerror or e}")
    return target


def _merge(paths: tuple[Path, ...], output: Path | None) -> int:
    from frtools.analyze.summarize import merge_files
    from frtools.formats.summary import SummaryError

    try:
        partial = merge_files(paths)
    except SummaryError as e:
        fail("frtools summarize", f"error: {first_line(e, 'cannot merge')}")
    hosts = partial.hosts
    label = hosts[0] if len(hosts) == 1 else f"{hosts[0]}..{hosts[-1]}" if hosts else "partial"
    target = _write(partial.data, output, host_file_name(label))
    where = "stdout" if str(target) == "-" else str(target)
    click.echo(
        f"merged {len(partial.files)} file(s): {len(partial.ranks)} rank(s) "
        f"{format_ranks(partial.ranks)} of {len(hosts)} host(s) -> {where} "
        f"({len(partial.data) / 1024:.1f} KB)",
        err=True,
    )
    return 0
