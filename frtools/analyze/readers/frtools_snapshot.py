"""Reader for frtools black-box snapshots (``rank_<R>.frt``, docs/snapshot-format.md).

Columnar end to end: the slot array is parsed by numpy in ``frtools.formats.blackbox``,
each distinct interned string is decoded once, every string column is a dictionary
column, and a chunk of boxes (``read_many``) becomes one table, one Arrow array per
column — thousands of snapshots read in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from frtools.formats.blackbox import (
    MAGIC,
    SLOT_DTYPE,
    STATE_NAMES,
    STRING_COLUMNS,
    STRING_NONE,
    Snapshot,
    SnapshotError,
    owner_alive,
    parse_splits,
    read_snapshot,
)
from frtools.formats.limits import strict_int
from frtools.model.codes import DictionaryPart, dense_unique, join_dictionaries
from frtools.model.ops import op_name
from frtools.model.trace import (
    ENTRY_SCHEMA,
    MAX_REPLACED_NOTES,
    ProcessGroup,
    RankInfo,
    earlier_incarnation_note,
    is_default,
    is_user_frame,
    replaced_instances_note,
    restart_cut,
)

from .base import DumpError, RankDump, rank_from_filename

FORMAT = "frtools"
# a black box's group table names every group its ops are on
LISTS_ALL_GROUPS = True
# its header states the world size
STATES_WORLD_SIZE = True
# its exit record says how the process ended (none: the process was killed, or runs)
RECORDS_ENDING = True
# default groups of jobs larger than this are passed as "all ranks" (RankDump.default_pg_all)
ALL_RANKS_ABOVE = 1024


def sniff(path: Path, head: bytes) -> bool:
    """An frtools snapshot starts with its 8-byte magic."""
    return head[: len(MAGIC)] == MAGIC


def read(path: Path) -> RankDump:
    """One rank's black box -> RankDump (global ranks, canonical strings, real groups)."""
    return snapshot_to_rank_dump(_snapshot(path), str(path))


def read_many(
    paths: list[Path],
) -> tuple[list[list[RankDump] | Exception], pa.Table, list[list[int]]]:
    """Several boxes at once (a worker's chunk of files): per file its RankDump, or the
    error that refused it (worded by the loader as for one file), and the entries of all of
    them as one table (``rows``: per file its dump's row count in it, in order; the dumps'
    ``entries`` are None). One Arrow array per column for the chunk: per box, its ~30
    small arrays cost more than its parse."""
    out: list[list[RankDump] | Exception] = []
    rows: list[list[int]] = []
    boxes: list[_BoxColumns] = []
    for path in paths:
        try:
            dump, box = _rank_dump_of(_snapshot(path), str(path))
        except Exception as e:  # noqa: BLE001 - one file's failure, as read_one words it
            out.append(e)
            rows.append([])
            continue
        out.append([dump])
        rows.append([0 if box is None else box.n])
        if box is not None:
            boxes.append(box)
    return out, _entries_table(boxes), rows


def _snapshot(path: Path) -> Snapshot:
    try:
        return read_snapshot(path)
    except SnapshotError as e:
        raise DumpError(str(e)) from None
    except OSError as e:
        raise DumpError(f"cannot read: {e.strerror or e}") from None


def _opt_str(value: object) -> str | None:
    return None if value in (None, "") else str(value)


def call_site_of(stack: str) -> str | None:
    """The innermost user frame of an interned stack ("file:line in func" lines, innermost
    first)."""
    lines = [line for line in stack.splitlines() if line]
    if not lines:
        return None
    for line in lines:
        filename = line.rsplit(" in ", 1)[0].rsplit(":", 1)[0]
        if is_user_frame(filename):
            return line
    return lines[0]


# the boxes of a job share their texts: each text's call site worked out once a process
# (the texts of a box went through ``call_site_of`` each time: 0.1 ms a box), kept for at
# most 1,024 texts of at most 4,096 characters (16 MB of keys at 4 bytes a character)
_SITES: dict[str, str | None] = {}
_SITES_KEPT = 1024
_SITE_TEXT_KEPT = 4096


def _call_sites(texts: list[str]) -> list[str | None]:
    sites = []
    for text in texts:
        try:
            site = _SITES[text]
        except KeyError:
            site = call_site_of(text)
            if len(_SITES) < _SITES_KEPT and len(text) <= _SITE_TEXT_KEPT:
                _SITES[text] = site
        sites.append(site)
    return sites


def snapshot_to_rank_dump(snap: Snapshot, source: str) -> RankDump:
    """Map a parsed snapshot onto the Trace model."""
    dump, box = _rank_dump_of(snap, source)
    dump.entries = _entries_table([] if box is None else [box])
    return dump


