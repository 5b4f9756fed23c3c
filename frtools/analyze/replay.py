"""``frtools replay``: a Trace's last ops as one self-contained Python script (torch only).

The script replays, on a local Gloo job, each rank's recorded collectives and P2P ops from a
window before the fault: the same groups, order, shapes and dtypes, and then the way each
rank stopped (it sleeps where the real one hung; a rank that died exits the way it died).
``python repro.py --dir D`` runs it with frtools' recorder on and collects the records into
``D`` as ``frtools dump`` would, so ``frtools analyze D`` can be compared with the original.

**A dump cannot write code.** The script is a fixed template (``_TEMPLATE``, written here)
followed by data; the data holds only ints, ``None`` and strings, and every string taken from
a dump (group names and descriptions, op names, call sites, hosts, exit details) is written
with ``repr``. Op kinds and dtypes are chosen from closed sets (``_KINDS``, ``_DTYPES``);
anything else becomes a named fallback. The script reads no file but its own.

The window: per process group, its last ``window`` collectives (by ``collective_seq_id``,
never before the first one every member still holds), and per sender/receiver pair the last
``window`` sends and receives (matched by order, as align matches them). Every member keeps
the same ops, so the replay meets where the job met and stops where it stopped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from frtools.model.ops import OpFamily, family_of
from frtools.model.trace import Trace, is_default

DEFAULT_WINDOW = 64
MAX_ELEMENTS = 1 << 20  # --scale auto: the largest replayed tensor holds at most this many
_MAX_DIM = 1 << 31

# recorded op name -> what the script calls (a closed set: the template knows each one)
_KINDS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "_broadcast_oop": "broadcast",
    "reduce": "reduce",
    "_reduce_oop": "reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
}
FALLBACK_KIND = "all_reduce"  # an op the template does not know: an all_reduce of its input
# recorded dtype name -> torch attribute (closed set)
_DTYPES: dict[str, str] = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Int": "int32",
    "Long": "int64",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}
FALLBACK_DTYPE = "float32"
# how a dead rank ends, by its recorded exit kind; a signal from this set, else SIGKILL
_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGKILL", "SIGTERM")
_SKIPPED_OPS = frozenset({"coalesced", "batch_isend_irecv", "split", "new_window"})


class ReplayError(ValueError):
    """The records cannot be replayed as asked (no entries, ranks outside the job)."""


@dataclass(kw_only=True)
class ReplayOp:
    kind: str  # one of _KINDS' values
    label: str  # the recorded op name (a repr literal in the script)
    group: int  # index into the plan's groups
    inputs: list[tuple[int, ...]]
    outputs: list[tuple[int, ...]]
    dtype: str  # one of _DTYPES' values
    peer: int | None = None  # replay rank of a P2P peer
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    call_site: tuple[str, int, str] | None = None  # (file, line, function) it was issued from


@dataclass(kw_only=True)
class ReplayPlan:
    world: int
    ranks: list[int]  # original global rank of each replay rank
    groups: list[tuple[str, str, tuple[int, ...]]]  # (name, desc, replay member ranks)
    default_group: int | None
    ops: dict[int, list[ReplayOp]]
    endings: dict[int, tuple[str, str]]  # replay rank -> (how, detail)
    window: int
    scale: float
    fallbacks: list[str] = field(default_factory=list)
    dropped_p2p: int = 0


def _shapes(text: Any, scale: float) -> list[tuple[int, ...]]:
    """``"[[4,2],[3]]"`` -> shapes, each dimension scaled (ceil, at least 1); hostile text
    gives no shapes."""
    if not isinstance(text, str) or not text:
        return []
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(value, list):
        return []
    out = []
    for shape in value[:64]:
        if not isinstance(shape, list) or len(shape) > 8:
            return []
        dims = []
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < _MAX_DIM:
                return []
            dims.append(d if scale >= 1 or d == 0 else max(1, math.ceil(d * scale)))
        out.append(tuple(dims))
    return out


def _numel(shapes: list[tuple[int, ...]]) -> int:
    return max((math.prod(s) for s in shapes), default=0)


def _scaled(shapes: list[tuple[int, ...]], scale: float) -> list[tuple[int, ...]]:
    if scale >= 1:
        return shapes
    return [tuple(d if d == 0 else max(1, math.ceil(d * scale)) for d in s) for s in shapes]


def _row_splits(value: Any, shape: tuple[int, ...], scale: float) -> list[int] | None:
    """Recorded split sizes (elements per member) as rows of ``shape`` (what
    ``all_to_all_single`` takes), scaled; None (an even split) where they are not whole rows."""
    if value is None or not shape:
        return None
    try:
        items = [int(v) for v in value][:4096]
    except (TypeError, ValueError):
        return None
    row = math.prod(shape[1:])
    if row <= 0 or any(v < 0 or v >= _MAX_DIM or v % row for v in items):
        return None
    rows = [v // row for v in items]
    return rows if scale >= 1 else [r if r == 0 else max(1, math.ceil(r * scale)) for r in rows]


def _site(text: Any) -> tuple[str, int, str] | None:
    """``"train.py:516 in run"`` -> ``("train.py", 516, "run")``; None where it is not one."""
    if not isinstance(text, str) or " in " not in text:
        return None
    where, name = text.rsplit(" in ", 1)
    file, _, line = where.rpartition(":")
    if not file or not line.isdigit() or not 0 < int(line) < 10_000_000:
        return None
    return (file[:4096], int(line), name[:256])


def _pg_order(name: str) -> tuple[int, int, str]:
    return (0, int(name), "") if name.isdigit() and len(name) < 12 else (1, 0, name)


def _members(trace: Trace, rows: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    seen: dict[str, set[int]] = {}
    for pg, rank in zip(rows["pg_name"], rows["rank"], strict=True):
        if pg is not None:
            seen.setdefault(pg, set()).add(int(rank))
    members = {}
    for name in set(seen) | set(trace.process_groups):
        pg = trace.process_groups.get(name)
        ranks = (
            tuple(pg.ranks) if pg is not None and pg.ranks else tuple(sorted(seen.get(name, ())))
        )
        if ranks:
            members[name] = ranks
    return members


def auto_scale(trace: Trace) -> float:
    """The scale that keeps the largest recorded tensor at or under ``MAX_ELEMENTS``."""
    largest = 0
    for text in set(trace.entries.column("input_sizes").to_pylist()):
        largest = max(largest, _numel(_shapes(text, 1.0)))
    return 1.0 if largest <= MAX_ELEMENTS else MAX_ELEMENTS / largest


def plan_replay(
    trace: Trace,
    window: int = DEFAULT_WINDOW,
    ranks: tuple[int, ...] | None = None,
    scale: float | None = None,
) -> ReplayPlan:
    """What each rank replays (module docstring); ``ranks`` renumbers a subset 0..n-1."""
    table = trace.entries
    if table.num_rows == 0 and not trace.ranks:
        raise ReplayError("the records hold no op to replay")
    if window < 1:
        raise ReplayError("--window must be at least 1")
    world = list(trace.expected_ranks)
    chosen = sorted(set(ranks)) if ranks else world
    outside = [r for r in chosen if r not in world]
    if outside:
        raise ReplayError(f"rank {outside[0]} is not in the job (world size {len(world)})")
    new_rank = {r: i for i, r in enumerate(chosen)}
    scale = auto_scale(trace) if scale is None else scale
    cols = (
        "rank", "record_id", "pg_name", "collective_seq_id", "op", "peer", "input_sizes",
        "output_sizes", "input_dtypes", "call_site", "input_split_sizes", "output_split_sizes",
    )  # fmt: skip
    rows = {c: table.column(c).to_pylist() for c in cols}
    members = _members(trace, rows)
    names = sorted(members, key=_pg_order)
    groups, index = [], {}
    default = None
    for name in names:
        kept = tuple(new_rank[r] for r in members[name] if r in new_rank)
        if not kept:
            continue
        pg = trace.process_groups.get(name)
        desc = pg.desc if pg is not None else ""
        index[name] = len(groups)
        if default is None and is_default(name, desc) and len(kept) == len(chosen):
            default = len(groups)
        groups.append((name, desc, kept))
    n = len(rows["rank"])
    order = sorted(range(n), key=lambda i: (rows["rank"][i], rows["record_id"][i] or 0, i))
    # the window: per group its last `window` seqs that every member still holds
    first: dict[tuple[str, int], int] = {}
    last: dict[str, int] = {}
    p2p_count: dict[tuple[str, int, int, str], int] = {}
    kind_of: list[str | None] = [None] * n
    for i in order:
        op, pg = rows["op"][i] or "", rows["pg_name"][i]
        if op in _SKIPPED_OPS or pg not in index:
            continue
        family = family_of(op)
        kind_of[i] = _KINDS.get(op, FALLBACK_KIND)
        if family is OpFamily.P2P:
            continue
        seq = rows["collective_seq_id"][i] or 0
        key = (pg, rows["rank"][i])
        first[key] = min(first.get(key, seq), seq)
        last[pg] = max(last.get(pg, 0), seq)
    start = {pg: last[pg] - window + 1 for pg in last}
    for (pg, _), seq in first.items():
        start[pg] = max(start[pg], seq)
    plan = ReplayPlan(
        world=len(chosen), ranks=chosen, groups=groups, default_group=default, ops={},
        endings={}, window=window, scale=scale,
    )  # fmt: skip
    # P2P: the k-th send s->p pairs with the k-th recv at p from s; keep the last `window`
    p2p_index: dict[int, tuple[str, int, int, str, int]] = {}
    for i in order:
        kind = kind_of[i]
        if kind not in ("send", "recv") or rows["peer"][i] is None:
            continue
        rank, peer = rows["rank"][i], int(rows["peer"][i])
        sender, receiver = (rank, peer) if kind == "send" else (peer, rank)
        key = (rows["pg_name"][i], sender, receiver, kind)
        k = p2p_count.get(key, 0)
        p2p_count[key] = k + 1
        p2p_index[i] = (*key, k)
    p2p_start: dict[tuple[str, int, int], int] = {}
    for (pg, s, r, _), count in p2p_count.items():
        p2p_start[(pg, s, r)] = max(p2p_start.get((pg, s, r), 0), count - window)
    for rank in chosen:
        plan.ops[new_rank[rank]] = []
    for i in order:
        kind, rank = kind_of[i], rows["rank"][i]
        if kind is None or rank not in new_rank:
            continue
        pg = rows["pg_name"][i]
        peer = None
        if kind in ("send", "recv"):
            if i not in p2p_index:
                continue
            _, s, r, _, k = p2p_index[i]
            if k < p2p_start[(pg, s, r)]:
                continue
            other = r if kind == "send" else s
            if other not in new_rank or new_rank[other] not in groups[index[pg]][2]:
                plan.dropped_p2p += 1
                continue
            peer = new_rank[other]
        elif (rows["collective_seq_id"][i] or 0) < start.get(pg, 0):
            continue
        op = rows["op"][i] or ""
        if op not in _KINDS:
            plan.fallbacks.append(f"op {op!r} replayed as {FALLBACK_KIND}")
        dtypes = (rows["input_dtypes"][i] or "").split(",")
        dtype = _DTYPES.get(dtypes[0])
        if dtype is None:
            plan.fallbacks.append(f"dtype {dtypes[0]!r} replayed as {FALLBACK_DTYPE}")
            dtype = FALLBACK_DTYPE
        inputs, outputs = (
            _shapes(rows["input_sizes"][i], 1.0),
            _shapes(rows["output_sizes"][i], 1.0),
        )
        in_splits = out_splits = None
        if kind in ("all_to_all", "all_to_all_single") and len(inputs) == 1 == len(outputs):
            kind = "all_to_all_single"  # one tensor each way: the single form, split by rows
            in_splits = _row_splits(rows["input_split_sizes"][i], inputs[0], scale)
            out_splits = _row_splits(rows["output_split_sizes"][i], outputs[0], scale)
        plan.ops[new_rank[rank]].append(
            ReplayOp(
                kind=kind,
                label=op,
                group=index[pg],
                dtype=dtype,
                peer=peer,
                inputs=_scaled(inputs, scale),
                outputs=_scaled(outputs, scale),
                input_splits=in_splits,
                output_splits=out_splits,
                call_site=_site(rows["call_site"][i]),
            )  # fmt: skip
        )
    for rank in chosen:
        plan.endings[new_rank[rank]] = _ending(trace, rank)
    plan.fallbacks = sorted(set(plan.fallbacks))
    return plan


def _ending(trace: Trace, rank: int) -> tuple[str, str]:
    """How the replayed rank stops after its last op: ``sleep`` (it hung there), ``before``
    (it never reached init_process_group), ``exit`` / ``kill`` / ``signal`` / ``raise``
    (it died so), ``return`` (it finished)."""
    info = trace.ranks.get(rank)
    if info is None:
        return ("sleep", "no record of this rank: it joins the groups and stops")
    if info.startup_phase == "started":  # the others, inside init, block there by themselves
        return ("before", "it never called init_process_group")
    kind, detail = info.exit_kind, info.exit_detail or ""
    if kind == "killed":
        return ("kill", "gone without a word (SIGKILL)")
    if kind == "signal":
        name = detail if detail in _SIGNALS else "SIGKILL"
        return ("signal", name)
    if kind in ("exit", "os_exit"):
        return ("exit", detail)
    if kind == "exception":
        return ("raise", detail)
    if kind == "clean":
        return ("return", "")
    return ("sleep", "")


def _literal(value: Any) -> str:
    """Python source for plain data: ints, floats, None, bools, strings (``repr``), and
    tuples/lists of them. Anything else is refused: nothing else can enter the script."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else "1.0"
    if isinstance(value, str):
        return repr(str(value))
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    raise TypeError(f"not replay data: {type(value).__name__}")


