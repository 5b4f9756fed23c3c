"""The per-host step of a fleet analysis: one host's records -> one host summary.

A verdict needs a small part of each rank's record (docs/fleet.md): its identity, each
group's frontier, the ops that did not complete, the last ``window`` ops, its stacks and
failure facts. ``summarize_path`` reads a host's folder through the readers — a live
recorder job folder, an ``frtools dump`` folder, PyTorch Flight Recorder dumps, any mix —
keeps the newest record of each rank, applies the folder's side files (``manifest.json``:
processes gone; ``rank_<R>.stacks``) and returns one ``RankSummary`` per rank; what only the
whole job can tell (members of a group no file lists, the world size of a Gloo job) is left
for the central step. ``rank_summary`` is the same for one ``RankDump``.

The summaries are written as a packed host summary (``formats.summary_packed``); the
analyzer maps them back onto the Trace exactly as the records they came from, so the
verdict from summaries is the verdict from the records. ``merge_files`` merges host
summaries (or partials) into one partial: a rack's, then the job's, wherever they are.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from frtools.formats.blackbox import splits_text
from frtools.formats.summary import (
    MAX_GROUPS,
    MAX_NOTES,
    MAX_STRING_CHARS,
    RankSummary,
    SummaryEntry,
    SummaryError,
    SummaryGroup,
    check_window,
    completed_ops,
    kept_positions,
    last_stacks,
)
from frtools.formats.summary_packed import (
    DEFAULT_HOST_WINDOW,
    PACKED_SUFFIX,
    PackedHost,
    decode_packed_many,
    encode_packed,
    merge_packed,
)
from frtools.model.trace import InputFile, Trace, empty_entries, is_default

from .readers.base import DumpError, RankDump, read_content
from .readers.loader import read_rank_dumps
from .readers.side_files import apply_side_files

__all__ = [
    "DEFAULT_HOST_WINDOW",
    "HostSummary",
    "Partial",
    "merge_files",
    "rank_summary",
    "summarize_path",
]


@dataclass
class HostSummary:
    """A host's rank summaries, the host they name, and what became of each file."""

    host: str
    summaries: list[RankSummary]
    inputs: list[InputFile] = field(default_factory=list)
    window: int = DEFAULT_HOST_WINDOW

    def encode(self) -> bytes:
        return encode_packed(self.summaries, self.host, window=self.window)


def _ints(table: pa.Table, name: str, null: int) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        col = col.fill_null(null)
    return col.to_numpy().astype(np.int64, copy=False)


def _completed(
    table: pa.Table, rows: np.ndarray, pg_status: dict[str, dict[str, int]]
) -> np.ndarray:
    """Which of ``rows`` completed as far as the record says (``completed_ops``: its state,
    PyTorch's ``retired``, its group's ``last_completed_collective``; a send or recv of an
    NCCL batch, recorded without events, by its batch's entry: as the analysis reads it,
    align._settled_by_batch)."""
    part = table.take(pa.array(rows, type=pa.int64()))
    return _completed_part(part, pg_status) | _batch_done(table, part)


def _batch_done(table: pa.Table, part: pa.Table) -> np.ndarray:
    """Which P2P ops of ``part`` share (group, p2p seq) with a completed ``coalesced`` P2P
    entry of the rank's ``table`` (the op align._settled_by_batch reads as a batch's)."""
    out = np.zeros(part.num_rows, dtype=bool)
    whole = pc.and_(
        pc.fill_null(pc.equal(table.column("op").cast(pa.string()), "coalesced"), False),
        pc.fill_null(table.column("is_p2p"), False),
    )
    batches = table.filter(whole)
    if not batches.num_rows:
        return out
    done = pc.fill_null(pc.equal(batches.column("state").cast(pa.string()), "completed"), False)
    batches = batches.filter(done)
    keys = set(
        zip(
            batches.column("pg_name").cast(pa.string()).to_pylist(),
            batches.column("p2p_seq_id").to_pylist(),
            strict=True,
        )
    )
    if not keys:
        return out
    p2p = pc.fill_null(part.column("is_p2p"), False).to_pylist()
    groups = part.column("pg_name").cast(pa.string()).to_pylist()
    seqs = part.column("p2p_seq_id").to_pylist()
    for i, (is_p2p, g, q) in enumerate(zip(p2p, groups, seqs, strict=True)):
        out[i] = is_p2p and (g, q) in keys
    return out