def _rank_dump_of(snap: Snapshot, source: str) -> tuple[RankDump, _BoxColumns | None]:
    """The snapshot's RankDump, its ``entries`` None, and its entries as columns (None:
    it holds none)."""
    snap, replaced, ended = _newest_instances(snap)
    ident = snap.identity
    header = snap.header
    notes = list(snap.notes) + replaced
    rank = strict_int(ident.get("rank"))
    if rank is None:
        rank, _ = rank_from_filename(Path(source).name)
        if rank is None:
            raise DumpError("frtools snapshot names no rank (header identity or file name)")
        notes.append("rank taken from the file name (identity has none)")

    backend = _opt_str(ident.get("backend"))
    watchdog_ran = header["watchdog_state"] != 0
    groups = snap.groups
    heartbeat = int(header["heartbeat_ns"]) if header["heartbeat_ns"] > 0 else None
    # how the process ended: recorded by it, else from whether it still runs (looked at
    # here for a file of this host; a manifest of `frtools dump` says it for the time of
    # collection and wins, see side_files.apply_manifest)
    alive = owner_alive(header, ident)
    exit_kind, exit_detail = snap.ending(alive)
    if snap.exit_stack:
        site = call_site_of(snap.exit_stack)
        notes.append(f"the uncaught exception that ended the process was raised at {site}")
    if snap.thread_error:
        notes.append(f"a thread died of an uncaught exception: {snap.thread_error}")
    info = RankInfo(
        rank=rank,
        source=source,
        format=FORMAT,
        version=str(snap.version),
        host=_opt_str(ident.get("host")),
        pid=strict_int(ident.get("pid")),
        local_rank=strict_int(ident.get("local_rank")),
        device=_opt_str(ident.get("device")),
        device_id=_opt_str(ident.get("device_id")),
        world_size=strict_int(ident.get("world_size")),
        comm_lib_version=_opt_str(ident.get("comm_lib_version") or ident.get("nccl_version")),
        pg_status={
            g.name: {
                "last_enqueued_collective": g.last_enqueued_collective,
                "last_started_collective": g.last_started_collective,
                "last_completed_collective": g.last_completed_collective,
            }
            for g in groups
            if g.index not in ended
        },
        dump_time_ns=heartbeat,
        stalled=bool(header["stalled"]) if watchdog_ran else None,
        wrapped=snap.wrapped,
        alive=alive,
        exit_kind=exit_kind,
        exit_detail=exit_detail,
        last_heartbeat_ns=heartbeat,
        startup_phase=snap.startup_phase,
    )
    # The default group of a big job lists every rank: say "all ranks" instead of handing
    # the loader one 16,384-int tuple per file (it fills range(world_size) once). Small jobs
    # keep the list: the loader marks a group it fills itself as inferred.
    world = info.world_size
    default_pg_all = False
    process_groups = {}
    for g in groups:
        ranks = g.ranks
        if all_ranks_of(g.name, g.desc, ranks, world):
            default_pg_all = True
            ranks = ()
        process_groups[g.name] = ProcessGroup(name=g.name, desc=g.desc, ranks=ranks)
    max_created = int(snap.slots["time_created_ns"].max()) if len(snap.slots) else None
    dump = RankDump(
        rank_info=info,
        entries=None,  # type: ignore[arg-type]
        process_groups=process_groups,
        bad_entries=snap.torn,
        notes=notes,
        max_time_created_ns=max_created,
        default_pg_all=default_pg_all,
    )
    return dump, _columns(snap, rank, backend, len(groups))


