"""Every ``FRTOOLS_*`` environment variable: its name, default, meaning and parser.

The base layer: it imports nothing from frtools and only cheap parts of the standard library,
so every part reads its settings through here — the recorder inside a training process, the
bootstrap ``sitecustomize`` of every Python process ``frtools run`` starts, the collector,
the analyzer. README.md's environment table lists the same variables; a test checks that
every ``FRTOOLS_*`` name in frtools' source is declared here and listed there.

A variable that is unset or blank means its default. ``Setting.read()`` parses the current
value; a value that cannot be used raises ``ConfigError`` naming the variable.
"""

from __future__ import annotations

import os
import re
import signal
from collections import namedtuple
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

T = TypeVar("T")

DEFAULT_STORE_PREFIX = "frtools/"


def default_dir(uid: int | None = None) -> str:
    """The recorder's folder when ``FRTOOLS_DIR`` is unset: one per user, ``/dev/shm/frtools-<uid>``
    (``$TMPDIR`` or ``/tmp`` where there is no ``/dev/shm``). /dev/shm is shared by every
    user of a host: each user's jobs get a folder of their own (0700), so that neither can
    plant files in the other's nor read its records. ``frtools dump`` run by the same user
    finds them there."""
    if uid is None:
        getuid = getattr(os, "getuid", None)
        uid = getuid() if getuid is not None else 0
    base = "/dev/shm" if os.path.isdir("/dev/shm") else (os.environ.get("TMPDIR") or "/tmp")
    return os.path.join(base, f"frtools-{uid}")


DEFAULT_DIR = default_dir()  # this process's user's; README shows it as /dev/shm/frtools-<uid>


class ConfigError(ValueError):
    """An ``FRTOOLS_*`` value that cannot be used; the message names the variable."""


