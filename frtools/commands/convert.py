"""``frtools convert DIR --to torch-pickle -o OUT``: black boxes -> PyTorch FR pickles."""

from __future__ import annotations

import sys

import click


@click.command("convert")
@click.argument("src", type=click.Path(exists=True))
@click.option(
    "--to",
    "fmt",
    type=click.Choice(["torch-pickle"]),
    default="torch-pickle",
    show_default=True,
    help="Output format: PyTorch Flight Recorder dumps (version 2.10), one per rank.",
)
@click.option(
    "-o", "--output", required=True, type=click.Path(file_okay=False), help="Output directory."
)
def convert(src: str, fmt: str, output: str) -> None:
    """Convert the frtools black boxes (*.frt) under SRC for PyTorch's own tools.

    Writes OUTPUT/rank_<R>; read them with
    ``python -m torch.distributed.flight_recorder.fr_trace OUTPUT -p rank_``.
    Exit code 0: every file converted; 1: some files were unusable; 2: nothing converted.
    """
    from frtools.formats.torch_fr_writer import convert_to_torch_pickle

    try:
        result = convert_to_torch_pickle(src, output)
    except OSError as exc:
        click.echo(f"frtools convert: error: {exc.filename or output}: {exc.strerror}", err=True)
        sys.exit(2)
    for line in result.errors:
        click.echo(f"frtools convert: skipped {line}", err=True)
    if not result.written:
        sys.exit(2)
    click.echo(f"wrote {len(result.written)} rank file(s) to {output}")
    sys.exit(1 if result.errors else 0)