def render_script(plan: ReplayPlan, source: str = "") -> str:
    """The script: the fixed template, then the plan as literals."""
    ops = {}
    for rank, items in plan.ops.items():
        ops[rank] = [
            (
                o.kind,
                o.label,
                o.group,
                tuple(o.inputs),
                tuple(o.outputs),
                o.dtype,
                o.peer,
                tuple(o.input_splits) if o.input_splits is not None else None,
                tuple(o.output_splits) if o.output_splits is not None else None,
                o.call_site,
            )  # fmt: skip
            for o in items
        ]
    lines = [
        f"WORLD = {_literal(plan.world)}",
        f"ORIGINAL_RANKS = {_literal(list(plan.ranks))}",
        f"SOURCE = {_literal(source)}",
        f"DEFAULT_GROUP = {_literal(plan.default_group)}",
        "# (name, description, members) in creation order; members are replay ranks",
        "GROUPS = [",
        *(f"    {_literal(g)}," for g in plan.groups),
        "]",
        "# rank -> how it stops after its last op",
        "ENDINGS = {",
        *(f"    {_literal(r)}: {_literal(e)}," for r, e in sorted(plan.endings.items())),
        "}",
        "# rank -> ops: (kind, recorded op, group, input shapes, output shapes, dtype, peer,",
        "#               input splits, output splits, call site)",
        "OPS = {",
    ]
    for rank in sorted(ops):
        lines.append(f"    {_literal(rank)}: [")
        lines += [f"        {_literal(op)}," for op in ops[rank]]
        lines.append("    ],")
    lines.append("}")
    counts = ", ".join(f"{len(v)}" for _, v in sorted(plan.ops.items()))
    header = _HEADER.format(
        world=plan.world,
        window=plan.window,
        scale=f"{plan.scale:.6g}",
        counts=counts,
        subset="yes, renumbered 0.." + str(plan.world - 1)
        if plan.ranks != list(range(plan.world))
        else "no",
        fallbacks=len(plan.fallbacks),
        dropped=plan.dropped_p2p,
    )
    return header + "\n".join(lines) + "\n" + _TEMPLATE