def _newest_instances(snap: Snapshot) -> tuple[Snapshot, list[str], set[int]]:
    """The snapshot without the ops of process-group instances that a later one of their
    name replaced, a note per name, and the rows that ended at the restart without a later
    row of their name (``model.trace.restart_cut``: their ops are left out too, and their
    counters are not read).

    A job that destroys its groups and initializes again in the same process (an in-process
    restart) gets the same group names again; the recorder gives each new instance a row of
    its own, and one live group has one name, so a row whose name a later row took belongs
    to a destroyed group: its ops can block nothing now. (Its counters are not read either:
    the later row's come last in the name's maps.)"""
    groups = snap.groups
    if len({g.name for g in groups}) == len(groups):
        return snap, [], set()
    rows: dict[str, list[int]] = {}  # name -> its rows, oldest first
    for g in groups:
        rows.setdefault(g.name, []).append(g.index)
    old = {name: r[:-1] for name, r in rows.items() if len(r) > 1}
    pg = snap.slots["pg"]
    replaced = [i for r in old.values() for i in r]
    gone = np.isin(pg, replaced)
    notes = [
        replaced_instances_note(
            name,
            "table rows",
            [str(i) for i in r],
            str(rows[name][-1]),
            int(np.count_nonzero(np.isin(pg[gone], r))),
        )
        for name, r in sorted(old.items())[:MAX_REPLACED_NOTES]
    ]
    # the rows that ended at the restart with no later row of their name (a group the new
    # incarnation did not create again): rows are numbered in creation order
    used, at = np.unique(pg, return_index=True)
    _, from_end = np.unique(pg[::-1], return_index=True)
    spans = [
        span
        for span in zip(used.tolist(), at.tolist(), (len(pg) - 1 - from_end).tolist(), strict=True)
        if 0 <= span[0] < len(groups)  # an op on no row of the table is on no instance
    ]
    cut = restart_cut(spans, max(replaced), min(r[-1] for r in rows.values() if len(r) > 1))
    ended: set[int] = set()
    if cut is not None:
        ended = {i for i, _, _ in spans if i < cut} - set(replaced)
    if ended:
        theirs = np.isin(pg, list(ended))
        gone |= theirs
        names = sorted({groups[i].name for i in ended})
        notes.append(earlier_incarnation_note(names, "table row", str(cut), int(theirs.sum())))
    return replace(snap, slots=snap.slots[~gone]), notes, ended


def all_ranks_of(name: str, desc: str, ranks: tuple[int, ...], world: int | None) -> bool:
    """The default group of a job above ``ALL_RANKS_ABOVE`` ranks, listing every rank,
    checked without comparing a 100,000-int tuple per file (16,384 boxes: ~1 s of reading):
    members are sorted and distinct (``parse_ranks``), so first, last and count decide."""
    return (
        is_default(name, desc)
        and world is not None
        and world > ALL_RANKS_ABOVE
        and len(ranks) == world
        and ranks[0] == 0
        and ranks[-1] == world - 1
    )


_SPLITS = pa.list_(pa.int64())


def split_columns(texts: list[str], idx: np.ndarray) -> dict[str, pa.Array]:
    """The all_to_all split columns from each row's splits text (``texts[idx]``; null
    elsewhere: other ops, records older than the field, a text that is not two lists of
    counts). Also what host summaries keep (readers.summary)."""
    parsed = [parse_splits(t) for t in texts]
    if not any(parsed):
        return {}
    take = pa.array(idx.astype(np.int32, copy=False))
    sent = pa.array([p[0] if p else None for p in parsed], type=_SPLITS)
    received = pa.array([p[1] if p else None for p in parsed], type=_SPLITS)
    return {"input_split_sizes": sent.take(take), "output_split_sizes": received.take(take)}


@dataclass
class _BoxColumns:
    """One box's entries before Arrow: numeric columns as (values, null mask) and
    dictionary columns as ``DictionaryPart``s; ``_entries_table`` turns the columns of
    several boxes into one table (a worker's chunk of boxes: one Arrow array per column, not
    one per box and column, then one concatenation)."""

    n: int
    numbers: dict[str, tuple[np.ndarray, np.ndarray | None]]
    texts: dict[str, DictionaryPart]
    splits: dict[str, pa.Array]