def _completed_part(part: pa.Table, pg_status: dict[str, dict[str, int]]) -> np.ndarray:
    """``completed_ops`` of the rows of ``part``."""
    state = part.column("state")
    done = pc.fill_null(pc.equal(state.cast(pa.string()), "completed"), False)
    retired = part.column("retired")
    status = {k: v.get("last_completed_collective") for k, v in pg_status.items()}
    status = {k: v for k, v in status.items() if isinstance(v, int) and v >= 0}
    frontier = {}
    if status:
        names = part.column("pg_name").cast(pa.string()).to_pylist()
        frontier = {
            "is_p2p": pc.fill_null(part.column("is_p2p"), False).to_numpy(zero_copy_only=False),
            "collective_seq_id": _ints(part, "collective_seq_id", 0),
            "last_completed": np.array(
                [status.get(x, -1) if x is not None else -1 for x in names], np.int64
            ),
        }
    return completed_ops(
        done.to_numpy(zero_copy_only=False),
        retired=(
            pc.fill_null(retired, False).to_numpy(zero_copy_only=False)
            if retired.null_count < part.num_rows
            else None
        ),
        **frontier,
    )


def _kept_rows(table: pa.Table, pg_status: dict[str, dict[str, int]], window: int) -> np.ndarray:
    """Row positions a summary keeps (``kept_positions``), in record order."""
    n = table.num_rows
    rid = table.column("record_id")
    order = (
        np.argsort(rid.to_numpy(), kind="stable")
        if rid.null_count == 0 and n
        else np.arange(n, dtype=np.int64)
    )
    kept = kept_positions(n, window, lambda older: _completed(table, order[older], pg_status))
    return order[kept].astype(np.int64)


def rank_summary(
    dump: RankDump,
    *,
    window: int = DEFAULT_HOST_WINDOW,
    taken_ns: int | None = None,
    world_size: int | None = None,
) -> RankSummary:
    """One rank's summary from its record as a reader read it (any format).

    ``world_size``: the job's size where the record does not say it (a manifest's)."""
    check_window(window)
    info = dump.rank_info
    table = dump.entries
    kept = _kept_rows(table, info.pg_status, window)
    rows = table.take(pa.array(kept, type=pa.int64())) if len(kept) < table.num_rows else table
    world = info.world_size if info.world_size is not None else world_size

    # the rank's groups: those its record lists, then those only its status or ops name
    names: list[str] = list(dump.process_groups)
    for name in info.pg_status:
        if name not in dump.process_groups:
            names.append(name)
    used = rows.column("pg_name").cast(pa.string()).to_pylist()
    known = set(names)
    for name in sorted({x for x in used if x is not None} - known):
        names.append(name)
    # a group whose only member is this rank, with none of the kept ops on it, cannot make
    # anyone wait: left out (at 131,072 ranks, three such groups a rank would triple the
    # groups the central step tracks)
    in_use = set(used)
    names = [
        name
        for name in names
        if name in in_use
        or (pg := dump.process_groups.get(name)) is None
        or pg.ranks != (info.rank,)
    ][:MAX_GROUPS]
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for name in names:
        pg = dump.process_groups.get(name)
        ranks = pg.ranks if pg is not None else ()
        if (
            not ranks
            and dump.default_pg_all
            and world
            and is_default(name, getattr(pg, "desc", None))
        ):
            ranks = tuple(range(world))
        st = info.pg_status.get(name, {})

        def frontier(key: str, st: dict[str, int] = st) -> int:
            v = st.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= -1 else -1

        groups.append(
            SummaryGroup(
                name=name,
                desc=pg.desc if pg is not None else "",
                ranks=tuple(ranks),
                last_enqueued_collective=frontier("last_enqueued_collective"),
                last_started_collective=frontier("last_started_collective"),
                last_completed_collective=frontier("last_completed_collective"),
                local_peers=name in dump.unmapped_peer_groups,
            )
        )

    col = {name: rows.column(name).to_pylist() for name in rows.column_names}
    entries = []
    for i in range(rows.num_rows):
        duration = col["duration_ms"][i]
        retired = col["retired"][i]
        entries.append(
            SummaryEntry(
                record_id=_int(col["record_id"][i], -1),
                group=index.get(used[i], -1) if used[i] is not None else -1,
                collective_seq_id=_int(col["collective_seq_id"][i], 0),
                p2p_seq_id=_int(col["p2p_seq_id"][i], 0),
                is_p2p=bool(col["is_p2p"][i]),
                op=_text(col["profiling_name"][i] or col["op"][i]),
                peer=col["peer"][i],
                input_sizes=_text(col["input_sizes"][i]),
                output_sizes=_text(col["output_sizes"][i]),
                input_dtypes=_text(col["input_dtypes"][i]),
                output_dtypes=_text(col["output_dtypes"][i]),
                state=col["state"][i] or "scheduled",
                time_created_ns=_int(col["time_created_ns"][i], 0),
                time_started_ns=col["time_started_ns"][i],
                time_completed_ns=col["time_completed_ns"][i],
                duration_ms=None if duration is None or math.isnan(duration) else duration,
                thread_id=_text(col["thread_id"][i]),
                thread_name=_text(col["thread_name"][i]),
                stack=_text(col["stack"][i]),
                error=_text(col["error"][i]),
                retired=None if retired is None else int(bool(retired)),
                timeout_ms=col["timeout_ms"][i],
                call_site=_text(col["call_site"][i]),
                splits=_splits(col["input_split_sizes"][i], col["output_split_sizes"][i]),
            )
        )
    rid = table.column("record_id")
    top = pc.max(rid).as_py() if table.num_rows and rid.null_count < table.num_rows else None
    omitted = table.num_rows - rows.num_rows
    identity = {
        key: value
        for key, value in (
            ("host", info.host),
            ("pid", info.pid),
            ("local_rank", info.local_rank),
            ("device", info.device),
            ("device_id", info.device_id),
            ("comm_lib_version", info.comm_lib_version),
        )
        if value is not None
    }
    return RankSummary(
        rank=info.rank,
        world_size=world,
        identity=identity,
        groups=groups,
        entries=entries,
        taken_ns=time.time_ns() if taken_ns is None else taken_ns,
        heartbeat_ns=info.last_heartbeat_ns,
        stalled=info.stalled,
        alive=info.alive,
        wrapped=bool(info.wrapped or omitted > 0),
        records_written=(top + 1) if isinstance(top, int) and top >= 0 else table.num_rows,
        omitted=omitted,
        exit_kind=info.exit_kind,
        exit_detail=info.exit_detail,
        stacks=last_stacks(info.stacks),
        notes=[n[:1024] for n in dump.notes[:MAX_NOTES]],
        dump_time_ns=info.dump_time_ns,
        startup_phase=info.startup_phase,
    )


