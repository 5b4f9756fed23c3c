"""The step diff: what the failing training step did differently from the last good one.

Training repeats one step, so each rank's records are a period: the same sequence of
(group, op, peer, shapes, dtypes, call site) again and again, until the fault. The last
complete step before the fault is a reference the developer can read: "rank 5 issued
all_to_all_single on group 7 from model.py:88, which no rank issued in step 2".

Per rank, over its last ``WINDOW`` records (bounded work at any world size):

* **Tokens.** Each record becomes one integer from its group, op, peer, dtypes, call site
  and, where the op's sizes repeat step to step, its sizes (an all_to_all's splits and an
  object collective's byte counts change every step by design: not part of the token).
* **Period.** The step length ``p`` is the distance whose repetition ``S[i] == S[i-p]``
  spans the most records (ties: the shortest); at least two whole copies. Candidate
  distances are the ones at which the window's middle token recurs. A run that is only a
  part of a step (MoE's all_to_alls in a row, a layer's ops: a short ring holds less than a
  step) is no step: after it the rank issued more than a step's worth of ops that are mostly
  not the run's (``_loops``).
* **Divergence.** The first record after that periodic run, if any, lies in the failing
  step; the step before it is the last good one. A rank whose records simply stop inside
  the step (blocked, waiting) did nothing different: it has no change.

The change at the divergence, in the failing step's position ``k`` against the good step:

* same group, op and call site, other sizes or dtypes: ``shape`` / ``dtype``;
* the token sits later in the good step, after ops on the same group: those were skipped
  (``missing_op``); after ops on other groups only: ``order`` (the rank went ahead of them);
* otherwise ``new_op``, with whether any rank issued it in its last good step.

Only the changes of the first step that differs on any rank are kept: a job that went on past
a fault (a size mismatch Gloo let through) ends its loop later, and that end is no change.

This module decides nothing about guilt: the verdict's rules do; the diff is evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from frtools.model.codes import ranges
from frtools.model.ops import OpFamily, family_of
from frtools.model.trace import Trace

WINDOW = 512  # a rank's last records looked at: bounded work per rank at any world size
CANDIDATES = 32  # step lengths tried per rank
MAX_CHANGES = 16  # ranks whose change is listed (the rest counted)
_TOKEN_COLUMNS = (
    "pg_name",
    "op",
    "peer",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "call_site",
)
# sizes that change every step by design (MoE splits, pickled objects)
_FREE_SIZES = (OpFamily.ALL_TO_ALL, OpFamily.OBJECT)
CHANGE_KINDS = ("new_op", "missing_op", "order", "shape", "dtype")


@dataclass(kw_only=True)
class StepOp:
    """One recorded op as the step diff shows it."""

    pg_name: str
    op: str
    peer: int | None = None
    input_sizes: str = ""
    input_dtypes: str = ""
    call_site: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pg_name": self.pg_name,
            "op": self.op,
            "peer": self.peer,
            "input_sizes": self.input_sizes,
            "input_dtypes": self.input_dtypes,
            "call_site": self.call_site,
        }


@dataclass(kw_only=True)
class StepChange:
    """What one rank did differently in the failing step, at its first difference."""

    rank: int
    change: str  # one of CHANGE_KINDS
    step: int  # the failing step, counted from the first recorded step (1-based)
    position: int  # the op's place in the step (0-based)
    now: StepOp | None  # what it issued there (None: nothing, for a skip at the end)
    before: StepOp | None  # what it issued there in the last good step
    skipped: list[StepOp] = field(default_factory=list)  # missing_op / order: passed over
    issued_by_any: bool = False  # new_op: some rank issued it in its last good step

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "change": self.change,
            "step": self.step,
            "position": self.position,
            "now": self.now.to_dict() if self.now else None,
            "before": self.before.to_dict() if self.before else None,
            "skipped": [s.to_dict() for s in self.skipped],
            "issued_by_any": self.issued_by_any,
        }


@dataclass(kw_only=True)
class StepDiff:
    """The step diff of a trace: the step length per rank and every rank's change."""

    ranks_examined: int = 0
    ranks_repeating: int = 0  # ranks whose records repeat a step
    step_length: int | None = None  # the most common step length, in ops
    changes: list[StepChange] = field(default_factory=list)
    more_changes: int = 0  # ranks with a change beyond MAX_CHANGES

    @property
    def repeats(self) -> bool:
        return self.ranks_repeating > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "repeats": self.repeats,
            "ranks_examined": self.ranks_examined,
            "ranks_repeating": self.ranks_repeating,
            "step_length": self.step_length,
            "changes": [c.to_dict() for c in self.changes],
            "more_changes": self.more_changes,
            "lines": step_diff_lines(self),
        }


