"""A rank's records -> its one record, and the records -> one entries table.

A rank may have several files: older and newer dumps (the newest is kept, the others are
duplicates), or several recorders (torch 2.15 keeps one Flight Recorder per backend; their
records are of disjoint groups and together are the rank's record). Then the kept records'
entries are concatenated, and group-local P2P peers mapped to global ranks once
membership is known (``frtools.analyze.membership``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from frtools.model.ranks import format_ranks
from frtools.model.trace import InputFile, ProcessGroup, concat_entries

from .base import RankDump
from .files import FileResult
from .parallel import Spans, entries


def concat_dumps(dumps: Sequence[RankDump], spans: Spans) -> pa.Table:
    """The dumps' entries in order, a run of adjacent slices of one table taken as one."""
    pieces: list[pa.Table] = []
    run: list[Any] | None = None  # [table, start, end]
    for d in dumps:
        span = spans.get(id(d))
        if span is not None and run is not None and span[0] is run[0] and span[1] == run[2]:
            run[2] += span[2]
            continue
        if run is not None:
            pieces.append(run[0].slice(run[1], run[2] - run[1]))
            run = None
        if span is not None:
            run = [span[0], span[1], span[1] + span[2]]
        else:
            pieces.append(d.entries)
    if run is not None:
        pieces.append(run[0].slice(run[1], run[2] - run[1]))
    return concat_entries(pieces)


def newest_first(
    candidates: Iterable[tuple[FileResult, RankDump]], spans: Spans
) -> list[tuple[FileResult, RankDump]]:
    def key(c: tuple[FileResult, RankDump]) -> tuple[int, bool, int, float, str]:
        r, d = c
        entries(d, spans)
        t = d.max_time_created_ns
        # same newest op: the same moment; prefer the file with call sites (pickle over JSON),
        # then the fuller record (a black box over the summary written beside it)
        has_stacks = d.entries.column("stack").null_count < d.entries.num_rows
        return (t if t is not None else -1, has_stacks, d.entries.num_rows, r.mtime, r.input.path)

    return sorted(candidates, key=key, reverse=True)


def groups_recorded(dump: RankDump) -> set[str]:
    return set(pc.unique(dump.entries.column("pg_name")).to_pylist()) - {None}


Candidate = tuple[FileResult, RankDump]


