"""The ``frtools`` command. Each subcommand lives in its own module under
``frtools/commands`` and is imported only when invoked, so ``frtools analyze`` never pays
for importing torch and a broken optional part cannot break the others."""

from __future__ import annotations

import importlib
import importlib.util

import click

from frtools import __version__

# name -> (module, attribute, one-line help shown in `frtools --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "analyze": (
        "frtools.commands.analyze",
        "analyze",
        "Find the hung collective and the guilty rank.",
    ),
    "report": (
        "frtools.commands.report",
        "report",
        "Write the verdict and the records around it as one HTML file.",
    ),
    "timeline": (
        "frtools.commands.timeline",
        "timeline",
        "Write every rank's last ops as a Perfetto / chrome://tracing file.",
    ),
    "dump": ("frtools.commands.dump", "dump", "Collect a job's flight records and stacks."),
    "summarize": (
        "frtools.commands.summarize",
        "summarize",
        "Summarize one host's flight records for a fleet analysis.",
    ),
    "run": ("frtools.commands.run", "run", "Run a command with the recorder on."),
    "top": ("frtools.commands.top", "top", "Watch this host's ranks live: op, stall, lag."),
    "metrics": (
        "frtools.commands.metrics",
        "metrics",
        "Serve this host's ranks as Prometheus metrics.",
    ),
    "demo": ("frtools.commands.demo", "demo", "Hang a small local job on purpose and diagnose it."),
    "convert": (
        "frtools.commands.convert",
        "convert",
        "Convert recordings to PyTorch dump format.",
    ),
    "export": ("frtools.commands.export", "export", "Export the aligned entries to Parquet."),
    "history": (
        "frtools.commands.history",
        "history",
        "List recorded incidents; rank hosts and GPUs by how often they were guilty.",
    ),
    "replay": (
        "frtools.commands.replay",
        "replay",
        "Write a script that replays the recorded collectives and hangs the same way.",
    ),
    "synth": (
        "frtools.commands.synth",
        "synth",
        "Simulate a large job's dumps with a known fault.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [
            name for name, (module, _, _) in COMMANDS.items() if importlib.util.find_spec(module)
        ]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        if importlib.util.find_spec(module) is None:
            return None
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="frtools")
def main() -> None:
    """frtools: the flight recorder and crash investigator for distributed PyTorch."""


if __name__ == "__main__":
    main()
