"""Write each rank's record as an frtools snapshot (``rank_<R>.frt``, docs/snapshot-format.md).

The same simulated window as the PyTorch pickles, laid out the way the native black box
leaves its memory-mapped file: header + identity JSON, process-group table, the slot ring
(record ``r`` in slot ``r % capacity``), string table. Slots are one numpy structured array,
so a rank costs a few milliseconds.
"""

from __future__ import annotations

import json

import numpy as np

from frtools.formats.blackbox import (
    PAGE,
    PG_DTYPE,
    SLOT_DTYPE,
    StringTable,
    file_offsets,
    pack_file,
)
from frtools.formats.manifest import rank_file_name
from frtools.model.ranks import format_ranks
from frtools.model.trace import dtypes_key, sizes_key, stack_text

from .job import (
    BACKEND,
    COMM_LIB_VERSION,
    INIT_BARRIER,
    RANKS_PER_HOST,
    T0_NS,
    Job,
    Slot,
    WriteParams,
    init_barrier_times,
    rank_arrays,
)
from .layout import CREATION_ORDER

PG_CAPACITY = 64  # rows of the process-group table (the native black box: 1024)
GROUP_ROWS = ("world", *CREATION_ORDER)  # row order of the process-group table


def file_name(params: WriteParams, rank: int) -> str:
    return rank_file_name(rank)


def rank_bytes(job: Job, rank: int) -> bytes:
    return rank_snapshot(job, rank)


def _texts(slot: Slot) -> tuple[str, ...]:
    """The slot's strings in the format's canonical forms (computed once per slot)."""
    cached = slot.__dict__.get("_snapshot_texts")
    if cached is None:
        cached = (
            f"{BACKEND}:{slot.op}",
            sizes_key(slot.input_sizes),
            sizes_key(slot.output_sizes),
            dtypes_key(slot.input_dtypes),
            dtypes_key(slot.output_dtypes),
            stack_text(slot.frames) or "",
        )
        slot.__dict__["_snapshot_texts"] = cached
    return cached


