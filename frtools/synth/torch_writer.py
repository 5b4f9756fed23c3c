"""Write each rank's flight record as PyTorch's NCCL Flight Recorder writes it.

The dump of torch 2.13's ``FlightRecorder::dump`` (version ``"2.10"``, keys as
``frtools.formats.torch_fr`` defines them): ``pg_status`` by the group's process-local uid,
``entries`` oldest first (``record_id`` counts every call the rank made, so a wrapped ring
buffer starts at a high id). Files are named like PyTorch's default
``TORCH_FR_DUMP_TEMP_FILE`` (``nccl_trace_rank_<R>``), which is also what ``torchfrtrace``
expects (a common prefix followed by the rank).

Each rank's entries are filled from per-stage templates (the static fields of every
position of the step), so writing thousands of ranks is dominated by pickling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from frtools.formats import torch_fr

from .job import (
    BACKEND,
    COMM_LIB_VERSION,
    INIT_BARRIER,
    Job,
    Slot,
    WriteParams,
    init_barrier_times,
    rank_arrays,
)
from .layout import CREATION_ORDER

TIMEOUT_MS = 600_000

# the rank-local uid PyTorch gives each ProcessGroupNCCL: creation order on this rank
PG_ID = {"world": 0, **{kind: i + 1 for i, kind in enumerate(CREATION_ORDER)}}

_WORLD_RANKS_TEXT: dict[int, str] = {}


def file_name(params: WriteParams, rank: int) -> str:
    return f"{params.prefix}{rank}"


def rank_bytes(job: Job, rank: int) -> bytes:
    """The file ``rank`` leaves: its dump, pickled."""
    return torch_fr.pickle_dump(rank_dump(job, rank))


def _profiling_name(slot: Slot) -> str:
    name = f"{BACKEND}:{slot.op}"
    return torch_fr.p2p_profiling_name(name, slot.stage, slot.peer_stage) if slot.is_p2p else name


def _template(slot: Slot, pg: tuple[str, str], thread_id: str, timing: bool) -> dict[str, Any]:
    """An entry with every static field filled, keys in PyTorch's order."""
    entry = dict.fromkeys(torch_fr.ENTRY_KEYS)
    entry.update(
        frames=slot.frames,
        pg_id=PG_ID[slot.kind],
        profiling_name=_profiling_name(slot),
        input_sizes=slot.input_sizes,
        input_dtypes=slot.input_dtypes,
        output_sizes=slot.output_sizes,
        output_dtypes=slot.output_dtypes,
        is_p2p=slot.is_p2p,
        process_group=pg,
        thread_name="python",
        thread_id=thread_id,
        timeout_ms=TIMEOUT_MS,
    )
    if not timing:
        del entry["duration_ms"]
    return entry


def rank_dump(job: Job, rank: int) -> dict[str, Any]:
    """The dict PyTorch would pickle for ``rank``."""
    a = rank_arrays(job, rank)
    layout = job.layout
    timing = job.params.timing
    slots, hang_slots = a.slots, a.hang_slots
    pg_tuple, pg_members, status = a.pg_tuple, a.pg_members, a.status
    recs, in_hang, pos, coll_seq, p2p_seq = a.recs, a.in_hang, a.pos, a.coll_seq, a.p2p_seq
    created, state, started, discovered, duration = (
        a.created,
        a.state,
        a.started,
        a.discovered,
        a.duration,
    )
    thread_id = str(139_800_000_000_000 + rank * 4096)
    tmpl_regular = [_template(x, pg_tuple[x.kind], thread_id, timing) for x in slots]
    tmpl_hang = (
        tmpl_regular
        if hang_slots is slots
        else [_template(x, pg_tuple[x.kind], thread_id, timing) for x in hang_slots]
    )

    entries: list[dict[str, Any]] = []
    if a.barrier:
        e = _template(INIT_BARRIER, pg_tuple["world"], thread_id, timing)
        created_ns, started_ns, completed_ns, duration_ms = init_barrier_times(a.skew)
        e.update(
            record_id=0,
            collective_seq_id=1,
            p2p_seq_id=0,
            op_id=1,
            time_created_ns=created_ns,
            state="completed",
            time_discovered_started_ns=started_ns,
            time_discovered_completed_ns=completed_ns,
            retired=True,
        )
        if timing:
            e["duration_ms"] = duration_ms
        entries.append(e)
    STATES = ("completed", "started", "scheduled")
    for rec, h, p, cs, ps, cr, st, sn, dc, du in zip(
        recs.tolist(),
        in_hang.tolist(),
        pos.tolist(),
        coll_seq.tolist(),
        p2p_seq.tolist(),
        created.tolist(),
        state.tolist(),
        started.tolist(),
        discovered.tolist(),
        duration.tolist(),
        strict=True,
    ):
        e = (tmpl_hang if h else tmpl_regular)[p].copy()
        e["record_id"] = rec
        e["collective_seq_id"] = cs
        e["p2p_seq_id"] = ps
        e["op_id"] = cs + ps
        e["time_created_ns"] = cr
        e["state"] = STATES[st]
        if st == 0:
            if timing:
                e["duration_ms"] = du
            e["time_discovered_started_ns"] = sn
            e["time_discovered_completed_ns"] = dc
            e["retired"] = True
        else:
            if timing:
                del e["duration_ms"]
            e["time_discovered_started_ns"] = sn if st == 1 else None
            e["retired"] = False
        entries.append(e)

    pg_config: dict[str, dict[str, str]] = {}
    for kind in ("world", *CREATION_ORDER):
        name, desc = pg_tuple[kind]
        if kind == "world":
            ranks_text = _WORLD_RANKS_TEXT.get(layout.world_size)
            if ranks_text is None:
                ranks_text = _members_text(pg_members[kind])
                _WORLD_RANKS_TEXT[layout.world_size] = ranks_text
        else:
            ranks_text = _members_text(pg_members[kind])
        pg_config[name] = torch_fr.pg_config_entry(name, desc, ranks_text)
    pg_config = dict(sorted(pg_config.items()))
    pg_status = {
        str(PG_ID[kind]): torch_fr.pg_status_entry(*status[kind])
        for kind in sorted(status, key=lambda k: PG_ID[k])
    }
    return torch_fr.dump_dict(pg_config, pg_status, entries, COMM_LIB_VERSION)


def _members_text(ranks: Any) -> str:
    return torch_fr.member_list_text(np.asarray(ranks).tolist())
