"""``frtools run [--dir D] [--stall-seconds S] -- CMD ARGS...``: CMD with the recorder on.

Every Python process CMD starts (torchrun and its workers, ``python train.py``, ...) finds
``frtools/recorder/_bootstrap`` first on ``PYTHONPATH``; its ``sitecustomize`` (which also runs
any ``sitecustomize`` it shadows) enables recording when ``FRTOOLS_RECORD=1`` and
``torch.distributed`` is imported. ``frtools run`` then *becomes* CMD (exec), so signals
reach CMD directly and the exit code is CMD's.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import click

from frtools.config import DEFAULT_DIR, DIR, JOB_ID, JOB_SECRET, RECORD, STALL_SECONDS

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent.parent / "recorder" / "_bootstrap")


def recording_env(
    base: dict[str, str] | None = None,
    dir: str | None = None,
    stall_seconds: float | None = None,
    job_id: str | None = None,
) -> dict[str, str]:
    """The environment under which every Python process of a command records."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts])
    env[RECORD.name] = "1"
    if dir is not None:
        env[DIR.name] = os.path.abspath(dir)
    if stall_seconds is not None:
        env[STALL_SECONDS.name] = repr(float(stall_seconds))
    if job_id is not None:
        env[JOB_ID.name] = job_id
    return env


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a command with the recorder on.",
)
@click.option(
    "--dir",
    "dir_",
    type=click.Path(file_okay=False),
    default=None,
    help=f"Where the black-box files go (FRTOOLS_DIR; default {DEFAULT_DIR}, this user's own).",
)
@click.option(
    "--stall-seconds",
    type=click.FloatRange(min=0),
    default=None,
    help="Mark a rank stalled when an op is unfinished this long (0: off; default 60).",
)
@click.option("--job-id", default=None, help="Folder name for this job's files (FRTOOLS_JOB_ID).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(
    dir_: str | None, stall_seconds: float | None, job_id: str | None, command: tuple[str, ...]
) -> None:
    """Run COMMAND (e.g. ``torchrun ... train.py``) so that every rank records its c10d ops.

    Files: DIR/<job id>/rank_<R>.frt and rank_<R>.stacks; the job id is FRTOOLS_JOB_ID, else
    TORCHELASTIC_RUN_ID, SLURM_JOB_ID, or <MASTER_ADDR>-<MASTER_PORT>. Exits with COMMAND's
    exit code. Unless FRTOOLS_JOB_SECRET is set, a new one is made for the job (recovery
    seals its store keys with it). Each rank's file opens as it imports torch.distributed (its
    RANK/WORLD_SIZE from the launcher), before any group, and records its start-up phases: a
    rank that never reaches init_process_group is named.
    """
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise click.UsageError("no command given: frtools run [OPTIONS] -- CMD [ARGS]...")
    env = recording_env(dir=dir_, stall_seconds=stall_seconds, job_id=job_id)
    if not JOB_SECRET.is_set(env):  # one per job: every rank inherits it, no one else knows it
        env[JOB_SECRET.name] = secrets.token_hex(32)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        click.echo(f"frtools run: cannot run {argv[0]!r}: {exc.strerror or exc}", err=True)
        sys.exit(127)