def _int(value: object, null: int) -> int:
    return null if value is None else int(value)  # type: ignore[call-overload]


def _text(value: object) -> str:
    return "" if value is None else str(value)[:MAX_STRING_CHARS]


def _splits(sent: object, received: object) -> str:
    """An all_to_all's split sizes as the black box keeps them ("" : none, or too long)."""
    if sent is None or received is None:
        return ""
    text = splits_text(sent, received)
    return text if len(text) <= MAX_STRING_CHARS else ""


def summarize_path(
    path: str | os.PathLike[str],
    *,
    window: int = DEFAULT_HOST_WINDOW,
    workers: int | None = None,
    taken_ns: int | None = None,
    host: str | None = None,
) -> HostSummary:
    """The host summary of every record under ``path`` (a recorder job folder, a dump
    folder, PyTorch FR dumps; searched recursively). ``host``: the name it goes by (default:
    the one most of its ranks name, else this machine's). Raises
    ``frtools.analyze.readers.UnusableInput`` when no record is usable."""
    check_window(window)
    root = Path(path)
    inputs, chosen = read_rank_dumps(root, workers=workers)
    # what the folder's side files add: processes gone, stacks, the manifest's world size
    trace = Trace(
        entries=empty_entries(),
        ranks={r: d.rank_info for r, d in chosen.items()},
        inputs=inputs,
    )
    apply_side_files(trace, root)
    taken = time.time_ns() if taken_ns is None else taken_ns
    summaries = [
        rank_summary(chosen[r], window=window, taken_ns=taken, world_size=trace.world_size)
        for r in sorted(chosen)
    ]
    if host is None:
        named = Counter(s.identity.get("host") for s in summaries if s.identity.get("host"))
        host = named.most_common(1)[0][0] if named else socket.gethostname()
    return HostSummary(host=str(host), summaries=summaries, inputs=trace.inputs, window=window)


@dataclass
class Partial:
    """Merged packed summaries: the file's bytes, and the ranks, hosts and files it holds."""

    data: bytes
    ranks: list[int]
    hosts: list[str]
    files: list[Path]


def merge_files(paths: Sequence[str | os.PathLike[str]]) -> Partial:
    """One partial of the packed summaries at ``paths`` (files, or folders of
    ``*.summary`` files): ``formats.summary_packed.merge_packed``. A file that is not a
    valid packed summary, or a rank in two of them, is a ``SummaryError`` naming the file."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob(f"*{PACKED_SUFFIX}")) if p.is_dir() else [p])
    if not files:
        raise SummaryError(f"no {PACKED_SUFFIX} file to merge")
    datas = []
    for f in files:
        try:
            datas.append(read_content(f)[0])  # bounded as any dump file is
        except DumpError as e:
            raise SummaryError(f"{f}: {e}") from None
    parts: list[PackedHost] = []
    for f, part in zip(files, decode_packed_many(datas), strict=True):
        if isinstance(part, SummaryError):
            raise SummaryError(f"{f}: {part}")
        parts.append(part)
    data = merge_packed(parts, [str(f) for f in files])
    ranks = sorted(r.rank for part in parts for r in part.ranks)
    hosts = sorted({h for part in parts for h in (part.hosts or [part.host or ""]) if h})
    return Partial(data=data, ranks=ranks, hosts=hosts, files=files)
