"""Normalize a PyTorch Flight Recorder dump (already parsed into plain dicts and lists, from
pickle or JSON, any version 1.x … 2.x) into a ``RankDump``.

The keys changed across versions (see docs/dump-formats.md); every lookup here takes the
newest name first and falls back to the older ones, so one code path reads them all.
Columns are built as plain lists and turned into one Arrow table per file: no per-entry
Python objects outlive the call.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from frtools.trace import (
    ENTRY_SCHEMA,
    ProcessGroup,
    RankInfo,
    call_site,
    entries_table,
    format_frame,
    sizes_key,
)

from .base import DumpError, RankDump, rank_from_filename

# Buffer sizes PyTorch ships as defaults (TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_FR_BUFFER_SIZE).
KNOWN_BUFFER_SIZES = (2000,)

_P2P_OPS = {"send", "recv"}
_SEND = re.compile(r"^\s*(-?\d+)\s*->\s*(-?\d+)\s*$")
_RECV = re.compile(r"^\s*(-?\d+)\s*<-\s*(-?\d+)\s*$")
_STATUS_KEYS = ("last_enqueued_collective", "last_started_collective", "last_completed_collective")


def parse_ranks(value: Any) -> tuple[int, ...] | str | None:
    """``"[0, 1, 2]"`` -> ``(0, 1, 2)``; ``"all"`` stays ``"all"``; garbage -> ``None``.

    Parsed as JSON or a Python literal, never evaluated.
    """
    if isinstance(value, (list, tuple)):
        seq = value
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() == "all":
            return "all"
        try:
            seq = json.loads(text)
        except ValueError:
            try:
                seq = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
    else:
        return None
    if not isinstance(seq, (list, tuple)):
        return None
    try:
        return tuple(sorted({int(r) for r in seq}))
    except (TypeError, ValueError):
        return None


def _as_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _sizes(v: Any) -> str:
    if not v:
        return "[]" if isinstance(v, list) else ""
    # str() of a list of int lists is C-fast and, without spaces, equals trace.sizes_key
    if isinstance(v, list) and all(isinstance(s, list) for s in v):
        text = str(v).replace(" ", "")
        if "L" not in text and "'" not in text:
            return text
    return sizes_key(v)


def _dtypes(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    return ",".join(str(d) for d in v)


def _pg_status(raw: Any, pg_id_to_name: Mapping[str, str]) -> tuple[dict[str, dict[str, int]], str]:
    """pg_status is keyed by the group's *uid* (``pg_id``), not its name; values are ints
    (pickle), strings (JSON) or, in a few builds, a bare int (the last enqueued seq)."""
    out: dict[str, dict[str, int]] = {}
    note = ""
    if not isinstance(raw, Mapping):
        return out, ("pg_status not a mapping; ignored" if raw is not None else "")
    for key, status in raw.items():
        name = pg_id_to_name.get(str(key), str(key))
        counters: dict[str, int] = {}
        if isinstance(status, Mapping):
            for k in _STATUS_KEYS:
                n = _as_int(status.get(k))
                if n is not None and n >= 0:
                    counters[k] = n
        else:
            n = _as_int(status)
            if n is not None and n >= 0:
                counters["last_enqueued_collective"] = n
            else:
                note = "some pg_status values unreadable; ignored"
        out[name] = counters
    return out, note


def _frames_text(frames: Any, cache: dict[tuple, tuple[str | None, str | None]]) -> tuple:
    if not frames or not isinstance(frames, list):
        return None, None
    try:
        key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in frames)
    except AttributeError:
        return None, None
    hit = cache.get(key)
    if hit is None:
        hit = (call_site(frames), "\n".join(format_frame(f) for f in frames))
        cache[key] = hit
    return hit


def normalize(dump: Any, path: Path, fmt: str) -> RankDump:
    """Turn one parsed FR dump into a ``RankDump``; raise ``DumpError`` when it is not one."""
    if not isinstance(dump, Mapping):
        raise DumpError(
            f"not a Flight Recorder dump: top level is {type(dump).__name__}, not a dict"
        )
    if "entries" not in dump:
        keys = ", ".join(sorted(map(str, dump))[:6])
        raise DumpError(f"not a Flight Recorder dump: no 'entries' key (keys: {keys or 'none'})")
    raw_entries = dump["entries"]
    if not isinstance(raw_entries, list):
        raise DumpError(f"'entries' is {type(raw_entries).__name__}, not a list")
    version = str(dump.get("version", "")) or "unversioned"
    notes: list[str] = []

    # rank: from content where the dump has it (some builds write "rank"), else the name
    name_rank, host = rank_from_filename(path.name)
    rank = _as_int(dump.get("rank"))
    if rank is None:
        rank = name_rank
    if rank is None:
        raise DumpError(
            "cannot tell which rank this dump belongs to: the dump has no 'rank' and the file "
            "name carries none (expected e.g. rank_3.pkl)"
        )
    if _as_int(dump.get("host")) is None and isinstance(dump.get("host"), str):
        host = dump["host"]

    # process groups this file knows
    groups: dict[str, ProcessGroup] = {}
    default_pg_all = False
    pg_config = dump.get("pg_config")
    if isinstance(pg_config, Mapping):
        for key, cfg in pg_config.items():
            if not isinstance(cfg, Mapping):
                continue
            name = str(cfg.get("name", key) or key)
            if not name:
                continue  # Gloo on 2.13 writes one {'': {..., 'ranks': '[]'}} placeholder
            ranks = parse_ranks(cfg.get("ranks"))
            desc = str(cfg.get("desc", "") or "")
            if ranks == "all":
                default_pg_all = default_pg_all or desc == "default_pg" or name == "0"
                ranks = ()
            groups[name] = ProcessGroup(name=name, desc=desc, ranks=ranks or ())

    cols: dict[str, list[Any]] = {n: [] for n in ENTRY_SCHEMA.names}
    frames_cache: dict[tuple, tuple[str | None, str | None]] = {}
    pg_id_to_name: dict[str, str] = {}
    unmapped: set[str] = set()
    bad = 0
    for e in raw_entries:
        try:
            row = _entry_row(e, groups, pg_id_to_name, frames_cache, unmapped)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            bad += 1
            continue
        for k, v in row.items():
            cols[k].append(v)
    if bad:
        notes.append(f"{bad} malformed entr{'y' if bad == 1 else 'ies'} skipped")
    n = len(cols["op"])
    cols["rank"] = [rank] * n
    try:
        table = entries_table(cols)
    except Exception as e:  # pyarrow raises several kinds for out-of-range values
        raise DumpError(f"entries do not fit the trace schema: {e}") from e

    for name in list(groups) + [n for n in set(cols["pg_name"]) if n not in groups]:
        if name not in groups and name:
            groups[name] = ProcessGroup(name=name, desc="", ranks=())
    for name, desc in zip(cols["pg_name"], cols["pg_desc"], strict=True):
        g = groups.get(name)
        if g is not None and not g.desc and desc:
            g.desc = desc

    pg_status, note = _pg_status(dump.get("pg_status"), pg_id_to_name)
    if note:
        notes.append(note)

    record_ids = [r for r in cols["record_id"] if r is not None]
    first_id = min(record_ids) if record_ids else 0
    wrapped = first_id > 0 or (n in KNOWN_BUFFER_SIZES and bool(record_ids) and record_ids[0] != 0)
    times = [t for t in cols["time_created_ns"] if t]
    comm = dump.get("comm_lib_version", dump.get("nccl_version"))
    info = RankInfo(
        rank=rank,
        source=str(path),
        format=fmt,
        version=version,
        host=host,
        pid=_as_int(dump.get("pid")),
        comm_lib_version=str(comm) if comm not in (None, "") else None,
        pg_status=pg_status,
        wrapped=wrapped,
    )
    return RankDump(
        rank_info=info,
        entries=table,
        process_groups=groups,
        unmapped_peer_groups=unmapped,
        bad_entries=bad,
        notes=notes,
        max_time_created_ns=max(times) if times else None,
        default_pg_all=default_pg_all,
    )


def _entry_row(
    e: Mapping[str, Any],
    groups: dict[str, ProcessGroup],
    pg_id_to_name: dict[str, str],
    frames_cache: dict,
    unmapped: set[str],
) -> dict[str, Any]:
    profiling_name = e["profiling_name"]
    if not isinstance(profiling_name, str):
        raise TypeError("profiling_name")
    # "nccl:send 0->1" -> op "send", meta "0->1"
    name = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    op, _, meta = name.partition(" ")

    pg = e.get("process_group")
    pg_id = e.get("pg_id")
    if isinstance(pg, (list, tuple)) and len(pg) >= 1:
        pg_name = str(pg[0])
        pg_desc = str(pg[1]) if len(pg) > 1 and pg[1] is not None else ""
    elif isinstance(pg, str):
        pg_name, pg_desc = pg, ""
    elif pg_id is not None:
        pg_name, pg_desc = str(pg_id), ""
    else:
        pg_name, pg_desc = "0", ""
    if pg_id is not None:
        pg_id_to_name.setdefault(str(pg_id), pg_name)

    is_p2p = e.get("is_p2p")
    if is_p2p is None:
        is_p2p = op in _P2P_OPS
    is_p2p = bool(is_p2p)
    if "collective_seq_id" in e or "p2p_seq_id" in e:
        coll_seq = _as_int(e.get("collective_seq_id")) or 0
        p2p_seq = _as_int(e.get("p2p_seq_id")) or 0
    else:  # before 1.5 one counter ("seq_id") counted every op of the group
        seq = _as_int(e.get("seq_id")) or 0
        coll_seq, p2p_seq = (0, seq) if is_p2p else (seq, 0)

    peer = None
    if meta and op in _P2P_OPS:
        m = (_SEND if op == "send" else _RECV).match(meta)
        if m:
            local = int(m.group(2))  # send a->b: peer b; recv a<-b: peer b
            members = groups.get(pg_name)
            if members is not None and members.ranks:
                peer = members.ranks[local] if 0 <= local < len(members.ranks) else None
            else:
                peer = local
                unmapped.add(pg_name)

    started = _as_int(e.get("time_discovered_started_ns"))
    completed = _as_int(e.get("time_discovered_completed_ns"))
    duration = e.get("duration_ms")
    site, stack = _frames_text(e.get("frames"), frames_cache)
    thread_id = e.get("thread_id")
    thread_name = e.get("thread_name")
    return {
        "record_id": _as_int(e.get("record_id")),
        "pg_name": pg_name,
        "pg_desc": pg_desc,
        "collective_seq_id": coll_seq,
        "p2p_seq_id": p2p_seq,
        "is_p2p": is_p2p,
        "op": op,
        "profiling_name": profiling_name,
        "peer": peer,
        "input_sizes": _sizes(e.get("input_sizes")),
        "output_sizes": _sizes(e.get("output_sizes")),
        "input_dtypes": _dtypes(e.get("input_dtypes")),
        "output_dtypes": _dtypes(e.get("output_dtypes")),
        "state": str(e.get("state") or "scheduled"),
        "time_created_ns": _as_int(e.get("time_created_ns")),
        "time_started_ns": started or None,
        "time_completed_ns": completed or None,
        "duration_ms": float(duration) if isinstance(duration, (int, float)) else None,
        "retired": bool(e["retired"]) if e.get("retired") is not None else None,
        "timeout_ms": _as_int(e.get("timeout_ms")),
        "thread_id": str(thread_id) if thread_id is not None else None,
        "thread_name": str(thread_name) if thread_name is not None else None,
        "call_site": site,
        "stack": stack,
    }
