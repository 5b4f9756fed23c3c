"""A rank's progress, now: the op it is in, since when, and its groups' frontiers.

One definition for two places: ``frtools top`` reads it from a box on this host
(``frtools.collect.live``), and every rank's watcher publishes it into the job's store as a
*beacon* (``<P>progress/<R>``, ``frtools.recorder.jobwide``) so that ``frtools top --job-wide``
shows the ranks of every host, not only this one's, without asking the job for anything.

* ``of_snapshot(snap)`` -> ``Progress``: the current op (the stalled one, else the oldest
  unfinished, else the newest), the last progress and each group's last issued / completed
  collective.
* ``encode(p)`` / ``decode(raw)``: the beacon, compact JSON. The store is not authenticated,
  so ``decode`` treats it as hostile: at most ``MAX_BEACON_BYTES``, ``MAX_GROUPS`` groups,
  every int through ``strict_int``, every text cut to ``MAX_TEXT``; ``None`` for anything that
  is not a beacon.

A group in a beacon carries a digest of its member list, not the list (a data-parallel group
of a large job has thousands of members): a group is one group across ranks by name and
member set, and equal digests stand for equal sets (``members_digest``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from frtools.formats.blackbox import FLAG_FAILED, STATE_NAMES, Snapshot
from frtools.formats.limits import strict_int

MAX_BEACON_BYTES = 16 << 10
MAX_GROUPS = 64  # a beacon names at most this many groups (the rank's first ones)
MAX_TEXT = 128
_MAX_NS = (1 << 63) - 1
_MAX_SEQ = (1 << 62) - 1
_COMPLETED = STATE_NAMES.index("completed")
_STATES = (*STATE_NAMES, "failed")


def members_digest(ranks: tuple[int, ...]) -> str:
    """Eight hex digits that stand for a group's member list (crc32 of its text)."""
    return f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"


@dataclass(kw_only=True)
class GroupProgress:
    name: str
    desc: str
    digest: str
    last_issued: int
    last_completed: int


@dataclass(kw_only=True)
class Progress:
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    state: str | None = None  # scheduled, started, completed, failed; None: no op yet
    pending: bool = False
    last_progress_ns: int | None = None
    stalled: bool = False
    stall_time_ns: int | None = None
    time_ns: int | None = None  # when the beacon was written
    interval_s: float | None = None  # how often the rank rewrites it
    groups: list[GroupProgress] = field(default_factory=list)


def of_snapshot(snap: Snapshot, *, ops: bool = True) -> Progress:
    """The rank's progress as its box says it (``op`` None: no op recorded yet; ``ops``
    False: the header and groups only, for a box whose op names cannot be read)."""
    header = snap.header
    p = Progress(
        stalled=snap.stalled,
        stall_time_ns=int(header["stall_time_ns"]) if header["stall_time_ns"] > 0 else None,
        groups=[
            GroupProgress(
                name=g.name,
                desc=g.desc,
                digest=members_digest(g.ranks),
                last_issued=int(g.last_enqueued_collective),
                last_completed=int(g.last_completed_collective),
            )
            for g in snap.groups
        ],
    )
    slots = snap.slots
    times = [int(v) for v in snap.phase_times().values()] + [int(header["created_ns"])]
    if not (ops and len(slots)):
        p.last_progress_ns = max(times) if any(times) else None
        return p
    failed = (slots["flags"] & FLAG_FAILED) != 0
    done = (slots["state"] == _COMPLETED) | failed
    newest = max(
        int(slots[col].max())
        for col in ("time_created_ns", "time_started_ns", "time_completed_ns", "time_failed_ns")
    )
    p.last_progress_ns = max([newest, *times])
    pending = np.flatnonzero(~done)
    stall_id = int(header["stall_record_id"])
    at = np.flatnonzero(slots["record_id"] == stall_id) if p.stalled and stall_id >= 0 else []
    i = int(at[0]) if len(at) else int(pending[0]) if len(pending) else len(slots) - 1
    slot = slots[i]
    p.op = snap.string(int(slot["op"]))
    p.pending = not bool(done[i])
    p.state = "failed" if failed[i] else STATE_NAMES[int(slot["state"])]
    p.seq = int(slot["p2p_seq_id"] if slot["is_p2p"] else slot["collective_seq_id"])
    pg = int(slot["pg"])
    if 0 <= pg < len(snap.groups):
        p.group = snap.groups[pg].name
    return p


def encode(p: Progress) -> str:
    """The beacon of ``p`` (its first ``MAX_GROUPS`` groups, texts cut to ``MAX_TEXT``)."""
    body = {
        "op": _cut(p.op),
        "group": _cut(p.group),
        "seq": p.seq,
        "state": p.state,
        "pending": p.pending,
        "progress_ns": p.last_progress_ns,
        "stalled": p.stalled,
        "stall_ns": p.stall_time_ns,
        "time_ns": p.time_ns,
        "every_s": p.interval_s,
        "groups": [
            [_cut(g.name), _cut(g.desc), g.digest, g.last_issued, g.last_completed]
            for g in p.groups[:MAX_GROUPS]
        ],
    }
    return json.dumps(body, separators=(",", ":"))


def decode(raw: bytes | str) -> Progress | None:
    """A beacon read back from the store, checked; None when it is not one."""
    if len(raw) > MAX_BEACON_BYTES:
        return None
    try:
        body = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    state = body.get("state")
    p = Progress(
        op=_text(body.get("op")),
        group=_text(body.get("group")),
        seq=strict_int(body.get("seq"), lo=0, hi=_MAX_SEQ),
        state=state if state in _STATES else None,
        pending=body.get("pending") is True,
        last_progress_ns=strict_int(body.get("progress_ns"), lo=1, hi=_MAX_NS),
        stalled=body.get("stalled") is True,
        stall_time_ns=strict_int(body.get("stall_ns"), lo=1, hi=_MAX_NS),
        time_ns=strict_int(body.get("time_ns"), lo=1, hi=_MAX_NS),
        interval_s=_seconds(body.get("every_s")),
    )
    groups = body.get("groups")
    for row in groups[:MAX_GROUPS] if isinstance(groups, list) else ():
        if not (isinstance(row, list) and len(row) == 5):
            continue
        name, desc, digest = _text(row[0]), _text(row[1]) or "", _text(row[2])
        issued = strict_int(row[3], lo=0, hi=_MAX_SEQ)
        completed = strict_int(row[4], lo=0, hi=_MAX_SEQ)
        if name is None or digest is None or issued is None or completed is None:
            continue
        p.groups.append(
            GroupProgress(
                name=name, desc=desc, digest=digest, last_issued=issued, last_completed=completed
            )
        )
    return p


def _seconds(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and 0 < value <= 86400 else None


def _cut(value: str | None) -> str | None:
    return value[:MAX_TEXT] if value else value


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) and value else None
