"""frtools black boxes -> PyTorch Flight Recorder pickles, for tools that only read those.

The one module that knows both formats: it reads a black box with ``formats.blackbox`` and
writes the dump torch 2.13 writes (``_dump_fr_trace``, version ``torch_fr.WRITE_VERSION``)
with ``formats.torch_fr``'s keys: ``pg_config`` (group name -> name, desc, global ranks),
``pg_status`` (last enqueued / started / completed collective) and ``entries`` (one dict per
op: ``process_group`` = (name, desc), ``profiling_name`` with group-local P2P ranks,
``frames`` as {name, filename, line} …). One file per rank, ``OUT/rank_<R>`` without
extension, which is what ``torchfrtrace`` (``python -m
torch.distributed.flight_recorder.fr_trace OUT -p rank_``) parses the rank from.

Pure Python: no torch, no native module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools.formats import torch_fr
from frtools.formats.blackbox import STATE_NAMES, Snapshot, SnapshotError, read_snapshot
from frtools.formats.manifest import BOX_SUFFIX, rank_file_name


@dataclass
class ConvertResult:
    written: dict[int, Path] = field(default_factory=dict)  # rank -> output file
    errors: list[str] = field(default_factory=list)  # one line per unusable input


def parse_stack(stack: str) -> list[dict[str, Any]]:
    """Frames from the recorder's ``file:line in func`` lines (innermost first)."""
    frames = []
    for line in stack.splitlines():
        where, _, name = line.rpartition(" in ")
        filename, _, lineno = where.rpartition(":")
        if not where or not lineno.isdigit():
            frames.append({"name": name or line, "filename": where or line, "line": 0})
            continue
        frames.append({"name": name, "filename": filename, "line": int(lineno)})
    return frames


def _sizes(text: str) -> list[list[int]]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _dtypes(text: str) -> list[str]:
    return [d for d in text.split(",") if d] if text else []


def _profiling_name(name: str, group: Any, rank: int, peer: int, is_p2p: bool) -> str:
    """A P2P op's name with the group-local ranks of both sides, where the group lists them."""
    if not is_p2p or group is None:
        return name
    ranks = sorted(group.ranks)
    if rank not in ranks or peer not in ranks:
        return name
    return torch_fr.p2p_profiling_name(name, ranks.index(rank), ranks.index(peer))


def snapshot_to_torch_dump(snap: Snapshot) -> dict[str, Any]:
    """One rank's black box as the dict PyTorch's recorder pickles."""
    pg_config = {
        g.name: torch_fr.pg_config_entry(g.name, g.desc, torch_fr.member_list_text(g.ranks))
        for g in snap.groups
    }
    pg_status = {
        g.name: torch_fr.pg_status_entry(
            int(g.last_enqueued_collective),
            int(g.last_started_collective),
            int(g.last_completed_collective),
        )
        for g in snap.groups
    }
    groups = {g.index: g for g in snap.groups}
    strings: dict[int, str] = {}

    def s(sid: Any) -> str:
        sid = int(sid)
        text = strings.get(sid)
        if text is None:
            text = strings[sid] = snap.string(sid)
        return text

    own_rank = int(snap.identity.get("rank", -1))
    frames_cache: dict[int, list[dict[str, Any]]] = {}
    op_ids: dict[int, int] = {}
    entries = []
    for slot in snap.slots:
        pg_index = int(slot["pg"])
        group = groups.get(pg_index)
        state = STATE_NAMES[int(slot["state"])] if int(slot["state"]) < len(STATE_NAMES) else ""
        started = int(slot["time_started_ns"])
        completed = int(slot["time_completed_ns"])
        duration = float(slot["duration_ms"])
        stack_id = int(slot["stack"])
        if stack_id not in frames_cache:
            frames_cache[stack_id] = parse_stack(s(stack_id))
        op_ids[pg_index] = op_ids.get(pg_index, 0) + 1
        entry = dict.fromkeys(torch_fr.ENTRY_KEYS)
        entry.update(
            frames=frames_cache[stack_id],
            record_id=int(slot["record_id"]),
            pg_id=pg_index,
            process_group=(group.name, group.desc) if group else (str(pg_index), ""),
            thread_name=s(slot["thread_name"]),
            thread_id=str(int(slot["thread_id"])),
            collective_seq_id=int(slot["collective_seq_id"]),
            p2p_seq_id=int(slot["p2p_seq_id"]),
            op_id=op_ids[pg_index],
            profiling_name=_profiling_name(
                s(slot["op"]), group, own_rank, int(slot["peer"]), bool(slot["is_p2p"])
            ),
            time_created_ns=int(slot["time_created_ns"]),
            duration_ms=duration,
            input_sizes=_sizes(s(slot["input_sizes"])),
            input_dtypes=_dtypes(s(slot["input_dtypes"])),
            output_sizes=_sizes(s(slot["output_sizes"])),
            output_dtypes=_dtypes(s(slot["output_dtypes"])),
            state=state or "scheduled",
            time_discovered_started_ns=started or None,
            time_discovered_completed_ns=completed or None,
            retired=state == "completed",
            timeout_ms=0,
            is_p2p=bool(slot["is_p2p"]),
        )
        if not duration > 0:  # PyTorch writes it only once a duration was measured
            del entry["duration_ms"]
        entries.append(entry)
    return torch_fr.dump_dict(pg_config, pg_status, entries)


def find_snapshots(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob(f"*{BOX_SUFFIX}") if p.is_file())


def convert_to_torch_pickle(
    src: str | os.PathLike[str], out: str | os.PathLike[str]
) -> ConvertResult:
    """Write ``out/rank_<R>`` for every readable ``*.frt`` under ``src``; errors are listed."""
    result = ConvertResult()
    out_dir = Path(out)
    sources = find_snapshots(Path(src))
    if not sources:
        result.errors.append(f"{src}: no frtools black-box files (*.frt) found")
        return result
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sources:
        try:
            snap = read_snapshot(path)
            rank = int(snap.identity.get("rank"))
        except (SnapshotError, OSError, TypeError, ValueError) as exc:
            result.errors.append(f"{path}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            continue
        if rank in result.written:
            result.errors.append(f"{path}: rank {rank} already converted from another file")
            continue
        target = out_dir / rank_file_name(rank, suffix="")
        target.write_bytes(torch_fr.pickle_dump(snapshot_to_torch_dump(snap)))
        result.written[rank] = target
    return result
