"""What every command does the same way: one-line errors with exit code 2, internal errors
without a traceback (``FRTOOLS_DEBUG=1`` shows it), a reader that left the pipe, writing the
report to ``-o FILE`` or stdout, and the options several commands take (one definition, one
help text: ``reading_options``, ``workers_option``, ``file_command``)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from frtools.analyze import memory
from frtools.config import DEBUG, ConfigError

USAGE_ERROR = 2


def fail(prefix: str, message: str) -> NoReturn:
    """``<prefix>: <message>`` on stderr, exit 2; one line, whatever a dump put in it."""
    from frtools.analyze.reporters import escape

    click.echo(f"{prefix}: {escape.line(message)}", err=True)
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
    except ConfigError as e:  # an FRTOOLS_* value that cannot be used: a usage error
        fail(prefix, f"error: {e}")
    except Exception as e:  # noqa: BLE001 - the user gets one line, never a traceback
        if DEBUG.read():
            traceback.print_exc()
        fail(prefix, f"internal error: {type(e).__name__}: {first_line(e)}")
    sys.exit(code)


def guarded(prefix: str) -> Callable[[Callable[..., int]], Callable[..., NoReturn]]:
    """A command's body, which returns its exit code, run under ``run_guarded``: one
    signature per command (click passes the options to the body itself)."""

    def wrap(body: Callable[..., int]) -> Callable[..., NoReturn]:
        @functools.wraps(body)
        def command(*args: Any, **kwargs: Any) -> NoReturn:
            run_guarded(prefix, lambda: body(*args, **kwargs))

        return command

    return wrap


# ----- options several commands take: one definition, one help text ------------------------

path_argument = click.argument("path", type=click.Path(path_type=Path))

workers_option = click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes reading dump files (default: automatic).",
)

world_size_option = click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="The job's number of ranks, when the dumps cannot say it (Gloo): a rank that left "
    "no dump is then seen even if it is the highest.",
)


def reading_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--workers`` and ``--world-size``: how a command that diagnoses reads the dumps."""
    return workers_option(world_size_option(command))


def recorder_dir_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--dir D``: the recorder folder a command reads the live boxes from (``root``)."""
    from frtools.config import DEFAULT_DIR

    return click.option(
        "--dir",
        "root",
        type=click.Path(file_okay=False),
        help=f"Where the recorder writes (default: $FRTOOLS_DIR or {DEFAULT_DIR}).",
    )(command)


def store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--store HOST:PORT`` and ``--prefix P``: the job's TCPStore and its key prefix."""
    from frtools.config import DEFAULT_STORE_PREFIX

    store = click.option(
        "--store",
        "store_addr",
        metavar="HOST:PORT",
        help="The job's TCPStore (MASTER_ADDR:MASTER_PORT under torchrun).",
    )
    prefix = click.option(
        "--prefix",
        default=None,
        help="Key prefix in the store (default: $FRTOOLS_STORE_PREFIX or "
        f"{DEFAULT_STORE_PREFIX!r}).",
    )
    return store(prefix(command))


def file_command(name: str, default_output: str, what: str) -> Callable[[Callable[..., Any]], Any]:
    """A command that reads the dumps under PATH and writes one file: ``frtools NAME PATH
    [-o FILE]`` (``-`` for stdout), its usage errors one line."""
    output = click.option(
        "-o",
        "--output",
        default=default_output,
        show_default=True,
        help=f"Where to write the {what}; '-' for stdout.",
    )

    def make(body: Callable[..., Any]) -> Any:
        return click.command(name, cls=OneLineCommand)(path_argument(output(body)))

    return make


def exit_at_once(code: int) -> None:
    """End a command's own process now, its output flushed, without freeing what it read
    one object at a time (~0.5 s at 131,072 ranks). Inside another program: returns."""
    if not memory.exits_at_once():
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left: not an error (as in run_guarded)
        code = 0
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


def write_text(prefix: str, text: str, output: Path | None, **echo: Any) -> None:
    """The report on stdout, or in ``output`` (a failure to write is a one-line error)."""
    if output is None:
        click.echo(text, nl=not text.endswith("\n"), **echo)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(prefix, f"error: cannot write {output}: {e.strerror or e}")


# A load is worth a progress bar when it likely takes more than about a second: reading
# runs at very roughly 100 files or 50 MB a second on a loaded 2-core machine.
SLOW_LOAD_FILES = 100
SLOW_LOAD_BYTES = 48 << 20


def load_looks_slow(path: Path) -> bool:
    """True when the dumps under ``path`` are many or large enough to take a second."""
    try:
        if path.is_file():
            return path.stat().st_size >= SLOW_LOAD_BYTES
        files = size = 0
        for root, _dirs, names in os.walk(path):
            for name in names:
                files += 1
                with contextlib.suppress(OSError):
                    size += os.stat(os.path.join(root, name)).st_size
                if files >= SLOW_LOAD_FILES or size >= SLOW_LOAD_BYTES:
                    return True
    except OSError:
        return False
    return False


def progress_wanted(path: Path, human: bool) -> bool:
    """A progress bar on stderr: only for a person watching a terminal (never in a
    machine-read format, nor when stderr is a file or a pipe), and only for a slow load."""
    return human and sys.stderr.isatty() and load_looks_slow(path)


@contextlib.contextmanager
def phase(text: str, enabled: bool) -> Iterator[None]:
    """A spinner with ``text`` on stderr while a slow step runs (when ``enabled``)."""
    if not enabled:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


def load_and_diagnose(
    prefix: str,
    path: Path,
    *,
    workers: int | None = None,
    world_size: int | None = None,
    progress: bool = False,
) -> tuple[Any, Any, Any]:
    """Read the dumps under ``path``, align them once and diagnose: ``(trace, alignment,
    verdict)``. Unusable input is a one-line error, exit 2."""
    from frtools.analyze.readers import UnusableInput, load_trace

    def import_diagnosis() -> None:  # pandas & co: 0.5 s, while the readers work
        import frtools.analyze.diagnose  # noqa: F401

    memory.keep_freed_memory()
    # what was read is frozen before the collector is on again: re-enabled first, it would
    # scan every object read (131,072 ranks' records: 0.3 s) at the next allocation
    with memory.no_cyclic_gc():
        try:
            trace = load_trace(
                path,
                workers=workers,
                progress=progress,
                world_size=world_size,
                meanwhile=import_diagnosis,
            )
        except UnusableInput as e:
            fail(prefix, f"error: {first_line(e, 'unusable input')}")
        memory.spare_the_collector()
    from frtools.analyze.diagnose import align_and_diagnose

    with phase("aligning and diagnosing", progress), memory.no_cyclic_gc():
        alignment, verdict = align_and_diagnose(trace)
    return trace, alignment, verdict


@contextlib.contextmanager
def diagnosed(
    prefix: str, path: Path, *, workers: int | None, world_size: int | None, writing: str
) -> Iterator[tuple[Any, Any, Any]]:
    """``(trace, alignment, verdict)`` of the dumps under ``path`` for a command that writes
    a file of them; a spinner says ``writing`` meanwhile (a person, a slow load)."""
    progress = progress_wanted(path, human=True)
    diagnosis = load_and_diagnose(
        prefix, path, workers=workers, world_size=world_size, progress=progress
    )
    with phase(writing, progress):
        yield diagnosis


def say_written(output: str, size: str, verdict: Any) -> None:
    """The one line on stderr after a file is written: where, how large, the verdict."""
    from frtools.analyze.reporters import escape

    click.echo(
        escape.line(f"{output} ({size}): {verdict.kind.upper()} {verdict.headline}"), err=True
    )