_HEADER = '''#!/usr/bin/env python3
# Written by `frtools replay`: the recorded collectives and P2P ops of a hung job, replayed on
# a local Gloo job of {world} processes (torch only; `--dir D` also needs frtools, to record).
#
#   python repro.py                  replay it and report whether it hangs
#   python repro.py --dir D          the same under frtools' recorder, collected into D
#                                    (then: frtools analyze D)
#
# Kept: every rank's ops of the window (the last {window} collectives of each process group
# and the last {window} sends/receives of each pair), in the recorded order, on the same
# groups, with the recorded shapes (scaled by {scale}) and dtypes; and how each rank stopped:
# it sleeps where the real one hung, exits where it died. Ops per rank: {counts}. Subset of
# ranks: {subset}. Ops or dtypes replayed by a fallback: {fallbacks}. P2P ops dropped (peer
# outside the subset): {dropped}.
# Simplified: no model, no data, no compute: tensors are ones; the timing between ops is not
# kept (a straggler does not straggle); a broadcast/reduce/gather/scatter root is the
# group's first member (the records do not keep roots); isend/irecv and batched P2P run as
# blocking send/recv; a coalesced block runs as its ops one by one.
#
# This file holds data only below: every string from the records is a Python literal.
"""A replay of recorded collectives (frtools replay). Run: python repro.py [--dir D]."""

'''