def other_recorders(ordered: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """Split a rank's records (newest first) after the first into other recorders and older
    copies. torch 2.15 keeps one Flight Recorder per backend (Gloo's, ProcessGroupNCCL's,
    the one c10d's hook fills for nccl2): a rank on mixed groups has several records, each
    of other groups, and together they are its record. A record whose groups overlap the
    kept ones', or that holds no op, is an older or poorer copy."""
    if len(ordered) == 1:  # the common case: no per-rank scan of the groups column
        return [], []
    seen = groups_recorded(ordered[0][1])
    others, older = [], []
    for c in ordered[1:]:
        groups = groups_recorded(c[1])
        if groups and seen and not groups & seen:
            others.append(c)
            seen |= groups
        else:
            older.append(c)
    return others, older


def merge_recorders(keep: RankDump, others: list[RankDump]) -> RankDump:
    """One rank's record from several recorders' files (disjoint groups)."""
    if not others:
        return keep
    for o in others:
        for name, g in o.process_groups.items():
            if name not in keep.process_groups or (g.ranks and not keep.process_groups[name].ranks):
                keep.process_groups[name] = g
        for name, status in o.rank_info.pg_status.items():
            keep.rank_info.pg_status.setdefault(name, status)
        keep.unmapped_peer_groups |= o.unmapped_peer_groups
        keep.bad_entries += o.bad_entries
        keep.notes.extend(o.notes)
        keep.default_pg_all = keep.default_pg_all or o.default_pg_all
        keep.rank_info.wrapped = keep.rank_info.wrapped or o.rank_info.wrapped
        if o.rank_info.stacks and not keep.rank_info.stacks:
            keep.rank_info.stacks = o.rank_info.stacks
        times = [t for t in (keep.max_time_created_ns, o.max_time_created_ns) if t is not None]
        keep.max_time_created_ns = max(times) if times else None
    keep.entries = concat_entries([keep.entries, *(o.entries for o in others)])
    return keep


def map_peers(table: pa.Table, groups: dict[str, ProcessGroup], names: set[str]) -> pa.Table:
    """Group-local P2P peers -> global ranks, for groups whose file did not know members."""
    peer = table.column("peer").to_pylist()
    pg = table.column("pg_name").to_pylist()
    changed = False
    for i, (p, name) in enumerate(zip(peer, pg, strict=True)):
        if p is None or name not in names:
            continue
        g = groups.get(name)
        if g is None or not g.ranks:
            continue
        peer[i] = g.ranks[p] if 0 <= p < len(g.ranks) else None
        changed = True
    if not changed:
        return table
    idx = table.schema.get_field_index("peer")
    return table.set_column(idx, table.schema.field(idx), pa.array(peer, type=pa.int32()))


def choose(
    results: Sequence[FileResult], spans: Spans
) -> tuple[dict[int, RankDump], dict[int, InputFile]]:
    """The newest record of each rank (rank -> dump, rank -> the input it came from); the
    records of other recorders of a rank merged into it, older copies marked duplicates."""
    once: dict[int, Candidate] = {}
    for r in results:
        for d in r.dumps:
            if once.setdefault(d.rank_info.rank, (r, d))[1] is not d:
                break
        else:
            continue
        break
    else:  # every rank has one record (the usual case: 131,072 ranks, one look each)
        ranks = sorted(once)
        return {k: once[k][1] for k in ranks}, {k: once[k][0].input for k in ranks}
    by_rank: dict[int, list[Candidate]] = defaultdict(list)
    for r in results:
        for d in r.dumps:
            by_rank[d.rank_info.rank].append((r, d))
    chosen: dict[int, RankDump] = {}
    kept_inputs: dict[int, InputFile] = {}
    superseded: dict[int, list[int]] = defaultdict(list)
    owners: dict[int, FileResult] = {}
    for rank, candidates in sorted(by_rank.items()):
        ordered = newest_first(candidates, spans) if len(candidates) > 1 else candidates
        keep, dump = ordered[0]
        others, older = other_recorders(ordered) if len(ordered) > 1 else ([], [])
        if others:  # the merged record is a table of its own, no longer a slice
            spans.pop(id(dump), None)
            dump = merge_recorders(dump, [d for _, d in others])
        chosen[rank] = dump
        kept_inputs[rank] = keep.input
        for r, _ in others:
            add_reason(r.input, f"another recorder of rank {rank}, merged with {keep.input.path}")
        for r, d in older:
            if r.more:  # a file of several ranks: only this rank of it is older
                superseded[id(r)].append(rank)
                owners[id(r)] = r
                continue
            r.input.status = "duplicate"
            r.input.reason = (
                f"older dump of rank {rank}; using {keep.input.path}"
                if d.entries.num_rows
                else f"nothing beyond the other record of rank {rank}; using {keep.input.path}"
            )
            r.dump = None  # let go of the table
    for key, ranks in superseded.items():
        r = owners[key]
        if len(ranks) == len(r.dumps):
            r.input.status = "duplicate"
            r.input.reason = f"ranks {format_ranks(ranks)}: newer or fuller records are used"
        else:
            add_reason(r.input, f"ranks {format_ranks(ranks)}: newer or fuller records used")
    return chosen, kept_inputs


# A record whose newest op, and whose file, are this much older than the other ranks' is of
# an earlier run or attempt (a torchrun restart, a folder that kept an old job's dumps): a
# job's ranks stop issuing within a step of each other when it hangs, and dump within
# minutes of each other, while an attempt's dumps are written at least a collective timeout
# (10 minutes by default) after the one before.
EARLIER_RUN_NS = 15 * 60 * 1_000_000_000


def set_aside_earlier_runs(chosen: dict[int, RankDump], kept_inputs: dict[int, InputFile]) -> None:
    """Take out of ``chosen`` the records of an earlier run (``EARLIER_RUN_NS``), each file
    marked ``skipped`` with the reason: aligned with this run's, their counters and seqs
    read as GPUs that stopped or ops never issued. Only for records without a heartbeat
    (PyTorch's dumps: the black box's heartbeat says how old it is, ``diagnosis.facts``) and
    in files of one rank; both the newest op and the file's modification time must be old
    (a rank that is idle for a long while in a job of two roles still dumps with the rest)."""
    newest = {
        r: d.max_time_created_ns
        for r, d in chosen.items()
        if d.max_time_created_ns and d.rank_info.last_heartbeat_ns is None
    }
    if len(newest) < 3:
        return
    typical = float(np.median(np.fromiter(newest.values(), dtype=np.float64)))
    suspects = [r for r, t in newest.items() if t < typical - EARLIER_RUN_NS]
    if not suspects:
        return
    written = {}
    for r in newest:
        try:
            written[r] = os.stat(kept_inputs[r].path).st_mtime_ns
        except (OSError, KeyError):
            continue
    if len(written) < 3:
        return
    usual = float(np.median(np.fromiter(written.values(), dtype=np.float64)))
    shared = defaultdict(int)
    for r in chosen:
        shared[id(kept_inputs.get(r))] += 1
    for r in suspects:
        info = kept_inputs.get(r)
        if info is None or shared[id(info)] > 1 or written.get(r, usual) > usual - EARLIER_RUN_NS:
            continue
        del chosen[r], kept_inputs[r]
        info.status = "skipped"
        info.reason = (
            f"a dump of an earlier run or attempt: its newest op is {_age(typical - newest[r])} "
            f"older than the other ranks', and the file {_age(usual - written[r])} older; not used"
        )


def _age(ns: float) -> str:
    minutes = ns / 60e9
    return f"{minutes / 60:.1f} h" if minutes >= 90 else f"{minutes:.0f} min"


def add_reason(info: InputFile, reason: str) -> None:
    info.reason = f"{info.reason}; {reason}" if info.reason else reason