class Setting(Generic[T]):
    """One environment variable. (A plain class: the bootstrap imports this module in every
    Python process of a recorded job, and ``dataclasses`` would triple its import time.)"""

    __slots__ = ("name", "default", "shown_default", "meaning", "parse")

    def __init__(
        self, name: str, default: T, shown_default: str, meaning: str, parse: Callable[[str], T]
    ) -> None:
        self.name = name
        self.default = default  # the value when the variable is unset or blank
        self.shown_default = shown_default  # the default as README's table shows it
        self.meaning = meaning
        self.parse = parse  # the stripped text -> value; ValueError: unusable

    def __repr__(self) -> str:
        return f"Setting({self.name})"

    def read(self, env: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={raw!r} {exc}") from None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return bool((os.environ if env is None else env).get(self.name, "").strip())


# -- parsers -------------------------------------------------------------------------------


def flag_on(text: str) -> bool:
    """On only when said so: ``1``, ``true``, ``yes``, ``on``."""
    return text.strip().lower() in ("1", "true", "yes", "on")


def flag_off(text: str) -> bool:
    """On unless turned off: ``0``, ``false``, ``no``, ``off``."""
    return text.strip().lower() not in ("0", "false", "no", "off")


def _text(text: str) -> str:
    return text


def _non_negative(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"is not a {kind.__name__}") from None
        if value < 0:
            raise ValueError("must not be negative")
        return value

    return parse


def parse_group(text: str) -> int:
    """A group of this host, by name or number -> its gid."""
    import grp

    text = text.strip()
    try:
        return grp.getgrnam(text).gr_gid if not text.isdigit() else grp.getgrgid(int(text)).gr_gid
    except (KeyError, OverflowError):
        raise ValueError("is not a group on this host") from None


def parse_signal(text: str) -> int:
    """A signal name (``SIGUSR2``, ``usr2``) or number."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError("is not a signal name or number")
    return int(sig)


_SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_limits(text: str) -> dict[str, int]:
    """``dump_bytes=1G, parsed_bytes=4G`` -> ``{"dump_bytes": 1 << 30, ...}``: names of
    ``frtools.formats.limits.Limits`` (checked there), positive integers with an optional
    K/M/G/T suffix (powers of 1024; ``KiB``, ``MB`` … read the same)."""
    out: dict[str, int] = {}
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        name, sep, value = part.partition("=")
        m = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", value.strip().lower())
        if not sep or not name.strip() or m is None:
            raise ValueError(f"is not name=value[,name=value...] (at {part!r})")
        number = int(m.group(1)) * _SIZE_SUFFIXES[m.group(2)]
        if number < 1:
            raise ValueError(f"sets {name.strip()} to {number}: a limit is a positive integer")
        out[name.strip()] = number
    return out


# -- the variables -------------------------------------------------------------------------

RECORD: Setting[bool] = Setting(
    "FRTOOLS_RECORD",
    False,
    "unset",
    "`1`: every Python process with frtools' bootstrap on its path records "
    "(`frtools run` sets both)",
    flag_on,
)
DIR: Setting[str] = Setting(
    "FRTOOLS_DIR",
    DEFAULT_DIR,
    "`/dev/shm/frtools-<uid>`",
    "where black boxes go: `<dir>/<job>/rank_<R>.frt` and `rank_<R>.stacks`; the default is "
    "per user (created 0700). A folder you name may be shared (like `/tmp`), but the job "
    "folder inside must be yours, not a link, not writable by others: else recording is off",
    _text,
)
JOB_ID: Setting[str | None] = Setting(
    "FRTOOLS_JOB_ID",
    None,
    "`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID` or `<MASTER_ADDR>-<MASTER_PORT>`",
    "the job's folder name (see `job_id()`)",
    _text,
)
BUFFER_SIZE: Setting[int] = Setting(
    "FRTOOLS_BUFFER_SIZE",
    2000,
    "`2000`",
    "ring slots per rank (newest kept), like `TORCH_FR_BUFFER_SIZE`",
    _non_negative(int),
)
STALL_SECONDS: Setting[float] = Setting(
    "FRTOOLS_STALL_SECONDS",
    60.0,
    "`60`",
    "the watchdog flags a stall when the oldest unfinished op is older; `0` turns it off. "
    "Well under PyTorch's 10-30 min timeouts, so a hang is flagged long before the job dies",
    _non_negative(float),
)
STACK_SIGNAL: Setting[int] = Setting(
    "FRTOOLS_STACK_SIGNAL",
    int(signal.SIGUSR2),
    "`SIGUSR2`",
    "signal on which faulthandler appends every thread's stack to `rank_<R>.stacks`",
    parse_signal,
)
STACKS: Setting[bool] = Setting(
    "FRTOOLS_STACKS",
    True,
    "`1`",
    "`0`: record no Python call site per op (about half the per-op cost)",
    flag_off,
)
POLL_MS: Setting[int] = Setting(
    "FRTOOLS_POLL_MS",
    50,
    "`50`",
    "how often the native watchdog polls CUDA events, beats and serves dump requests "
    "(and Python checks CPU ops for completion)",
    _non_negative(int),
)
DUMP_DIR: Setting[str | None] = Setting(
    "FRTOOLS_DUMP_DIR",
    None,
    "`<FRTOOLS_DIR>/<job>/dumps`",
    "where every rank writes its snapshot and stacks on a stall or a job-wide request (never "
    "where a request says); must be the user's own folder. Across hosts: the same folder on "
    "a shared file system, for every rank and for `frtools dump --job-wide`",
    _text,
)
DUMP_INTERVAL: Setting[float] = Setting(
    "FRTOOLS_DUMP_INTERVAL",
    5.0,
    "`5`",
    "a rank writes at most one snapshot per this many seconds for job-wide requests and stall "
    "hand-offs (one copy per rank, replaced); a request in between is answered with the last "
    "copy. `0`: no limit",
    _non_negative(float),
)
SHARE_GROUP: Setting[int | None] = Setting(
    "FRTOOLS_SHARE_GROUP",
    None,
    "unset",
    "a group (name or gid) whose members may read the records: folders 0750 and files 0640 "
    "with that group, for a collector running as another user (ops, root needs none). Unset: "
    "folders 0700, files 0600",
    parse_group,
)
JOBWIDE: Setting[bool] = Setting(
    "FRTOOLS_JOBWIDE",
    True,
    "`1`",
    "`0` turns off the in-process watcher for job-wide dump requests",
    flag_off,
)
JOBWIDE_POLL: Setting[float] = Setting(
    "FRTOOLS_JOBWIDE_POLL",
    0.5,
    "`0.5`",
    "seconds between the watcher's looks at the store",
    _non_negative(float),
)
PROGRESS_INTERVAL: Setting[float] = Setting(
    "FRTOOLS_PROGRESS_INTERVAL",
    5.0,
    "`5`",
    "seconds between two of a rank's progress beacons in the job's store (the op it is in, "
    "its groups' frontiers: `frtools top --job-wide` on any host); `0`: none",
    _non_negative(float),
)
STORE_PREFIX: Setting[str] = Setting(
    "FRTOOLS_STORE_PREFIX",
    DEFAULT_STORE_PREFIX,
    f"`{DEFAULT_STORE_PREFIX}`",
    "key prefix of job-wide requests in the job's TCPStore",
    _text,
)
CUDART: Setting[str | None] = Setting(
    "FRTOOLS_CUDART",
    None,
    "torch's loaded copy",
    "path to libcudart, used only when no loaded copy is found (read by the native core, "
    "`getenv` in `recorder/_native/blackbox.cpp`)",
    _text,
)
DEBUG: Setting[bool] = Setting(
    "FRTOOLS_DEBUG",
    False,
    "unset",
    "`1`: show the traceback of an internal error",
    flag_on,
)
NATIVE_PICKLE: Setting[bool] = Setting(
    "FRTOOLS_NATIVE_PICKLE",
    True,
    "`1`",
    "`0`: read PyTorch pickles with the pure-Python restricted unpickler instead of the "
    "native parser (same results, ~10x slower; for debugging)",
    flag_off,
)
LIMITS: Setting[dict[str, int]] = Setting(
    "FRTOOLS_LIMITS",
    {},
    "unset",
    "raise (or lower) what one input file may cost when `frtools analyze` or `frtools dump` "
    "reads it: `name=value,...` of the limits in docs/security.md (e.g. "
    "`dump_bytes=1G,parsed_bytes=4G`; K/M/G/T are powers of 1024)",
    parse_limits,
)
HISTORY: Setting[str | None] = Setting(
    "FRTOOLS_HISTORY",
    None,
    "unset",
    "an incident catalog (SQLite file): every `frtools analyze` records its verdict there, "
    "and `frtools history` reads it when given no path (as `--history PATH`)",
    _text,
)

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}  # seconds


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``2w``, ``90s`` or plain seconds -> seconds (positive)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", text.strip().lower())
    if m is None:
        raise ValueError("is not a duration (7d, 12h, 30m, 2w, or seconds)")
    seconds = float(m.group(1)) * DURATION_UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise ValueError("must be longer than 0")
    return seconds


def _at_least_one(text: str) -> int:
    value = _non_negative(int)(text)
    if value < 1:
        raise ValueError("must be 1 or more")
    return value


def _fraction(text: str) -> float:
    value = _non_negative(float)(text)
    if value > 1:
        raise ValueError("must be between 0 and 1")
    return value


DRAIN_INCIDENTS: Setting[int] = Setting(
    "FRTOOLS_DRAIN_INCIDENTS",
    2,
    "`2`",
    "a host guilty in this many incidents of the catalog's window (`FRTOOLS_DRAIN_WINDOW`) is a "
    "repeat offender: a verdict that would restart or investigate asks to drain it, and "
    "`frtools history` lists it to drain (its `--min-incidents` default); docs/actions.md",
    _at_least_one,
)
DRAIN_WINDOW: Setting[float] = Setting(
    "FRTOOLS_DRAIN_WINDOW",
    7 * 86400.0,
    "`7d`",
    "how far back `frtools analyze --history` counts a guilty host's incidents (7d, 12h, 2w, "
    "or seconds)",
    parse_duration,
)
ACTION_MIN_CONFIDENCE: Setting[float] = Setting(
    "FRTOOLS_ACTION_MIN_CONFIDENCE",
    0.7,
    "`0.7`",
    "a dead or stuck rank without device evidence is `restart` at this verdict confidence or "
    "more, `investigate` below it (docs/actions.md)",
    _fraction,
)

CAPTURE_MODES = ("hooks", "wrap")


def parse_capture(text: str) -> str:
    mode = text.strip().lower()
    if mode not in CAPTURE_MODES:
        raise ValueError(f"is not one of {', '.join(CAPTURE_MODES)}")
    return mode


CAPTURE: Setting[str | None] = Setting(
    "FRTOOLS_CAPTURE",
    None,
    "`hooks` where torch has process-group hooks (2.15+), else `wrap`",
    "how ops are seen: `hooks` (pre/post hooks on every group, the backend untouched) or "
    "`wrap` (groups built through frtools' backend plugin, the path for older torch)",
    parse_capture,
)

NATIVE_HOOKS_MODES = {"auto": "auto", "1": "on", "true": "on", "yes": "on", "on": "on"}
NATIVE_HOOKS_MODES.update({"0": "off", "false": "off", "no": "off", "off": "off"})


def parse_native_hooks(text: str) -> str:
    mode = NATIVE_HOOKS_MODES.get(text.strip().lower())
    if mode is None:
        raise ValueError("is not one of auto, 1, 0")
    return mode


NATIVE_HOOKS: Setting[str] = Setting(
    "FRTOOLS_NATIVE_HOOKS",
    "auto",
    "`auto`",
    "the hooks path's per-op body in C++ (torch >= 2.15; no GIL per op): `auto` uses it when "
    "built (`python -m frtools.recorder.native_hooks build`), `1` also builds it at the first "
    "group (~1 min, once per machine and torch), `0` keeps the Python hooks",
    parse_native_hooks,
)

JOB_SECRET: Setting[str | None] = Setting(
    "FRTOOLS_JOB_SECRET",
    None,
    "unset (`frtools run` makes one per job)",
    "a secret every rank of the job shares: each recovery key in the store is authenticated "
    "with it (HMAC-SHA256) and unauthenticated ones are ignored with a warning. Unset: "
    "recovery checks decisions against the evidence only (docs/security.md#recovery)",
    _text,
)

CACHE_DIR: Setting[str | None] = Setting(
    "FRTOOLS_CACHE_DIR",
    None,
    "`$XDG_CACHE_HOME/frtools`, else `~/.cache/frtools`",
    "where the C++ hook body is built (one private 0700 folder per torch and source)",
    _text,
)

DEVICE_FACTS: Setting[bool] = Setting(
    "FRTOOLS_DEVICE_FACTS",
    True,
    "`1`",
    "`0`: `frtools dump` and the stall hand-off collect no device facts (nvidia-smi/NVML, "
    "Xid lines of the kernel log, InfiniBand ports, ncclras; docs/device-evidence.md)",
    flag_off,
)
KMSG: Setting[str] = Setting(
    "FRTOOLS_KMSG",
    "/dev/kmsg",
    "`/dev/kmsg`",
    "the kernel log device facts read Xid/SXid lines from (`/dev/kmsg`, else `dmesg`); a "
    "regular file (a saved `dmesg` or journal) is read as such",
    _text,
)
INFINIBAND_SYSFS: Setting[str] = Setting(
    "FRTOOLS_INFINIBAND_SYSFS",
    "/sys/class/infiniband",
    "`/sys/class/infiniband`",
    "where device facts read InfiniBand/RoCE port state and error counters "
    "(`<dev>/ports/<n>/state`, `counters/link_downed`, ...)",
    _text,
)

SETTINGS: tuple[Setting[Any], ...] = (
    RECORD,
    DIR,
    JOB_ID,
    BUFFER_SIZE,
    STALL_SECONDS,
    STACK_SIGNAL,
    STACKS,
    POLL_MS,
    DUMP_DIR,
    DUMP_INTERVAL,
    SHARE_GROUP,
    JOBWIDE,
    JOBWIDE_POLL,
    PROGRESS_INTERVAL,
    STORE_PREFIX,
    CUDART,
    DEBUG,
    NATIVE_PICKLE,
    LIMITS,
    HISTORY,
    DRAIN_INCIDENTS,
    DRAIN_WINDOW,
    ACTION_MIN_CONFIDENCE,
    CAPTURE,
    NATIVE_HOOKS,
    CACHE_DIR,
    JOB_SECRET,
    DEVICE_FACTS,
    KMSG,
    INFINIBAND_SYSFS,
)
ENV_VARS = tuple(s.name for s in SETTINGS)


# -- derived values ------------------------------------------------------------------------


def _sanitize(job_id: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", job_id).strip(".")
    return cleaned or "job"


def job_folder_name(job_id: str) -> str:
    """A job id as the one folder name it gets (no ``/``, no leading dot)."""
    return _sanitize(job_id)


def job_id(env: Mapping[str, str] | None = None) -> str:
    """The job's id, the same on every rank of one job (the folder name of its files):
    ``FRTOOLS_JOB_ID``, else ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``,
    ``<MASTER_ADDR>-<MASTER_PORT>``, else ``local``."""
    env = os.environ if env is None else env
    for name in (JOB_ID.name, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = env.get(name, "").strip()
        if value and value.lower() != "none":  # torchrun's default run id is "none"
            return _sanitize(value)
    addr = env.get("MASTER_ADDR", "").strip()
    port = env.get("MASTER_PORT", "").strip()
    if addr or port:
        return _sanitize(f"{addr or 'localhost'}-{port or '0'}")
    return "local"


class RecorderConfig(
    namedtuple(
        "RecorderConfig",
        "record dir job_id buffer_size stall_seconds stack_signal poll_ms stacks share_gid capture",
        defaults=(True, None, None),
    )
):
    """The recorder's settings, read once by ``frtools.recorder.enable()``."""

    __slots__ = ()
    record: bool
    dir: str
    job_id: str
    buffer_size: int
    stall_seconds: float
    stack_signal: int
    poll_ms: int
    stacks: bool
    share_gid: int | None  # FRTOOLS_SHARE_GROUP's gid: folders 0750, files 0640 with it
    capture: str | None  # "hooks", "wrap", None: hooks where torch has them

    @property
    def job_dir(self) -> str:
        """``<dir>/<job_id>``: this job's rank files on this host."""
        return os.path.join(self.dir, self.job_id)


def recorder_config(env: Mapping[str, str] | None = None, **overrides: object) -> RecorderConfig:
    """The recorder's settings from the environment; keyword overrides win (``enable(...)``)."""
    values: dict[str, object] = {
        "record": RECORD.read(env),
        "dir": DIR.read(env),
        "job_id": job_id(env),
        "buffer_size": BUFFER_SIZE.read(env),
        "stall_seconds": STALL_SECONDS.read(env),
        "stack_signal": STACK_SIGNAL.read(env),
        "poll_ms": POLL_MS.read(env),
        "stacks": STACKS.read(env),
        "share_gid": SHARE_GROUP.read(env),
        "capture": CAPTURE.read(env),
    }
    for key, value in overrides.items():
        if value is not None:
            values[key] = _sanitize(str(value)) if key == "job_id" else value
    if int(values["buffer_size"]) < 1:  # type: ignore[call-overload]
        raise ConfigError(f"{BUFFER_SIZE.name} must be at least 1")
    return RecorderConfig(**values)  # type: ignore[arg-type]
