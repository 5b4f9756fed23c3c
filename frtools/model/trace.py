"""The Trace: the one canonical model every reader produces and every analysis consumes.

A Trace is three tables and a list of inputs:

* ``entries`` — a pyarrow Table, one row per recorded op of any rank (schema ``ENTRY_SCHEMA``).
  Columnar so that thousands of ranks x thousands of entries align without per-entry
  Python objects.
* ``ranks`` — one ``RankInfo`` per global rank that left a usable record: identity (host,
  pid, device), where the record came from, the group status counters, stacks.
* ``process_groups`` — one ``ProcessGroup`` per group name: description and global member
  ranks, flagged ``inferred`` where the dump carried no real membership (Gloo).
* ``inputs`` — one ``InputFile`` per file looked at, with what became of it, so a report can
  say which files were skipped or unusable and why.

Conventions every reader follows:

* ``rank`` is always the *global* rank; P2P ``peer`` is mapped to a global rank too.
* ``op`` is the backend-neutral op name (``all_reduce``, ``send``, ``_allgather_base`` …):
  the ``profiling_name`` with its ``nccl:`` / ``gloo:`` prefix removed. The raw name stays in
  ``profiling_name``.
* Shapes and dtypes are stored as canonical compact strings (``input_sizes="[[4, 2]]"``,
  ``input_dtypes="Float,Float"``) so equality is a string compare on a dictionary column.
* ``state`` is one of ``STATES``. A reader that cannot know better (Gloo dumps say
  ``scheduled`` for everything) keeps what the file says; ``RankInfo.pg_status`` carries
  the group's last enqueued/started/completed sequence ids, which may be more precise.
* ``collective_seq_id`` / ``p2p_seq_id`` keep PyTorch Flight Recorder's meaning: per
  process group, per rank, counting from 1; a value of 0 means "not counted by this
  kind" (a P2P op's collective_seq_id, a collective's p2p_seq_id).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from frtools.model.devices import HostDevices

STATES = ("scheduled", "started", "completed")

# How a rank's process ended (RankInfo.exit_kind), as its recorder saw it:
# "running"   alive when collected;
# "clean"     the interpreter finished normally (exit status 0);
# "exit"      sys.exit / a non-zero exit status, without an uncaught exception;
# "exception" an uncaught exception (exit_detail: "TypeName: message");
# "os_exit"   os._exit (exit_detail: the status) — seen where a recorder hooks it;
# "signal"    a fatal signal it could see (SIGSEGV, SIGABRT …; exit_detail: the name);
# "killed"    gone without a word: the box was never closed and the pid is gone (SIGKILL,
#             the OOM killer, a node lost).
EXIT_KINDS = ("running", "clean", "exit", "exception", "os_exit", "signal", "killed")
# Endings that are a failure of the rank itself, not of the job around it.
ABNORMAL_EXITS = ("exit", "exception", "os_exit", "signal", "killed")
# How far a process got in its start-up (frtools records from process start,
# docs/snapshot-format.md "Start-up phases"), in order: running, no init_process_group yet;
# inside it; in rendezvous (the store); the backend connecting to its peers; returned.
STARTUP_PHASES = ("started", "init", "rendezvous", "connect", "ready")

# Every string column is dictionary-encoded: a job repeats a few dozen group names, ops,
# shapes and stacks millions of times. As plain strings the entries cost ~360 bytes each
# (16,384 ranks x 2,000 entries would be 12 GB; stacks alone ~1 KB each); as dictionaries
# the repeated text is stored once per file and each entry holds int32 codes.
_DICT = pa.dictionary(pa.int32(), pa.string())

ENTRY_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("record_id", pa.int64()),
        pa.field("pg_name", _DICT),
        pa.field("pg_desc", _DICT),
        pa.field("collective_seq_id", pa.int64()),
        pa.field("p2p_seq_id", pa.int64()),
        pa.field("is_p2p", pa.bool_()),
        pa.field("op", _DICT),
        pa.field("profiling_name", _DICT),
        pa.field("peer", pa.int32()),
        pa.field("input_sizes", _DICT),
        pa.field("output_sizes", _DICT),
        pa.field("input_dtypes", _DICT),
        pa.field("output_dtypes", _DICT),
        pa.field("state", _DICT),
        pa.field("time_created_ns", pa.int64()),
        pa.field("time_started_ns", pa.int64()),
        pa.field("time_completed_ns", pa.int64()),
        pa.field("duration_ms", pa.float64()),
        pa.field("retired", pa.bool_()),
        pa.field("timeout_ms", pa.int64()),
        pa.field("thread_id", _DICT),
        pa.field("thread_name", _DICT),
        pa.field("call_site", _DICT),
        pa.field("stack", _DICT),
        # how the op failed (a peer closed the connection, a timeout), as the backend said;
        # null when it did not fail or the recorder cannot tell (PyTorch's FR has no field)
        pa.field("error", _DICT),
        # all_to_all only: elements this rank sends to (input) / receives from (output) each
        # member, in group-rank order; null where not recorded (other ops, older dumps)
        pa.field("input_split_sizes", pa.list_(pa.int64())),
        pa.field("output_split_sizes", pa.list_(pa.int64())),
    ]
)
ENTRY_COLUMNS = tuple(ENTRY_SCHEMA.names)

# Library frames that are never "the user's code" when picking a call site.
_LIBRARY_MARKERS = (
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/_dynamo/",
    "/torch/utils/",
    "/torch/autograd/",
    "/frtools/recorder/",
    "<frozen ",
)


def sizes_key(sizes: Any) -> str:
    """Canonical string for a list of shapes (``[[4, 2], [3]]``); ``""`` when unknown."""
    if sizes is None:
        return ""
    return json.dumps([list(map(int, s)) for s in sizes], separators=(",", ":"))


def dtypes_key(dtypes: Any) -> str:
    """Canonical string for a list of dtype names (``Float,Half``); ``""`` when unknown."""
    if dtypes is None:
        return ""
    return ",".join(str(d) for d in dtypes)


def is_user_frame(filename: str) -> bool:
    return not any(marker in filename for marker in _LIBRARY_MARKERS)


def format_frame(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def call_site(frames: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The innermost frame in user code (frames are innermost first, as PyTorch dumps them)."""
    if not frames:
        return None
    for frame in frames:
        if is_user_frame(str(frame.get("filename", ""))):
            return format_frame(frame)
    return format_frame(frames[0])