def _op_text(op: StepOp) -> str:
    peer = ""
    if op.peer is not None:
        peer = f" {'to' if 'send' in op.op else 'from'} rank {op.peer}"
    where = f" from {op.call_site}" if op.call_site else ""
    return f"{op.op}{peer} on group {op.pg_name}{where}"


def _ops_text(ops: list[StepOp], shown: int = 2) -> str:
    text = "; ".join(_op_text(s) for s in ops[:shown])
    return text + (f" (and {len(ops) - shown} more)" if len(ops) > shown else "")


def change_line(c: StepChange) -> str:
    """One sentence per change, naming both call sites."""
    good = c.step - 1
    if c.change in ("shape", "dtype") and c.now and c.before:
        what = "sizes" if c.change == "shape" else "dtypes"
        was = c.before.input_sizes if c.change == "shape" else c.before.input_dtypes
        now = c.now.input_sizes if c.change == "shape" else c.now.input_dtypes
        return (
            f"rank {c.rank} issued {_op_text(c.now)} with {what} {now} in step {c.step}, "
            f"{was} in step {good}"
        )
    if c.change == "missing_op":
        skipped = _ops_text(c.skipped)
        tail = f", and went on to {_op_text(c.now)}" if c.now else ""
        return f"rank {c.rank} did not issue {skipped} in step {c.step}, as it did in step {good}{tail}"
    if c.change == "order" and c.now:
        ahead = _ops_text(c.skipped)
        return (
            f"rank {c.rank} issued {_op_text(c.now)} before {ahead} in step {c.step}; "
            f"in step {good} it came after"
        )
    now = _op_text(c.now) if c.now else "nothing"
    who = (
        "it was issued in step {g} by other ranks"
        if c.issued_by_any
        else "which no rank issued in step {g}"
    )
    was = f"; in step {good} it issued {_op_text(c.before)} there" if c.before else ""
    return f"rank {c.rank} issued {now} in step {c.step}, {who.format(g=good)}{was}"


def step_diff_lines(diff: StepDiff) -> list[str]:
    """The diff in words: one line per change, or one line saying why there is none."""
    if not diff.repeats:
        return [f"no step repeats in the records ({diff.ranks_examined} ranks looked at)"]
    if not diff.changes:
        return [
            f"every rank repeated its step ({diff.step_length} ops) until it stopped: "
            "no rank did anything different in the failing step"
        ]
    lines = [change_line(c) for c in diff.changes]
    if diff.more_changes:
        lines.append(f"... and {diff.more_changes} more ranks with a change")
    return lines