def _columns(snap: Snapshot, rank: int, backend: str | None, n_groups: int) -> _BoxColumns | None:
    """The box's entries as columns; None when it holds none."""
    if len(snap.slots) == 0:
        return None
    # contiguous copies of the fields: Arrow converts a strided numpy view 30x slower
    c = {name: np.ascontiguousarray(snap.slots[name]) for name in SLOT_DTYPE.names}
    n = len(snap.slots)

    # every string id of every column, decoded once
    ids = np.concatenate([c[name] for name in STRING_COLUMNS])
    # string ids are small (offsets into the box's string table): numbered by a table
    uniq, inverse = dense_unique(ids, 4 * len(ids) + (1 << 20)) or np.unique(
        ids, return_inverse=True
    )
    inverse = inverse.astype(np.int32, copy=False)
    texts = snap.strings(uniq)
    col_index = {name: inverse[k * n : (k + 1) * n] for k, name in enumerate(STRING_COLUMNS)}
    none = uniq == STRING_NONE

    ops = [op_name(t) for t in texts]
    profiling = [t if (":" in t or not backend or not t) else f"{backend}:{t}" for t in texts]
    sites = _call_sites(texts)

    def column(name: str, dictionary: list, none_is_null: bool) -> DictionaryPart:
        idx = col_index[name]
        return dictionary, idx, ~none[idx] if none_is_null else None

    pg = c["pg"]
    pg_valid = (pg >= 0) & (pg < n_groups)
    # the groups this box's entries are on, not every group its table lists (16,384 boxes
    # list 51,210 groups each, and use a few): a worker's table holds their names. A row on
    # no group counts as group ``n_groups``, numbered last, and is null (``pg_valid``).
    numbered = dense_unique(np.where(pg_valid, pg, n_groups), n_groups + 1)
    assert numbered is not None  # every value is in 0 … n_groups
    on, pg_idx = numbered
    on = on[on < n_groups]
    pg_names = [snap.groups[k].name for k in on.tolist()] or [""]
    pg_descs = [snap.groups[k].desc for k in on.tolist()] or [""]

    thread = c["thread_id"]
    if (thread == thread[0]).all():  # one thread issues every op: no sort
        threads, thread_idx = thread[:1], np.zeros(n, dtype=np.int32)
    else:
        threads, thread_idx = np.unique(thread, return_inverse=True)
    peer = c["peer"]
    started = c["time_started_ns"]
    completed = c["time_completed_ns"]
    duration = c["duration_ms"]
    state = c["state"]
    return _BoxColumns(
        n=n,
        numbers={
            "rank": (np.full(n, rank, dtype=np.int32), None),
            "record_id": (c["record_id"], None),
            "collective_seq_id": (c["collective_seq_id"], None),
            "p2p_seq_id": (c["p2p_seq_id"], None),
            "is_p2p": (c["is_p2p"] != 0, None),
            "peer": (peer, peer < 0),
            "time_created_ns": (c["time_created_ns"], None),
            "time_started_ns": (started, started == 0),
            "time_completed_ns": (completed, completed == 0),
            "duration_ms": (duration, np.isnan(duration)),
            "retired": (state == 3, None),
        },
        texts={
            "pg_name": (pg_names, pg_idx, pg_valid),
            "pg_desc": (pg_descs, pg_idx, pg_valid),
            "op": column("op", ops, none_is_null=False),
            "profiling_name": column("op", profiling, none_is_null=False),
            "input_sizes": column("input_sizes", texts, none_is_null=False),
            "output_sizes": column("output_sizes", texts, none_is_null=False),
            "input_dtypes": column("input_dtypes", texts, none_is_null=False),
            "output_dtypes": column("output_dtypes", texts, none_is_null=False),
            "state": (STATE_NAMES, state.astype(np.int32), state > 0),
            "thread_id": ([str(t) for t in threads.tolist()], thread_idx.astype(np.int32), None),
            "thread_name": column("thread_name", texts, none_is_null=True),
            "call_site": column("stack", sites, none_is_null=True),
            # stacks repeat across thousands of entries: dictionary-encoded, as the schema
            # says
            "stack": column("stack", texts, none_is_null=True),
            # the backend's exception text of a failed op (its state stays as it was: a
            # failed op never completed); null for every op that did not fail
            "error": column("error", texts, none_is_null=True),
        },
        splits=split_columns(texts, col_index["splits"]),
    )


def _entries_table(boxes: list[_BoxColumns]) -> pa.Table:
    """The entries of ``boxes`` (each holding some), one after the other, as one table."""
    if not boxes:
        return ENTRY_SCHEMA.empty_table()
    total = sum(b.n for b in boxes)
    arrays: dict[str, pa.Array] = {}
    for name in boxes[0].numbers:
        parts = [b.numbers[name] for b in boxes]
        values = np.concatenate([v for v, _ in parts]) if len(parts) > 1 else parts[0][0]
        mask = None
        if parts[0][1] is not None:
            mask = np.concatenate([m for _, m in parts]) if len(parts) > 1 else parts[0][1]
        arrays[name] = pa.array(values, mask=mask)
    for name in boxes[0].texts:
        arrays[name] = join_dictionaries([b.texts[name] for b in boxes])
    arrays["timeout_ms"] = pa.nulls(total, type=pa.int64())
    for name in {name for b in boxes for name in b.splits}:
        arrays[name] = pa.concat_arrays(
            [b.splits.get(name, pa.nulls(b.n, type=_SPLITS)) for b in boxes]
        )
    columns = []
    for f in ENTRY_SCHEMA:
        array = arrays.get(f.name)
        if array is None:  # a column this format does not carry yet
            array = pa.nulls(total, type=f.type)
        columns.append(array if array.type == f.type else array.cast(f.type))
    return pa.Table.from_arrays(columns, schema=ENTRY_SCHEMA)