def stack_text(frames: Sequence[Mapping[str, Any]] | None) -> str | None:
    if not frames:
        return None
    return "\n".join(format_frame(f) for f in frames)


DEFAULT_PG_NAME = "0"
DEFAULT_PG_DESC = "default_pg"


def is_default(name: str | None, desc: str | None = None) -> bool:
    """Whether a group is the job's default (world) group: every process's first group is
    named "0" (NCCL and Gloo alike), and PyTorch describes it as "default_pg". The one test
    of it; a file may give either sign alone."""
    return name == DEFAULT_PG_NAME or desc == DEFAULT_PG_DESC


@dataclass
class ProcessGroup:
    """A process group as the analysis knows it; ``ranks`` are global ranks, sorted."""

    name: str
    desc: str = ""
    ranks: tuple[int, ...] = ()
    inferred: bool = False

    @property
    def is_default(self) -> bool:
        """The job's default (world) group (``is_default``)."""
        return is_default(self.name, self.desc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "desc": self.desc,
            "ranks": list(self.ranks),
            "inferred": self.inferred,
        }


# a note names at most this many instances of one group, and notes this many groups
_NAMED_INSTANCES = 4
MAX_REPLACED_NOTES = 8


def replaced_instances_note(
    name: str, label: str, old: Sequence[str], newest: str, entries: int
) -> str:
    """The note on a file whose records hold destroyed instances of group ``name`` (a
    group created again in the process, as after ``destroy_process_group`` and a new
    init): ``old`` and ``newest`` are the instances' ``label`` (PyTorch's uid, ``pg_id``;
    a black box's table row), ``entries`` the entries left out. Bounded: a hostile file
    may name millions of instances."""
    named = ", ".join(str(x)[:24] for x in old[:_NAMED_INSTANCES])
    if len(old) > _NAMED_INSTANCES:
        named += f" and {len(old) - _NAMED_INSTANCES} more"
    return (
        f"process group {name[:64]} was created again in this process ({label} {named} then "
        f"{str(newest)[:24]}): {entries} entr{'y' if entries == 1 else 'ies'} of the "
        f"destroyed instance{'s' if len(old) > 1 else ''} left out"
    )


