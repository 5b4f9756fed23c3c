"""all_to_all pair by pair: what rank i sends to rank j must be what j expects from i.

An all_to_all's sizes differ per rank in a healthy job (MoE token dispatch sends each expert
a different number of tokens), so comparing members' shapes says nothing. Where members
recorded their split sizes (``input_split_sizes`` / ``output_split_sizes``: elements per
member in group-rank order; frtools' recorder, PyTorch FR dumps from 2.11), each ordered
pair of members is checked: i's input split at j's position against j's output split at
i's position. A pair that disagrees hangs the op or aborts it (Gloo: "Received data size
doesn't match expected size"), or silently corrupts what j receives.

Worked example, group ranks 0-3, rank 1 sends 6 elements more to rank 3 than rank 3 expects::

    rank 1 input_split_sizes  [3, 6, 9, 18]     rank 3 output_split_sizes  [6, 12, 6, 12]
                                          ^ to 3                                ^ from 1
    18 != 12: the pair (1, 3) disagrees; no other pair does, so both are named (a tie).

Where one rank disagrees with several peers and they with nobody else, that rank is the
one to blame. An empty split list is the even split (NCCL writes none where every split is
equal): the tensor's elements over the group size. A member without splits is not judged,
nor an all_to_all its members issued from different call sites: that is not one exchange
but a rank that skipped one (its next call took the seq), which the skip rule names.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from frtools.model.ops import OpFamily, family_of
from frtools.model.trace import Trace

_COLUMNS = ("rank", "pg_name", "collective_seq_id", "op", "time_created_ns", "call_site")
_COLUMNS += ("input_sizes", "output_sizes", "input_split_sizes", "output_split_sizes")


@dataclass(frozen=True, kw_only=True)
class SplitPair:
    """``sender`` sends ``sent`` elements to ``receiver``, which expects ``expected``."""

    sender: int
    receiver: int
    sent: int
    expected: int


@dataclass(frozen=True, kw_only=True)
class SplitMismatch:
    """One all_to_all whose members' splits disagree; ``guilty``: the members that disagree
    with the most peers (``tie``: more than one of them); ``count``: disagreeing
    all_to_alls in the records."""

    pg_name: str
    seq: int
    op: str
    time_ns: int
    pairs: tuple[SplitPair, ...]
    guilty: tuple[int, ...]
    tie: bool
    count: int = 1


def first_split_mismatch(
    trace: Trace, members: Callable[[str], Sequence[int]]
) -> SplitMismatch | None:
    """The earliest all_to_all whose splits disagree for some pair; ``members(pg_name)``:
    the group's global ranks (group rank = position in sorted order, as c10d numbers them)."""
    found = split_mismatches(trace, members)
    if not found:
        return None
    first = found[0]
    return SplitMismatch(
        pg_name=first.pg_name, seq=first.seq, op=first.op, time_ns=first.time_ns,
        pairs=first.pairs, guilty=first.guilty, tie=first.tie, count=len(found),
    )  # fmt: skip


def split_mismatches(trace: Trace, members: Callable[[str], Sequence[int]]) -> list[SplitMismatch]:
    """Every all_to_all whose splits disagree, earliest first."""
    entries = trace.entries
    if "input_split_sizes" not in entries.column_names or not entries.num_rows:
        return []
    has = pc.or_(
        pc.is_valid(entries["input_split_sizes"]), pc.is_valid(entries["output_split_sizes"])
    )
    if not pc.any(has).as_py():
        return []
    rows = entries.filter(has).select(list(_COLUMNS))
    ops: dict[tuple[str, int], dict[int, dict]] = {}
    doubled: set[tuple[str, int]] = set()
    for row in _pylist(rows):
        if family_of(row["op"]) is not OpFamily.ALL_TO_ALL or not row["collective_seq_id"]:
            continue
        key = (str(row["pg_name"]), int(row["collective_seq_id"]))
        at = ops.setdefault(key, {})
        if row["rank"] in at:  # several all_to_alls at one seq (a coalesced block): not judged
            doubled.add(key)
        at[int(row["rank"])] = row
    found = []
    for key, by_rank in ops.items():
        if key in doubled or len(by_rank) < 2:
            continue
        got = _check(key, by_rank, sorted(members(key[0])))
        if got is not None:
            found.append(got)
    found.sort(key=lambda m: (m.time_ns, m.pg_name, m.seq))
    return found


def _pylist(table: pa.Table) -> list[dict]:
    table = table.cast(
        pa.schema(
            [
                pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type) else f
                for f in table.schema
            ]
        )
    )
    return table.to_pylist()


def _check(
    key: tuple[str, int], by_rank: dict[int, dict], members: list[int]
) -> SplitMismatch | None:
    sites = {row["call_site"] for row in by_rank.values()} - {None}
    if len(sites) > 1:  # not one exchange: a rank skipped one (the skip rule's), not splits
        return None
    n = len(members)
    position = {r: i for i, r in enumerate(members)}
    sends: dict[int, list[int]] = {}
    receives: dict[int, list[int]] = {}
    for rank, row in by_rank.items():
        if rank not in position:
            continue
        ins = _splits(row["input_split_sizes"], row["input_sizes"], n)
        outs = _splits(row["output_split_sizes"], row["output_sizes"], n)
        if ins is not None:
            sends[rank] = ins
        if outs is not None:
            receives[rank] = outs
    pairs = []
    for i in sorted(sends):
        for j in sorted(receives):
            if i == j:
                continue
            sent, expected = sends[i][position[j]], receives[j][position[i]]
            if sent != expected:
                pairs.append(SplitPair(sender=i, receiver=j, sent=sent, expected=expected))
    if not pairs:
        return None
    peers: Counter[int] = Counter()
    for rank in {r for p in pairs for r in (p.sender, p.receiver)}:
        peers[rank] = len(
            {
                p.receiver if p.sender == rank else p.sender
                for p in pairs
                if rank in (p.sender, p.receiver)
            }
        )
    most = max(peers.values())
    guilty = tuple(sorted(r for r, k in peers.items() if k == most))
    rows = list(by_rank.values())
    return SplitMismatch(
        pg_name=key[0],
        seq=key[1],
        op=str(rows[0]["op"]),
        time_ns=min(int(r["time_created_ns"] or 0) for r in rows),
        pairs=tuple(pairs),
        guilty=guilty,
        tie=len(guilty) > 1,
    )


def _splits(splits: list[int] | None, sizes: str | None, n: int) -> list[int] | None:
    """A member's split list, one count per group member; an empty list is the even split
    of the op's one tensor; None where it cannot be told."""
    if splits is None:
        return None
    if splits:
        return list(splits) if len(splits) == n else None
    numel = _numel(sizes)
    if numel is None or n == 0 or numel % n:
        return None
    return [numel // n] * n


def _numel(sizes: str | None) -> int | None:
    """Elements of the one tensor of a sizes text (``[[10,3]]``); None for any other."""
    try:
        shapes = json.loads(sizes or "")
    except ValueError:
        return None
    if not isinstance(shapes, list) or len(shapes) != 1 or not isinstance(shapes[0], list):
        return None
    numel = 1
    for d in shapes[0]:
        if d.__class__ is not int or d < 0:
            return None
        numel *= d
    return numel
