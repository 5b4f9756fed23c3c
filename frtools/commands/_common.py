"""What every command does the same way: one-line errors with exit code 2, internal errors
without a traceback (``FRTOOLS_DEBUG=1`` shows it), a reader that left the pipe, writing the
report to ``-o FILE`` or stdout."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

USAGE_ERROR = 2


def fail(prefix: str, message: str) -> NoReturn:
    """``<prefix>: <message>`` on stderr, exit 2."""
    click.echo(f"{prefix}: {message}", err=True)
    sys.exit(USAGE_ERROR)


def first_line(error: BaseException, default: str = "") -> str:
    text = str(error)
    return text.splitlines()[0] if text else default


class OneLineCommand(click.Command):
    """A command whose usage errors are one line (``frtools NAME: error: …``), exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            fail(f"frtools {self.name}", f"error: {e.format_message()}")


def run_guarded(prefix: str, body: Callable[[], int]) -> NoReturn:
    """Run a command's body and exit with its code; any error becomes one line on stderr."""
    try:
        code = body()
    except SystemExit:
        raise
    except BrokenPipeError:  # `frtools analyze DIR | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        fail(prefix, "interrupted")
    except Exception as e:  # noqa: BLE001 - the user gets one line, never a traceback
        if os.environ.get("FRTOOLS_DEBUG") == "1":
            traceback.print_exc()
        fail(prefix, f"internal error: {type(e).__name__}: {first_line(e)}")
    sys.exit(code)


def write_text(prefix: str, text: str, output: Path | None, **echo: Any) -> None:
    """The report on stdout, or in ``output`` (a failure to write is a one-line error)."""
    if output is None:
        click.echo(text, nl=not text.endswith("\n"), **echo)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(prefix, f"error: cannot write {output}: {e.strerror or e}")