def restart_cut(spans: Sequence[tuple[int, int, int]], low: int, high: int) -> int | None:
    """Where an in-process restart split a record's process-group instances, if it split
    all of them: the largest instance number ``u`` (a uid, a table row: they grow in
    creation order) with ``low < u <= high`` such that every instance numbered below ``u``
    ended before any numbered ``u`` or above began; None where no ``u`` does. (Groups used
    one after another split a record too: the largest split is taken, so the earlier
    incarnation is all on its early side, with any group of the new one created before the
    first replacing instance and done before that one began.)

    ``spans``: each instance's (number, first, last) position among the records; ``low``:
    the newest instance a later one of its name replaced, ``high``: the oldest of those
    replacing ones. A restart destroys every group and creates the ones it needs again: the
    groups of the earlier incarnation that the new one did not create again (or whose new
    instance has no record yet) ended there too, and ops pending on them block nothing. A
    group that lives through (one destroyed and created again on its own, the rest kept)
    has records on both sides, and no ``u`` splits them."""
    ordered = sorted(spans)
    n = len(ordered)
    ends_before = [-1] * (n + 1)  # the last record of the instances before each index
    for i, (_, _, last) in enumerate(ordered):
        ends_before[i + 1] = max(ends_before[i], last)
    starts_from = [float("inf")] * (n + 1)  # the first record of those from each index on
    for i in range(n - 1, -1, -1):
        starts_from[i] = min(starts_from[i + 1], ordered[i][1])
    cut = None
    for i, (number, _, _) in enumerate(ordered):
        if low < number <= high and ends_before[i] < starts_from[i]:
            cut = number
    return cut


def earlier_incarnation_note(names: Sequence[str], label: str, cut: str, entries: int) -> str:
    """The note on a record whose groups ``names`` (bounded) ended at an in-process restart
    without a later instance of theirs on record: ``entries`` left out."""
    named = ", ".join(n[:64] for n in names[:_NAMED_INSTANCES])
    if len(names) > _NAMED_INSTANCES:
        named += f" and {len(names) - _NAMED_INSTANCES} more"
    return (
        f"process group{'s' if len(names) > 1 else ''} {named} ended at an in-process restart "
        f"(every op from {label} {cut[:24]} on is on groups created after it): {entries} "
        f"entr{'y' if entries == 1 else 'ies'} of the earlier incarnation left out"
    )


