"""A PyTorch Flight Recorder dump, already parsed (``torch_pickle``, ``torch_json``), as the
``RankDump`` the loader merges.

What the keys mean is ``frtools.formats.torch_fr``'s (``torch_fr.normalize``); this module adds what
the analysis keeps per file: the rank and host the file's name gives, where the dump came
from, and whether its ring buffer wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from frtools.formats.torch_fr.normalize import (
    EntryColumns,
    TorchDump,
    TorchDumpError,
    entries_table,
    native_columns,
    normalize,
)
from frtools.model.trace import RankInfo

from .base import DumpError, RankDump, rank_from_filename


def rank_dump(dump: Any, path: Path, fmt: str) -> RankDump:
    """One parsed dump (plain dicts and lists) -> ``RankDump``; ``DumpError`` when it is
    not a usable dump."""
    name_rank, name_host = rank_from_filename(path.name)
    try:
        normalized = normalize(dump, name_rank, name_host)
    except TorchDumpError as e:
        raise DumpError(str(e)) from None
    return _rank_dump(normalized, path, fmt, _host_guessed(dump, name_host))


def native_rank_dump(
    top: Mapping[str, Any], columns: Mapping[str, Any], path: Path, fmt: str
) -> RankDump:
    """``rank_dump`` for what the native parser (``_frpickle.parse``) gives: the top level
    as plain data and the entries as columns."""
    dump, cols = native_parts(top, columns, path, fmt)
    dump.entries = entries_table([cols])
    return dump


def native_parts(
    top: Mapping[str, Any], columns: Mapping[str, Any], path: Path, fmt: str
) -> tuple[RankDump, EntryColumns]:
    """``native_rank_dump`` without the Arrow table: the dump (its ``entries`` None) and
    its entry columns, for ``entries_table`` to join with other files' into one table."""
    name_rank, name_host = rank_from_filename(path.name)
    try:
        normalized, cols = native_columns(top, columns, name_rank, name_host)
    except TorchDumpError as e:
        raise DumpError(str(e)) from None
    extremes = cols.columns.get("record_id"), cols.columns.get("time_created_ns")
    dump = _rank_dump(normalized, path, fmt, _host_guessed(top, name_host), extremes)
    return dump, cols


def _host_guessed(dump: Any, name_host: str | None) -> bool:
    """The host came from the file's name: the dump names none of its own (the record's
    own host wins over the name's, see ``normalize``)."""
    own = dump.get("host") if isinstance(dump, Mapping) else None
    return name_host is not None and not (isinstance(own, str) and own)


def _rank_dump(
    dump: TorchDump,
    path: Path,
    fmt: str,
    host_guessed: bool = False,
    extremes: tuple[Any, Any] | None = None,
) -> RankDump:
    """``extremes``: the record ids and creation times (Arrow arrays or None) where the
    dump's entries are not a table yet."""
    if extremes is None:  # the Python path: its dump comes with its table
        assert dump.entries is not None
        extremes = dump.entries.column("record_id"), dump.entries.column("time_created_ns")
    record_ids, created = extremes
    first_id = _extreme(record_ids, pc.min)
    info = RankInfo(
        rank=dump.rank,
        source=str(path),
        format=fmt,
        version=dump.version,
        host=dump.host,
        pid=dump.pid,
        comm_lib_version=dump.comm_lib_version,
        pg_status=dump.pg_status,
        wrapped=first_id is not None and first_id > 0,
        host_guessed=host_guessed and dump.host is not None,
    )
    return RankDump(
        rank_info=info,
        entries=dump.entries,
        process_groups=dump.process_groups,
        unmapped_peer_groups=dump.unmapped_peer_groups,
        bad_entries=dump.bad_entries,
        notes=dump.notes,
        max_time_created_ns=_extreme(created, pc.max),
        default_pg_all=dump.default_pg_all,
    )


def _extreme(values: pa.Array | pa.ChunkedArray | None, how: Any) -> int | None:
    """The least or greatest value (``pc.min`` / ``pc.max``), None where there is none; a
    file's column without nulls through numpy (a compute call costs ~15x more there)."""
    if values is None:
        return None
    if isinstance(values, pa.Array) and values.null_count == 0 and len(values):
        found = values.to_numpy()
        return int(found.min() if how is pc.min else found.max())
    return how(values).as_py()