def _rank_blocks(ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Each rank, its number of rows looked at (its last ``WINDOW``) and those rows' positions
    rank after rank, in record order (None: every row, as they stand). Readers write a rank's
    rows together; one pass over the rows, not one array per rank (131,072 ranks)."""
    bounds = np.flatnonzero(np.diff(ranks)) + 1
    starts = np.concatenate(([0], bounds))
    order = None
    if len(np.unique(ranks[starts])) != len(starts):  # a rank's rows are apart: gather them
        order = np.argsort(ranks, kind="stable")
        ranks = ranks[order]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(ranks)) + 1))
    ends = np.concatenate((starts[1:], [len(ranks)]))
    kept = np.maximum(starts, ends - WINDOW)
    sizes = ends - kept
    if order is None and (kept == starts).all():
        return ranks[starts], sizes, None
    rows = ranges(kept, sizes)
    return ranks[starts], sizes, rows if order is None else order[rows]


def _codes(col: pa.ChunkedArray, with_values: bool = False) -> tuple[np.ndarray, list[Any]]:
    """Dictionary codes (one dictionary for all chunks; -1 for null; int64, the caller's own
    to change) and, ``with_values``, the values."""
    if not pa.types.is_dictionary(col.type):
        if pa.types.is_integer(col.type):
            values = col.fill_null(-1).to_numpy().astype(np.int64)
            return values, []
        col = col.dictionary_encode()
    col = col.unify_dictionaries() if col.num_chunks > 1 else col
    if col.num_chunks == 0:
        return np.zeros(0, dtype=np.int64), []
    dictionary = col.chunks[0].dictionary.to_pylist() if with_values else []
    indices = pa.chunked_array([c.indices for c in col.chunks], type=col.type.index_type)
    return indices.fill_null(-1).to_numpy().astype(np.int64), dictionary


def _min_run(p: int) -> int:
    return max(2, (p + 1) // 2)


def _runs(tokens: np.ndarray, p: int) -> tuple[int, int, int]:
    """(longest run, start and length of the first long enough run) of S[i] == S[i-p]."""
    eq = tokens[p:] == tokens[:-p]
    padded = np.concatenate(([False], eq, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    lengths = edges[1::2] - edges[::2]
    enough = np.flatnonzero(lengths >= _min_run(p))
    if not enough.size:
        return 0, 0, 0
    first = int(enough[0])
    return int(lengths.max()), int(edges[2 * first]) + p, int(lengths[first])


def _period(tokens: np.ndarray, hint: int | None) -> tuple[int, int, int] | None:
    """(step length p, first index of the periodic stretch, index after it): p is the
    distance whose repetition spans the most records, the stretch the first run of it that
    holds one whole step, then at least half of it (two ops) again; None if none."""
    n = len(tokens)
    if n < 3:
        return None

    if hint is not None and hint < n:
        _, start, length = _runs(tokens, hint)
        if length:
            return hint, start - hint, start + length
    # a token seen once a step recurs at the step length: the rarest repeated tokens first
    values, counts = np.unique(tokens, return_counts=True)
    rare = values[np.argsort(counts, kind="stable")][counts[np.argsort(counts)] >= 2][:3]
    candidates: list[int] = []
    for value in rare.tolist():
        candidates += np.diff(np.flatnonzero(tokens == value)).tolist()
    for anchor in (n // 4, n // 2, (3 * n) // 4, n - 2):
        same = np.flatnonzero(tokens == tokens[anchor])
        candidates += sorted(np.abs(same - anchor).tolist())[:CANDIDATES]
    candidates = list(dict.fromkeys(d for d in candidates if 0 < d <= n // 2 + 1))[:CANDIDATES]
    best: tuple[int, int, int] | None = None
    best_span = 0
    for p in candidates:
        longest, start, length = _runs(tokens, p)
        if length and longest + p > best_span:
            best_span, best = longest + p, (p, start - p, start + length)
    return best


def step_diff(trace: Trace) -> StepDiff:
    """Every rank's step and what its failing step did differently (module docstring)."""
    table = trace.entries
    if table.num_rows == 0:
        return StepDiff()
    block_ranks, sizes, rows = _rank_blocks(table.column("rank").to_numpy())
    taken = pa.array(rows) if rows is not None else None

    def column(name: str) -> pa.ChunkedArray:
        """One column's rows in the window (taken one column at a time: it runs beside the
        alignment, whose peak memory it should add little to)."""
        col = table.column(name)
        return col.take(taken) if taken is not None else col

    # one column's codes at a time, folded into the token in place: eight int64 code arrays
    # held together were 64 bytes a row (2 GB at 16,384 ranks of 2,000 entries)
    op_codes, op_values = _codes(column("op"), with_values=True)
    free = np.array([family_of(op) in _FREE_SIZES for op in op_values] + [False])
    sized = ~free[op_codes]
    token = np.zeros(len(op_codes), dtype=np.uint64)
    for name in _TOKEN_COLUMNS:
        part = op_codes if name == "op" else _codes(column(name))[0]
        if name in ("input_sizes", "output_sizes"):
            part = np.where(sized, part, -2)
        if name == "peer":  # group and op alone: what a step's loop is made of
            loose = token.copy()
        if name == "call_site":  # the same op from another line: for moves, not for periods
            moved = token.copy()
        part += 3
        token *= np.uint64(1_000_003)
        token ^= part.view(np.uint64)
    del part, sized, op_codes

    def op_at(i: int) -> StepOp:
        """Row ``i`` of the window as a StepOp (a few rows a change: read from the table)."""

        def value(name: str) -> Any:
            return table.column(name)[int(rows[i]) if rows is not None else i].as_py()

        def text(name: str) -> str:
            v = value(name)
            return "" if v is None else str(v)

        peer = value("peer")
        if peer is None or peer < 0 or family_of(text("op")) is not OpFamily.P2P:
            peer = None
        return StepOp(
            pg_name=text("pg_name"),
            op=text("op"),
            peer=peer,
            input_sizes=text("input_sizes"),
            input_dtypes=text("input_dtypes"),
            call_site=text("call_site") or None,
        )

    diff = StepDiff(ranks_examined=len(block_ranks))
    offsets = np.cumsum(sizes) - sizes
    steps = _Steps(token, offsets, sizes)
    steps.keep(_loops(steps, loose, offsets, sizes))
    del loose
    diff.ranks_repeating = int(len(steps.block))
    uniq, counts = np.unique(steps.p, return_counts=True)
    lengths = dict(zip(uniq.tolist(), counts.tolist(), strict=True))
    if lengths:  # the most common; ties: the one a rank had first, as ranks were read
        top = max(lengths.values())
        diff.step_length = next(int(p) for p in steps.p.tolist() if lengths[p] == top)
    # the ops some rank issued in its last good step (no line): one range a rank
    fail_start = steps.first + ((steps.end - steps.first) // steps.p) * steps.p
    lo = offsets[steps.block] + np.maximum(steps.first, fail_start - steps.p)
    hi = offsets[steps.block] + fail_start
    edge = np.zeros(len(token) + 1, dtype=np.int64)
    np.add.at(edge, lo, 1)
    np.add.at(edge, hi, -1)
    good_tokens = set(np.unique(moved[np.cumsum(edge[:-1]) > 0]).tolist())
    # the failing step is the first that differs: a job that went on past it (a size
    # mismatch Gloo let through) ends its loop later, and that end is no change. Only the
    # changes listed are worked out (at 131,072 ranks every rank may have one)
    ends = steps.end < sizes[steps.block]
    step_of = (steps.end - steps.first) // steps.p + 1
    failing = int(step_of[ends].min()) if ends.any() else 0
    listed = np.flatnonzero(ends & (step_of == failing))
    diff.changes = []
    for i in listed[:MAX_CHANGES].tolist():
        k = int(steps.block[i])
        offset, n = int(offsets[k]), int(sizes[k])
        positions = np.arange(offset, offset + n)
        p, first, end = int(steps.p[i]), int(steps.first[i]), int(steps.end[i])
        diff.changes.append(
            _change(
                int(block_ranks[k]), p, first, end, positions, (token, moved), op_at, good_tokens
            )
        )
    diff.more_changes = max(0, len(listed) - MAX_CHANGES)
    return diff


def _loops(steps: _Steps, loose: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per rank that repeats a step, whether that step is the loop the rank runs.

    A rank's step is the training step only if what it did after the periodic stretch is
    mostly made of the step's ops (their group and op: a changed size or call site is a
    change, not another program). A short window repeats parts of a step (three all_to_alls
    of MoE token dispatch in a row, a layer's ops): their "divergence" is the program going on
    to its next part, and a rank that then issued more than a step's worth of ops the "step"
    never holds did not run that loop. A rank whose records stop within a step of the
    divergence (it blocked) keeps its step."""
    first = offsets[steps.block] + steps.first
    start = offsets[steps.block] + steps.end
    tail = sizes[steps.block] - steps.end
    long = np.flatnonzero(tail > steps.p)
    keep = np.ones(len(steps.block), dtype=bool)
    if not long.size:
        return keep

    owners = np.arange(len(long))
    step_rows, step_of = ranges(first[long], steps.p[long]), np.repeat(owners, steps.p[long])
    tail_rows, tail_of = ranges(start[long], tail[long]), np.repeat(owners, tail[long])

    def keyed(rows: np.ndarray, of: np.ndarray) -> np.ndarray:
        """(rank, group and op) as one value: the loose token mixed with the rank's index."""
        return loose[rows] ^ (of.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))

    explained = np.isin(keyed(tail_rows, tail_of), keyed(step_rows, step_of))
    counted = np.bincount(tail_of[explained], minlength=len(long))
    keep[long] = 2 * counted >= tail[long]
    return keep


class _Steps:
    """Every rank's ``_period``, as ranks one after another would find it: each rank first
    tries the step length the rank before it had (the hint), then searches. The hinted answer
    is worked out for all ranks at once (a job's ranks mostly share one step length: one pass
    over all their tokens, not a few numpy calls a rank at 131,072 ranks), and a stretch of
    ranks it answers is taken in one go. At most ``_LENGTHS`` lengths are tried this way;
    past that, rank by rank. ``block``, ``p``, ``first``, ``end``: the ranks that repeat a
    step (their index among the blocks), in order."""

    _LENGTHS = 4

    def __init__(self, token: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.token, self.offsets, self.sizes = token, offsets, sizes
        self._tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        hint: int | None = None
        b, blocks = 0, len(sizes)
        while b < blocks:
            table = self._table(hint) if hint is not None else None
            if table is not None:
                last, first, end = table
                stop = int(last[b])
                if stop > b:  # ranks b..stop-1 take the hint as it is
                    parts.append((np.arange(b, stop), np.full(stop - b, hint), first[b:stop],
                                  end[b:stop]))  # fmt: skip
                    b = stop
                    continue
            found = self._one(b, hint, table is None)
            if found is not None:
                hint = found[0]
                parts.append(tuple(np.array([v]) for v in (b, *found)))  # type: ignore[arg-type]
            b += 1
        none = [np.zeros(0, dtype=np.int64)] * 4
        columns = [np.concatenate(c) for c in zip(*parts, strict=True)] if parts else none
        self.block, self.p, self.first, self.end = columns

    def keep(self, mask: np.ndarray) -> None:
        """Only the ranks ``mask`` keeps repeat a step."""
        self.block, self.p, self.first, self.end = (
            self.block[mask], self.p[mask], self.first[mask], self.end[mask])  # fmt: skip

    def _one(self, b: int, hint: int | None, try_hint: bool) -> tuple[int, int, int] | None:
        offset, n = int(self.offsets[b]), int(self.sizes[b])
        return _period(self.token[offset : offset + n], hint if try_hint else None)

    def _table(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Per block, for step length ``p``: the first block at or after it that ``p`` does
        not answer, and ``p``'s (first, end) there; None past ``_LENGTHS`` lengths."""
        got = self._tables.get(p)
        if got is None and len(self._tables) < self._LENGTHS:
            got = self._tables[p] = self._all(p)
        return got

    def _all(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the first long enough run of S[i] == S[i-p] of each block starts and ends,
        as ``_period`` gives it for a hint (runs never cross blocks: a block's first p
        records compare with nothing)."""
        token, offsets, sizes = self.token, self.offsets, self.sizes
        blocks = len(sizes)
        within = np.arange(len(token)) - np.repeat(offsets, sizes)  # index inside the block
        same = np.zeros(len(token), dtype=bool)
        same[p:] = token[p:] == token[:-p]
        same &= within >= p
        padded = np.concatenate(([False], same, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, run = edges[::2], edges[1::2] - edges[::2]
        keep = run >= _min_run(p)
        starts, run = starts[keep], run[keep]
        block = np.searchsorted(offsets, starts, side="right") - 1
        block, at = np.unique(block, return_index=True)  # each block's first such run
        start = within[starts[at]]  # the run's first record, inside its block
        first = np.zeros(blocks, dtype=np.int64)
        end = np.zeros(blocks, dtype=np.int64)
        first[block] = start - p
        end[block] = start + run[at]
        ok = np.zeros(blocks, dtype=bool)
        ok[block] = True
        ok &= (sizes >= 3) & (sizes > p)
        # for every block, the first block from it on that p does not answer
        index = np.where(ok, blocks, np.arange(blocks))
        last = np.minimum.accumulate(index[::-1])[::-1]
        return last, first, end


def _change(
    rank: int,
    p: int,
    first: int,
    end: int,
    positions: np.ndarray,
    tokens: tuple[np.ndarray, np.ndarray],
    op_at: Any,
    good_tokens: set[int],
) -> StepChange:
    """The change at the first record after the periodic run (module docstring)."""
    token, moved = tokens
    seq = token[positions]
    fail_start = first + ((end - first) // p) * p
    k = end - fail_start  # the divergence's place in the failing step
    good = seq[fail_start - p : fail_start]
    fail = seq[fail_start:]
    step = (fail_start - first) // p + 1
    now_i = int(positions[end])
    now, before = op_at(now_i), op_at(int(positions[fail_start - p + k]))
    later = np.flatnonzero(good[k + 1 :] == fail[k])
    if not later.size:  # the same op from another line, issued earlier than last step
        shifted = moved[positions]
        later = np.flatnonzero(shifted[fail_start - p + k + 1 : fail_start] == shifted[end])
    if later.size:
        m = k + 1 + int(later[0])
        passed = [op_at(int(positions[fail_start - p + j])) for j in range(k, m)]
        same_group = any(s.pg_name == now.pg_name for s in passed)
        return StepChange(
            rank=rank,
            change="missing_op" if same_group else "order",
            step=step,
            position=k,
            now=now,
            before=before,
            skipped=[s for s in passed if s.pg_name == now.pg_name] if same_group else passed,
        )
    if (now.pg_name, now.op, now.call_site, now.peer) == (
        before.pg_name,
        before.op,
        before.call_site,
        before.peer,
    ):
        kind = "dtype" if now.input_dtypes != before.input_dtypes else "shape"
        return StepChange(rank=rank, change=kind, step=step, position=k, now=now, before=before)
    return StepChange(
        rank=rank,
        change="new_op",
        step=step,
        position=k,
        now=now,
        before=before,
        issued_by_any=int(moved[now_i]) in good_tokens,
    )