@dataclass
class RankInfo:
    """Identity and provenance of one global rank's record."""

    rank: int
    source: str = ""  # path of the file this rank's record came from
    format: str = ""  # "torch-pickle", "torch-json", "frtools"
    version: str = ""  # dump format version as written in the file
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    device: str | None = None  # "cuda:3", "cpu"
    device_id: str | None = None  # GPU UUID / PCI bus id where known
    world_size: int | None = None
    comm_lib_version: str | None = None
    # pg_name -> {"last_enqueued_collective": n, "last_started_collective": n,
    #             "last_completed_collective": n}; absent keys are unknown.
    pg_status: dict[str, dict[str, int]] = field(default_factory=dict)
    stacks: str | None = None  # all threads' Python stacks as text (faulthandler format)
    native_stacks: str | None = None  # py-spy's JSON of its native stacks (``rank_<R>.native``)
    dump_time_ns: int | None = None
    stalled: bool | None = None  # the recorder's watchdog marked a stall
    alive: bool | None = None  # process still running when collected (None: unknown)
    wrapped: bool = False  # the ring buffer dropped older entries
    # Failure facts (frtools records; None where the recorder cannot tell, e.g. PyTorch FR):
    exit_kind: str | None = None  # one of EXIT_KINDS
    exit_detail: str | None = None  # exception "Type: message", signal name, exit status
    last_heartbeat_ns: int | None = None  # the process was last seen alive (wall clock)
    # one of STARTUP_PHASES: how far its start-up got (None: not recorded, e.g. PyTorch FR)
    startup_phase: str | None = None
    # ``host`` was read from the file's name, not from the record: a guess
    host_guessed: bool = False

    def identity(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "local_rank": self.local_rank,
            "device": self.device,
            "device_id": self.device_id,
        }


@dataclass
class InputFile:
    """One file the readers looked at: ``ok``, ``skipped`` (not a dump, or a dump of an
    earlier run), ``error``
    (a dump that could not be used: truncated, corrupt, refused), ``duplicate`` (an older
    dump of a rank that has a newer one)."""

    path: str
    status: str
    reason: str = ""
    rank: int | None = None
    format: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "status": self.status,
            "reason": self.reason,
            "rank": self.rank,
            "format": self.format,
        }


@dataclass
class Trace:
    entries: pa.Table
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    process_groups: dict[str, ProcessGroup] = field(default_factory=dict)
    inputs: list[InputFile] = field(default_factory=list)
    world_size: int | None = None  # best knowledge: pg_config, manifest, or max rank + 1
    # a file, a manifest or the caller (--world-size) stated world_size: not a guess
    world_stated: bool = False
    # host -> what its GPUs, kernel log and NICs showed at dump time (device_<host>.json)
    devices: dict[str, HostDevices] = field(default_factory=dict)

    @property
    def expected_ranks(self) -> range:
        """Global ranks the job had, as far as the inputs tell."""
        n = self.world_size
        if n is None:
            known = set(self.ranks)
            for pg in self.process_groups.values():
                known.update(pg.ranks)
            n = max(known) + 1 if known else 0
        return range(n)

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in self.expected_ranks if r not in self.ranks]


def entries_table(rows: Iterable[Mapping[str, Any]] | Mapping[str, Sequence[Any]]) -> pa.Table:
    """Build an entries table with ``ENTRY_SCHEMA`` from row dicts or a dict of columns.

    Missing columns become nulls, so a reader only fills what its format knows.
    """
    if isinstance(rows, Mapping):
        columns = dict(rows)
        n = len(next(iter(columns.values()))) if columns else 0
    else:
        rows = list(rows)
        n = len(rows)
        columns = {name: [row.get(name) for row in rows] for name in ENTRY_COLUMNS}
    arrays = []
    for fld in ENTRY_SCHEMA:
        values = columns.get(fld.name)
        if values is None:
            arrays.append(pa.nulls(n, type=fld.type))
        else:
            arrays.append(pa.array(values, type=fld.type))
    return pa.Table.from_arrays(arrays, schema=ENTRY_SCHEMA)


def empty_entries() -> pa.Table:
    return ENTRY_SCHEMA.empty_table()


def concat_entries(tables: Sequence[pa.Table]) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return empty_entries()
    # one dictionary per column across all ranks' chunks: group-bys and joins need it
    tables = [t if t.schema.equals(ENTRY_SCHEMA) else t.cast(ENTRY_SCHEMA) for t in tables]
    return pa.concat_tables(tables).unify_dictionaries()
