"""Every ``FRTOOLS_*`` environment variable the recorder reads, in one place.

=========================  ==================  ==============================================
variable                   default             meaning
=========================  ==================  ==============================================
``FRTOOLS_RECORD``         unset               ``1``: every Python process that has
                                               ``frtools/recorder/_bootstrap`` on its path
                                               (``frtools run`` puts it there) records.
``FRTOOLS_DIR``            ``/dev/shm/frtools``  where black-box files go:
                                               ``<dir>/<job_id>/rank_<R>.frt`` (+ ``.stacks``)
``FRTOOLS_JOB_ID``         see ``job_id()``    names the job's folder; else
                                               ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``,
                                               ``<MASTER_ADDR>-<MASTER_PORT>``
``FRTOOLS_BUFFER_SIZE``    ``2000``            ring slots per rank (newest kept), as
                                               PyTorch's ``TORCH_FR_BUFFER_SIZE``
``FRTOOLS_STALL_SECONDS``  ``60``              the watchdog marks the file ``stalled`` when
                                               the oldest unfinished op is older; ``0`` off.
                                               Well under PyTorch's 10-30 min timeouts, so a
                                               hang is flagged long before the job dies.
``FRTOOLS_STACK_SIGNAL``   ``SIGUSR2``         signal (name or number) on which
                                               ``faulthandler`` appends every thread's Python
                                               stack to ``rank_<R>.stacks``
``FRTOOLS_POLL_MS``        ``50``              how often the native watchdog polls CUDA events,
                                               beats the heartbeat and serves dump requests
                                               (and Python checks CPU ops for completion)
``FRTOOLS_STACKS``         ``1``               ``0``: record no Python call stacks (saves
                                               about half the per-op cost; no call sites)
=========================  ==================  ==============================================

Reading is pure and cheap: no torch, no files touched.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_DIR = "/dev/shm/frtools"
DEFAULT_BUFFER_SIZE = 2000
DEFAULT_STALL_SECONDS = 60.0
DEFAULT_STACK_SIGNAL = "SIGUSR2"
DEFAULT_POLL_MS = 50
STRINGS_BYTES = 4 << 20

ENV_VARS = (
    "FRTOOLS_RECORD",
    "FRTOOLS_DIR",
    "FRTOOLS_JOB_ID",
    "FRTOOLS_BUFFER_SIZE",
    "FRTOOLS_STALL_SECONDS",
    "FRTOOLS_STACK_SIGNAL",
    "FRTOOLS_POLL_MS",
    "FRTOOLS_STACKS",
)


class ConfigError(ValueError):
    """An ``FRTOOLS_*`` value that cannot be used; the message names the variable."""


@dataclass(frozen=True)
class RecorderConfig:
    record: bool
    dir: str
    job_id: str
    buffer_size: int
    stall_seconds: float
    stack_signal: int
    poll_ms: int
    stacks: bool = True

    def rank_path(self, rank: int, suffix: str = ".frt") -> str:
        return os.path.join(self.dir, self.job_id, f"rank_{rank}{suffix}")


def _sanitize(job_id: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", job_id).strip(".")
    return cleaned or "job"


def job_id(env: Mapping[str, str] | None = None) -> str:
    """The job's id, the same on every rank of one job (the folder name of its files)."""
    env = os.environ if env is None else env
    for name in ("FRTOOLS_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = env.get(name, "").strip()
        if value and value.lower() != "none":  # torchrun's default run id is "none"
            return _sanitize(value)
    addr = env.get("MASTER_ADDR", "").strip()
    port = env.get("MASTER_PORT", "").strip()
    if addr or port:
        return _sanitize(f"{addr or 'localhost'}-{port or '0'}")
    return "local"


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def parse_signal(value: str) -> int:
    value = value.strip()
    if value.isdigit():
        return int(value)
    name = value.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        raise ConfigError(f"FRTOOLS_STACK_SIGNAL={value!r} is not a signal name or number")
    return int(sig)


def _number(env: Mapping[str, str], name: str, default: float, kind: type) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must not be negative")
    return value


def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> RecorderConfig:
    """The recorder's settings from the environment; keyword overrides win (``enable(...)``)."""
    env = os.environ if env is None else env
    values: dict[str, object] = {
        "record": truthy(env.get("FRTOOLS_RECORD")),
        "dir": env.get("FRTOOLS_DIR", "").strip() or DEFAULT_DIR,
        "job_id": job_id(env),
        "buffer_size": int(_number(env, "FRTOOLS_BUFFER_SIZE", DEFAULT_BUFFER_SIZE, int)),
        "stall_seconds": float(_number(env, "FRTOOLS_STALL_SECONDS", DEFAULT_STALL_SECONDS, float)),
        "stack_signal": parse_signal(env.get("FRTOOLS_STACK_SIGNAL", "") or DEFAULT_STACK_SIGNAL),
        "poll_ms": int(_number(env, "FRTOOLS_POLL_MS", DEFAULT_POLL_MS, int)),
        "stacks": env.get("FRTOOLS_STACKS", "1").strip().lower() not in ("0", "false", "no", "off"),
    }
    for key, value in overrides.items():
        if value is not None:
            values[key] = _sanitize(str(value)) if key == "job_id" else value
    if int(values["buffer_size"]) < 1:  # type: ignore[call-overload]
        raise ConfigError("FRTOOLS_BUFFER_SIZE must be at least 1")
    return RecorderConfig(**values)  # type: ignore[arg-type]