def rank_snapshot(job: Job, rank: int) -> bytes:
    """The bytes of ``rank_<rank>.frt`` as the black box would leave them at the hang."""
    a = rank_arrays(job, rank)
    capacity = job.params.buffer_size
    strings = StringTable()
    pg_row = {kind: i for i, kind in enumerate(GROUP_ROWS)}

    def slot_columns(sl: list[Slot]) -> dict[str, np.ndarray]:
        cols: dict[str, list[int]] = {
            k: [] for k in ("op", "ins", "outs", "idt", "odt", "stack", "pg", "peer", "p2p")
        }
        for x in sl:
            texts = _texts(x)
            cols["op"].append(strings.id(texts[0]))
            cols["ins"].append(strings.id(texts[1]))
            cols["outs"].append(strings.id(texts[2]))
            cols["idt"].append(strings.id(texts[3]))
            cols["odt"].append(strings.id(texts[4]))
            cols["stack"].append(strings.id(texts[5]))
            cols["pg"].append(pg_row[x.kind])
            cols["peer"].append(int(a.pg_members["pp"][x.peer_stage]) if x.is_p2p else -1)
            cols["p2p"].append(int(x.is_p2p))
        return {k: np.array(v, dtype=np.int64) for k, v in cols.items()}

    regular = slot_columns(a.slots)
    hang = regular if a.hang_slots is a.slots else slot_columns(a.hang_slots)

    def pick(key: str) -> np.ndarray:
        r, h = regular[key], hang[key]
        return np.where(
            a.in_hang, h[np.minimum(a.pos, len(h) - 1)], r[np.minimum(a.pos, len(r) - 1)]
        )

    n = len(a.recs) + int(a.barrier)
    slots = np.zeros(n, dtype=SLOT_DTYPE)
    body = slice(int(a.barrier), n)
    thread_name = strings.id("python")
    slots["seq"] = 2
    slots["thread_id"] = 100_000 + rank
    slots["thread_name"] = thread_name
    done = a.state == 0
    slots["record_id"][body] = a.recs
    slots["collective_seq_id"][body] = a.coll_seq
    slots["p2p_seq_id"][body] = a.p2p_seq
    slots["time_created_ns"][body] = a.created
    slots["time_started_ns"][body] = np.where(a.state <= 1, a.started, 0)
    slots["time_completed_ns"][body] = np.where(done, a.discovered, 0)
    timing = job.params.timing
    slots["duration_ms"][body] = np.where(done & timing, a.duration, np.nan)
    slots["flags"][body] = np.where(done & timing, 1, 0)
    slots["state"][body] = 3 - a.state  # 0 completed -> 3, 1 started -> 2, 2 scheduled -> 1
    slots["pg"][body] = pick("pg")
    slots["peer"][body] = pick("peer")
    slots["is_p2p"][body] = pick("p2p")
    for field, key in (
        ("op", "op"),
        ("input_sizes", "ins"),
        ("output_sizes", "outs"),
        ("input_dtypes", "idt"),
        ("output_dtypes", "odt"),
        ("stack", "stack"),
    ):
        slots[field][body] = pick(key)
    if a.barrier:
        created_ns, started_ns, completed_ns, duration_ms = init_barrier_times(a.skew)
        op, ins, outs, idt, odt, stack = (strings.id(t) for t in _texts(INIT_BARRIER))
        # by name: the slot layout grows (format 2 added the failure fields, zero here)
        for field, value in (
            ("seq", 2),
            ("record_id", 0),
            ("collective_seq_id", 1),
            ("p2p_seq_id", 0),
            ("time_created_ns", created_ns),
            ("time_started_ns", started_ns),
            ("time_completed_ns", completed_ns),
            ("duration_ms", duration_ms if timing else np.nan),
            ("thread_id", 100_000 + rank),
            ("pg", 0),
            ("peer", -1),
            ("op", op),
            ("input_sizes", ins),
            ("output_sizes", outs),
            ("input_dtypes", idt),
            ("output_dtypes", odt),
            ("stack", stack),
            ("state", 3),
            ("is_p2p", 0),
            ("flags", int(timing)),
            ("thread_name", thread_name),
        ):
            slots[field][0] = value  # fmt: skip

    pgs = np.zeros(len(GROUP_ROWS), dtype=PG_DTYPE)
    for i, kind in enumerate(GROUP_ROWS):
        name, desc = a.pg_tuple[kind]
        members = a.pg_members[kind]
        e, s, c = a.status.get(kind, (0, 0, 0))
        p2p_issued = p2p_done = 0
        if kind == "pp" and len(members) > 1:
            is_pp = (pick("pg") == i) & (pick("p2p") == 1)
            if is_pp.any():
                p2p_issued = int(a.p2p_seq[is_pp].max())
                finished = is_pp & (a.state == 0)
                p2p_done = int(a.p2p_seq[finished].max()) if finished.any() else 0
        pgs[i] = (
            strings.id(name),
            strings.id(desc),
            strings.id(format_ranks(members, strides=True)),
            len(members),
            e,
            s,
            c,
            p2p_issued,
            p2p_done,
        )

    ring = np.zeros(capacity, dtype=SLOT_DTYPE)
    record_ids = slots["record_id"]
    ring[record_ids % capacity] = slots

    host = f"node{rank // RANKS_PER_HOST:05d}"
    identity = json.dumps(
        {
            "job_id": f"synth-{job.params.seed}",
            "rank": rank,
            "world_size": job.layout.world_size,
            "host": host,
            "pid": 200_000 + rank,
            "local_rank": rank % RANKS_PER_HOST,
            "device": f"cuda:{rank % RANKS_PER_HOST}",
            "device_id": f"GPU-{rank:08x}-5f1c-4e2a-9d3b-{job.params.seed:012x}",
            "torch_version": "2.13.0",
            "backend": "nccl",
            "comm_lib_version": COMM_LIB_VERSION,
        }
    ).encode()

    pg_offset, slots_offset, strings_offset = file_offsets(capacity, PG_CAPACITY)
    strings_bytes = len(strings.buf) + (-len(strings.buf) % PAGE)
    file_bytes = strings_offset + strings_bytes
    file_bytes += -file_bytes % PAGE
    incomplete = a.state != 0
    stalled = bool(incomplete.any())
    stall_record = int(a.recs[np.argmax(incomplete)]) if stalled else -1
    heartbeat = int(a.created.max()) + 600_000_000_000 if len(a.created) else T0_NS
    return pack_file(
        file_bytes,
        identity=identity,
        pgs=pgs,
        ring=ring,
        strings=bytes(strings.buf),
        capacity=capacity,
        pg_capacity=PG_CAPACITY,
        pg_offset=pg_offset,
        slots_offset=slots_offset,
        strings_offset=strings_offset,
        strings_bytes=strings_bytes,
        file_bytes=file_bytes,
        created_ns=T0_NS - 60_000_000_000,
        next_record_id=a.total,
        strings_used=len(strings.buf),
        pg_count=len(GROUP_ROWS),
        string_count=len(strings.ids) - 1,
        heartbeat_ns=heartbeat,
        stalled=int(stalled),
        watchdog_state=1,
        stall_record_id=stall_record,
        stall_time_ns=heartbeat - 540_000_000_000 if stalled else 0,
        identity_bytes=len(identity),
        stall_seconds=60.0,
        poll_ms=100,
        owner_pid=200_000 + rank,
        exit_watched=1,  # a hang: every rank still running, no ending recorded
    )
