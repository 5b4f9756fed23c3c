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

import pyarrow.compute as pc

from frtools.formats.torch_fr.normalize import (
    TorchDump,
    TorchDumpError,
    normalize,
    normalize_native,
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
    name_rank, name_host = rank_from_filename(path.name)
    try:
        normalized = normalize_native(top, columns, name_rank, name_host)
    except TorchDumpError as e:
        raise DumpError(str(e)) from None
    return _rank_dump(normalized, path, fmt, _host_guessed(top, name_host))


def _host_guessed(dump: Any, name_host: str | None) -> bool:
    """The host came from the file's name: the dump names none of its own (the record's
    own host wins over the name's, see ``normalize``)."""
    own = dump.get("host") if isinstance(dump, Mapping) else None
    return name_host is not None and not (isinstance(own, str) and own)


def _rank_dump(dump: TorchDump, path: Path, fmt: str, host_guessed: bool = False) -> RankDump:
    table = dump.entries
    first_id = pc.min(table.column("record_id")).as_py()
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
        entries=table,
        process_groups=dump.process_groups,
        unmapped_peer_groups=dump.unmapped_peer_groups,
        bad_entries=dump.bad_entries,
        notes=dump.notes,
        max_time_created_ns=pc.max(table.column("time_created_ns")).as_py(),
        default_pg_all=dump.default_pg_all,
    )