_TEMPLATE = r'''

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

JOB_ID = "replay"


def _touch(work, name):
    path = os.path.join(work, name)
    with open(path, "a"):
        pass
    os.utime(path, None)


def _groups(dist):
    handles = []
    for index, (_, desc, members) in enumerate(GROUPS):
        if index == DEFAULT_GROUP:
            handles.append((dist.group.WORLD, members))
            continue
        try:
            group = dist.new_group(ranks=list(members), group_desc=desc or None)
        except TypeError:  # an older torch: no descriptions
            group = dist.new_group(ranks=list(members))
        handles.append((group, members))
    return handles


def _issue(dist, kind, args, kwargs):
    return getattr(dist, kind)(*args, **kwargs)


_SITES = {}


def _at(site):
    """``_issue`` as if defined at the recorded call site (file, line, function): the replay's
    records then name the job's own lines. Only the code object's labels change."""
    if site is None:
        return _issue
    if site not in _SITES:
        file, line, name = site
        code = _issue.__code__.replace(co_filename=file, co_firstlineno=max(1, line - 1),
                                       co_name=name)
        if hasattr(code, "co_qualname"):
            code = code.replace(co_qualname=name)
        _SITES[site] = type(_issue)(code, globals(), name)
    return _SITES[site]


def _tensor(torch, shape, dtype):
    return torch.ones(tuple(shape), dtype=getattr(torch, dtype))


def _run_op(torch, dist, me, op, handles):
    kind, _, group_index, inputs, outputs, dtype, peer, in_splits, out_splits, site = op
    issue = _at(site)
    group, members = handles[group_index]
    n = len(members)
    root = members[0]
    t = _tensor(torch, inputs[0] if inputs else (1,), dtype)
    if kind == "all_reduce":
        issue(dist, "all_reduce", (t,), {"group": group})
    elif kind == "broadcast":
        issue(dist, "broadcast", (t,), {"src": root, "group": group})
    elif kind == "reduce":
        issue(dist, "reduce", (t,), {"dst": root, "group": group})
    elif kind == "all_gather":
        issue(dist, "all_gather", ([torch.empty_like(t) for _ in range(n)], t), {"group": group})
    elif kind == "all_gather_into_tensor":
        shape = outputs[0] if outputs else (t.shape[0] * n, *t.shape[1:])
        issue(dist, "all_gather_into_tensor", (_tensor(torch, shape, dtype), t), {"group": group})
    elif kind == "reduce_scatter":
        out = _tensor(torch, outputs[0] if outputs else t.shape, dtype)
        parts = [_tensor(torch, s, dtype) for s in inputs] if len(inputs) == n else None
        parts = parts or [torch.empty_like(out) for _ in range(n)]
        issue(dist, "reduce_scatter", (out, parts), {"group": group})
    elif kind == "reduce_scatter_tensor":
        shape = outputs[0] if outputs else (max(1, t.shape[0] // n), *t.shape[1:])
        issue(dist, "reduce_scatter_tensor", (_tensor(torch, shape, dtype), t), {"group": group})
    elif kind == "all_to_all_single":
        out = _tensor(torch, outputs[0] if outputs else t.shape, dtype)
        ins = list(in_splits) if in_splits is not None and len(in_splits) == n else None
        outs = list(out_splits) if out_splits is not None and len(out_splits) == n else None
        if ins is not None and sum(ins) != (t.shape[0] if t.dim() else 1):
            t = _tensor(torch, (sum(ins), *t.shape[1:]), dtype)
        if outs is not None and sum(outs) != (out.shape[0] if out.dim() else 1):
            out = _tensor(torch, (sum(outs), *out.shape[1:]), dtype)
        issue(dist, "all_to_all_single", (out, t, outs, ins), {"group": group})
    elif kind == "all_to_all":
        ins = [_tensor(torch, s, dtype) for s in inputs] or [t] * n
        outs = [_tensor(torch, s, dtype) for s in outputs] or [torch.empty_like(t)] * n
        issue(dist, "all_to_all", (outs, ins), {"group": group})
    elif kind == "barrier":
        issue(dist, "barrier", (), {"group": group})
    elif kind == "gather":
        parts = [torch.empty_like(t) for _ in range(n)] if me == root else None
        issue(dist, "gather", (t, parts), {"dst": root, "group": group})
    elif kind == "scatter":
        parts = [torch.empty_like(t) for _ in range(n)] if me == root else None
        issue(dist, "scatter", (t, parts), {"src": root, "group": group})
    elif kind == "send":
        issue(dist, "send", (t,), {"dst": peer, "group": group})
    elif kind == "recv":
        issue(dist, "recv", (t,), {"src": peer, "group": group})


def _end(how, detail):
    if how == "return":
        return
    if how == "kill":
        time.sleep(1.0)  # the peers are inside their next op, as when the real one died
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "signal":
        time.sleep(1.0)
        signal.signal(getattr(signal, detail), signal.SIG_DFL)
        os.kill(os.getpid(), getattr(signal, detail))
    if how == "exit":
        time.sleep(1.0)
        os._exit(1)
    if how == "raise":
        time.sleep(1.0)
        raise RuntimeError("replayed: the rank died of " + detail)
    while True:  # it hung here: stay until the launcher ends the job
        time.sleep(3600)


def worker(rank, work, record):
    if record:
        import frtools.recorder

        frtools.recorder.enable()
    import torch
    import torch.distributed as dist

    how, detail = ENDINGS[rank]
    _touch(work, "hb_%d" % rank)
    if how == "before":  # it never reached init_process_group
        _touch(work, "stop_%d" % rank)
        _end("sleep", detail)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    handles = _groups(dist)
    _touch(work, "up_%d" % rank)
    for op in OPS[rank]:
        _touch(work, "hb_%d" % rank)
        _run_op(torch, dist, rank, op, handles)
    _touch(work, "hb_%d" % rank)
    _touch(work, "stop_%d" % rank)
    _end(how, detail)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mtime(path):
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def launch(args):
    work = tempfile.mkdtemp(prefix="frtools-replay-")
    boxes = os.path.join(work, "boxes")
    port = _free_port()
    procs = []
    logs = []
    ending = "limit"
    try:
        for rank in range(WORLD):
            env = dict(os.environ)
            env.update(
                RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
            )
            if args.dir:
                env.update(FRTOOLS_DIR=boxes, FRTOOLS_JOB_ID=JOB_ID, FRTOOLS_STALL_SECONDS="2")
            log = open(os.path.join(work, "rank_%d.log" % rank), "w")
            logs.append(log)
            argv = [sys.executable, os.path.abspath(__file__), "--worker", str(rank), "--work", work]
            procs.append(subprocess.Popen(
                argv + (["--record"] if args.dir else []), env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.timeout:
            time.sleep(0.1)
            if all(p.poll() is not None for p in procs):
                ending = "exited"
                break
            up = all(p.poll() is not None or _mtime(os.path.join(work, "up_%d" % r))
                     or _mtime(os.path.join(work, "stop_%d" % r)) for r, p in enumerate(procs))
            beats = [_mtime(os.path.join(work, "hb_%d" % r)) for r in range(WORLD)]
            if None in beats:
                continue
            idle = time.time() - max(beats)
            if idle > (args.idle if up else args.idle + 8.0):
                ending = "hung"
                break
        stopped = [r for r in range(WORLD) if _mtime(os.path.join(work, "stop_%d" % r))]
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        print("replay: %s after %.1f s; ranks at their recorded stop: %s; still running: %s"
              % (ending, time.monotonic() - t0, stopped, alive))
        if args.dir:
            from frtools.collect.local import collect_job

            collect_job(os.path.join(boxes, JOB_ID), args.dir, timeout=5.0)
            print("replay: records collected into %s (frtools analyze %s)" % (args.dir, args.dir))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
        if args.keep_logs:
            print("replay: rank logs in %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ending == "hung" else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", help="record with frtools and collect the records here")
    parser.add_argument("--timeout", type=float, default=120.0, help="end the job after this")
    parser.add_argument("--idle", type=float, default=4.0,
                        help="the job hangs once no rank has moved for this long (seconds)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the ranks' logs")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.work, args.record)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
'''
