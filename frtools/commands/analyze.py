"""``frtools analyze PATH``: read dumps, diagnose, report one Verdict.

Exit codes: 0 healthy, 1 a problem found, 2 unusable input or usage error. Every failure is
one line on stderr; ``FRTOOLS_DEBUG=1`` adds the traceback of an internal error.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import click

FORMATS = ("terminal", "json", "markdown")


class OneLineError(click.ClickException):
    """A usage or input error shown as a single line (no usage block)."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"frtools analyze: error: {self.format_message()}", err=True)


class _AnalyzeCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise OneLineError(e.format_message()) from None


def _fail(message: str) -> None:
    click.echo(f"frtools: {message}", err=True)
    sys.exit(2)


@click.command("analyze", cls=_AnalyzeCommand)
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="terminal",
    show_default=True,
    help="Report format.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the report to FILE instead of stdout.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show evidence and per-group detail.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes reading dump files (default: automatic).",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="The job's number of ranks, when the dumps cannot say it (Gloo): a rank that left "
    "no dump is then seen even if it is the highest.",
)
def analyze(
    path: Path,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None,
) -> None:
    """Find the hung collective and the guilty rank in the dumps under PATH.

    Exit code 0: healthy; 1: a problem was found; 2: unusable input or usage error.
    """
    try:
        code = _run(path, fmt, output, verbose, workers, world_size)
    except SystemExit:
        raise
    except BrokenPipeError:  # `frtools analyze DIR | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        _fail("interrupted")
    except Exception as e:  # noqa: BLE001 - the user gets one line, never a traceback
        if os.environ.get("FRTOOLS_DEBUG") == "1":
            traceback.print_exc()
        text = str(e).splitlines()[0] if str(e) else ""
        _fail(f"internal error: {type(e).__name__}: {text}")
        return
    sys.exit(code)


def _run(
    path: Path,
    fmt: str,
    output: Path | None,
    verbose: bool,
    workers: int | None,
    world_size: int | None = None,
) -> int:
    from frtools.analyze.memory import keep_freed_memory
    from frtools.analyze.readers import UnusableInput, load_trace

    def import_diagnosis() -> None:  # pandas & co: 0.5 s, while the readers work
        import frtools.analyze.diagnose  # noqa: F401

    keep_freed_memory()
    try:
        trace = load_trace(
            path,
            workers=workers,
            progress=sys.stderr.isatty() and fmt == "terminal",
            world_size=world_size,
            meanwhile=import_diagnosis,
        )
    except UnusableInput as e:
        _fail(f"error: {str(e).splitlines()[0] if str(e) else 'unusable input'}")
        return 2
    from frtools.analyze.diagnose import diagnose

    verdict = diagnose(trace)

    if fmt == "json":
        from frtools.analyze.reporters import json_report

        text = json_report.render(verdict)
    elif fmt == "markdown":
        from frtools.analyze.reporters import markdown

        text = markdown.render(verdict, verbose=verbose)
    else:
        from frtools.analyze.reporters import terminal

        if output is None:
            from rich.console import Console

            Console(width=min(Console().width, 100) if sys.stdout.isatty() else 100).print(
                terminal.renderable(verdict, verbose)
            )
            return verdict.exit_code
        text = terminal.render(verdict, verbose=verbose)

    if output is None:
        click.echo(text, nl=not text.endswith("\n"))
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as e:
            _fail(f"error: cannot write {output}: {e.strerror or e}")
    return verdict.exit_code
