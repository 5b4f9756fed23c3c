"""The timeline as Chrome trace-event JSON: opens in ui.perfetto.dev and chrome://tracing.

Layout (the JSON Object Format of the Trace Event Format document):

* one process per rank (``pid`` = global rank), named ``rank R · host`` (``process_name``)
  and sorted by rank (``process_sort_index``); the guilty and waiting ranks say so in
  their name;
* one thread per process group (``tid`` = 1 + the group's index, the same on every rank),
  named ``pg NAME (desc)`` (``thread_name``);
* each op a complete event (``ph: "X"``) from enqueue to completion, or to the dumps' time
  when it never completed; ``cname`` colours it by state; ``args`` carry sequence ids,
  sizes, dtypes, state and the call site;
* global instant events (``ph: "i"``, ``s: "g"``) at the hang point and at the verdict.

Timestamps are microseconds (``ts``, ``dur``; decimals keep nanoseconds) from the earliest
op written; ``otherData.time_origin_ns`` says when that was (Unix epoch, ns). The events are
written one by one to the output: 4,096 ranks x 100 ops is 400 k events, too many to hold
as Python dicts first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import IO, Any

import numpy as np

from frtools import __version__
from frtools.analyze.align import Alignment
from frtools.analyze.reporters import views
from frtools.analyze.verdict import Verdict
from frtools.model.trace import Trace

DEFAULT_LAST = 100
# events written by default, all ranks together (about 300 bytes each): past that, fewer
# ops per rank, never fewer than MIN_LAST
EVENT_BUDGET = 200_000
MIN_LAST = 16


def default_last(n_ranks: int) -> int:
    """Ops per rank by default: 100, fewer at scale (4,096 ranks: 48)."""
    return max(MIN_LAST, min(DEFAULT_LAST, EVENT_BUDGET // max(1, n_ranks)))


# chrome://tracing's reserved colour names (Perfetto colours by name and ignores them)
CNAME = {
    views.COMPLETED: "good",
    views.NOT_COMPLETED: "bad",
    views.COMPLETION_UNKNOWN: "grey",
}
VERDICT_CNAME = "terrible"
# tracks per process group and rank: async ops of one group may overlap without nesting
# (op n+1 enqueued before op n completed), which a track cannot show; they go to the
# group's next track
LANES = 8


def write(
    out: IO[str],
    verdict: Verdict,
    trace: Trace,
    alignment: Alignment,
    *,
    last: int | None = None,
    ranks: Iterable[int] | None = None,
) -> int:
    """Write the trace-event document to ``out``; returns the number of op slices.

    ``last``: ops per rank, newest first (0: every recorded op; None: ``default_last``);
    ``ranks``: only these."""
    point = views.hang_point(trace, alignment, verdict)
    chosen = None if ranks is None else set(int(r) for r in ranks)
    if last is None:
        last = default_last(len(chosen) if chosen is not None else len(trace.ranks))
    n_entries = trace.entries.num_rows
    ops = views.recent_ops(
        trace, alignment, last if last > 0 else max(1, n_entries), point.end_ns, chosen
    )
    pmap_groups = sorted(
        set(alignment.members) | set(trace.process_groups) | set(ops["pg_name"].unique()),
        key=_name_key,
    )
    tid_of = {name: (i + 1) * LANES for i, name in enumerate(pmap_groups)}
    if len(ops):
        ops = ops.assign(tid=_tids(ops, tid_of))
    origin = int(ops["start_ns"].min()) if len(ops) else point.end_ns
    if point.hang_ns is not None:
        origin = min(origin, point.hang_ns)

    def us(ns: int | float) -> float:
        return round((float(ns) - origin) / 1e3, 3)

    guilty = set(verdict.guilty_ranks)
    waiting = set(verdict.waiting)
    all_ranks = sorted(
        (set(trace.ranks) | set(ops["rank"].unique().tolist()))
        if chosen is None
        else chosen & (set(trace.ranks) | set(ops["rank"].unique().tolist()))
    )
    out.write('{"displayTimeUnit":"ms","otherData":')
    out.write(
        json.dumps(
            {
                "tool": f"frtools {__version__}",
                "time_origin_ns": origin,
                "end_ns": point.end_ns,
                "end_is_dump_time": point.end_is_dump_time,
                "verdict": verdict.to_dict(),
            },
            separators=(",", ":"),
        )
    )
    out.write(',"traceEvents":[\n')
    first = True

    def emit(event: dict[str, Any]) -> None:
        nonlocal first
        if not first:
            out.write(",\n")
        first = False
        out.write(json.dumps(event, separators=(",", ":")))

    for r in all_ranks:
        info = trace.ranks.get(r)
        name = f"rank {r}" + (f" · {info.host}" if info is not None and info.host else "")
        if r in guilty:
            name += " · GUILTY"
        elif r in waiting:
            name += " · waiting"
        emit({"ph": "M", "pid": r, "tid": 0, "name": "process_name", "args": {"name": name}})
        emit(
            {"ph": "M", "pid": r, "tid": 0, "name": "process_sort_index", "args": {"sort_index": r}}
        )
    threads = ops[["rank", "pg_name", "tid"]].drop_duplicates() if len(ops) else []
    for r, pg_name, tid in threads.itertuples(index=False) if len(threads) else ():
        pg = trace.process_groups.get(pg_name)
        label = f"pg {pg_name}" + (f" ({pg.desc})" if pg is not None and pg.desc else "")
        lane = int(tid) % LANES
        if lane:
            label += f" (overlapping ops, lane {lane + 1})"
        emit(
            {
                "ph": "M",
                "pid": int(r),
                "tid": int(tid),
                "name": "thread_name",
                "args": {"name": label},
            }
        )
        emit(
            {
                "ph": "M",
                "pid": int(r),
                "tid": int(tid),
                "name": "thread_sort_index",
                "args": {"sort_index": int(tid)},
            }
        )

    vg = verdict.process_group.name if verdict.process_group is not None else None
    count = 0
    if len(ops):
        count = _write_slices(out, ops, verdict, vg, tid_of, origin, first)
        first = False

    anchor = all_ranks[0] if all_ranks else 0
    if point.hang_ns is not None:
        emit(
            {
                "ph": "i",
                "s": "g",
                "pid": anchor,
                "tid": 0,
                "ts": us(point.hang_ns),
                "name": point.label or "hang",
                "cat": "frtools",
                "cname": VERDICT_CNAME,
                "args": {"waiting": len(verdict.waiting), "guilty": verdict.guilty_ranks},
            }
        )
    emit(
        {
            "ph": "i",
            "s": "g",
            "pid": anchor,
            "tid": 0,
            "ts": us(point.end_ns),
            "name": f"verdict: {verdict.kind.upper()} {verdict.headline}",
            "cat": "frtools",
            "cname": "good" if verdict.kind == "healthy" else VERDICT_CNAME,
            "args": verdict.to_dict(),
        }
    )
    out.write("\n]}\n")
    return count


def _write_slices(
    out: IO[str],
    ops: Any,
    verdict: Verdict,
    vg: str | None,
    tid_of: dict[str, int],
    origin: int,
    first: bool,
) -> int:
    """The op slices, formatted directly (400 k events: a dict and a ``json.dumps`` per
    event cost 10x more); every string goes through ``json.dumps`` once and is reused."""
    encoded: dict[str, str] = {}

    def js(text: str | None) -> str:
        if text is None or text == "":
            return "null"
        value = encoded.get(text)
        if value is None:
            value = encoded[text] = json.dumps(text)
        return value

    start = ops["start_ns"].to_numpy(dtype=np.int64)
    end = ops["end_ns"].to_numpy(dtype=np.int64)
    ts = np.round((start - origin) / 1e3, 3).tolist()
    dur = np.round(np.maximum(end - start, 0) / 1e3, 3).tolist()
    cols = {
        c: ops[c].tolist()
        for c in (
            "rank",
            "tid",
            "pg_name",
            "op",
            "seq",
            "is_p2p",
            "peer",
            "record_id",
            "input_sizes",
            "output_sizes",
            "input_dtypes",
            "state",
            "completion",
            "end_known",
            "call_site",
        )
    }
    ends = {
        views.COMPLETED: json.dumps(
            "completion time not recorded: drawn until the rank's next op (its newest op: "
            "zero length)"
        ),
        views.NOT_COMPLETED: json.dumps("never completed: drawn to the dumps' time"),
        views.COMPLETION_UNKNOWN: json.dumps("unknown: drawn to the dumps' time"),
    }
    about = json.dumps(f"{verdict.kind}: the op the verdict is about")
    judged = verdict.kind != "healthy" and vg is not None
    lines = []
    for j in range(len(ts)):
        pg_name = cols["pg_name"][j]
        is_p2p = cols["is_p2p"][j]
        seq = cols["seq"][j]
        completion = cols["completion"][j]
        verdict_op = (
            judged
            and pg_name == vg
            and seq == (verdict.p2p_seq_id if is_p2p else verdict.collective_seq_id)
        )
        op = cols["op"][j] or "?"
        sizes = cols["input_sizes"][j]
        if cols["output_sizes"][j] and cols["output_sizes"][j] != sizes:
            sizes = f"{sizes or '?'} -> {cols['output_sizes'][j]}"
        args = (
            f'"process_group":{js(pg_name)},'
            f'"{"p2p_seq_id" if is_p2p else "collective_seq_id"}":{seq},'
            + (f'"peer":{cols["peer"][j]},' if is_p2p and cols["peer"][j] >= 0 else "")
            + f'"record_id":{cols["record_id"][j]},"state":{js(cols["state"][j])},'
            + ("" if completion == cols["state"][j] else f'"completed":{js(completion)},')
            + f'"sizes":{js(sizes)},'
            f'"dtypes":{js(cols["input_dtypes"][j])},"call_site":{js(cols["call_site"][j])}'
            + ("" if cols["end_known"][j] else f',"end":{ends[completion]}')
            + (f',"verdict":{about}' if verdict_op else "")
        )
        name = js(op)[:-1] + f' #{seq}"'
        lines.append(
            f'{{"ph":"X","pid":{cols["rank"][j]},"tid":{cols["tid"][j]},'
            f'"ts":{ts[j]},"dur":{dur[j]},"name":{name},'
            f'"cat":"{"p2p" if is_p2p else "collective"}",'
            f'"cname":"{VERDICT_CNAME if verdict_op else CNAME[completion]}","args":{{{args}}}}}'
        )
        if len(lines) >= 4096:
            out.write(("" if first else ",\n") + ",\n".join(lines))
            first = False
            lines = []
    if lines:
        out.write(("" if first else ",\n") + ",\n".join(lines))
    return len(ts)


def _tids(ops: Any, tid_of: dict[str, int]) -> list[int]:
    """A track per op: its group's, or the group's next one where it would overlap an op
    of that track without nesting in it (ops come oldest first per rank). Each track keeps
    the stack of its open slices' ends, as a viewer nests them."""
    tids = []
    tracks: dict[tuple[int, int], list[list[int]]] = {}
    for rank, pg_name, start, end in zip(
        ops["rank"].tolist(),
        ops["pg_name"].tolist(),
        ops["start_ns"].tolist(),
        ops["end_ns"].tolist(),
        strict=True,
    ):
        base = tid_of.get(pg_name, 0)
        lanes = tracks.setdefault((rank, base), [])
        chosen = None
        for lane, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                chosen = lane
                break
        if chosen is None:
            if len(lanes) < LANES:
                lanes.append([])
            chosen = len(lanes) - 1  # past LANES tracks, the last one takes the rest
        lanes[chosen].append(end)
        tids.append(base + chosen)
    return tids


def _name_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))
