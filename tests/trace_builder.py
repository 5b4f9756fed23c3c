"""Tiny explicit traces for diagnosis tests: a lock-step simulation of a few ranks.

Each rank runs a program (a list of ``Op``); a collective completes only when every member
issued it with the same op/sizes/dtypes; a send completes with its matching recv. Ranks
block on each op until it completes, exactly like eager torch.distributed calls. The result
is a ``Trace`` as a reader would produce it, with Gloo-style completion (state "scheduled",
``retired`` + ``pg_status``), NCCL-style (states), or none at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frtools.model.ops import INPUT_DTYPES, INPUT_SIZES, family_of, semantics
from frtools.model.trace import ProcessGroup, RankInfo, Trace, entries_table

MS = 1_000_000


@dataclass(frozen=True)
class Op:
    pg: str
    op: str = "all_reduce"
    sizes: str = "[[4,2]]"
    dtypes: str = "Float"
    peer: int | None = None  # P2P: global peer
    out: str | None = None  # output sizes where they differ from the input's (all_to_all)

    @property
    def agreement(self) -> tuple:
        """What must agree across members for this op to complete (its op semantics)."""
        sem = semantics(self.op)
        return (
            family_of(self.op),
            self.sizes if sem.checks(INPUT_SIZES) else None,
            self.dtypes if sem.checks(INPUT_DTYPES) else None,
        )


STOP = "stop"  # the rank stops issuing (stuck in compute / holding the GIL)


@dataclass
class Job:
    groups: dict[str, tuple[int, ...]]
    descs: dict[str, str] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return max(max(r) for r in self.groups.values()) + 1


def megatron8() -> Job:
    """8 ranks: TP pairs, DP groups of 4 (ranks with the same TP position), world."""
    groups = {"0": tuple(range(8))}
    descs = {"0": "default_pg"}
    for i, pair in enumerate([(0, 1), (2, 3), (4, 5), (6, 7)]):
        groups[f"tp{i}"] = pair
        descs[f"tp{i}"] = "TENSOR_MODEL_PARALLEL_GROUP"
    groups["dp0"], groups["dp1"] = (0, 2, 4, 6), (1, 3, 5, 7)
    descs["dp0"] = descs["dp1"] = "DATA_PARALLEL_GROUP"
    return Job(groups, descs)


def tp(rank: int) -> str:
    return f"tp{rank // 2}"


def dp(rank: int) -> str:
    return f"dp{rank % 2}"


def step_program(rank: int) -> list[Op]:
    """One training step: two TP all_reduces, a DP all_reduce of grads, a world barrier-ish."""
    return [
        Op(tp(rank), "all_reduce", "[[16,8]]"),
        Op(tp(rank), "all_reduce", "[[16,8]]"),
        Op(dp(rank), "all_reduce", "[[1024]]"),
        Op("0", "all_reduce", "[[1]]"),
    ]


def simulate(
    job: Job,
    programs: dict[int, list],
    *,
    completion: str = "gloo",
    absent: tuple[int, ...] = (),
    alive: dict[int, bool] | None = None,
    delay_ms: dict[int, float] | None = None,
    wrap: dict[int, int] | None = None,
    frames: bool = True,
    wedge: tuple[str, int] | None = None,
    unstarted: tuple[int, ...] = (),
) -> Trace:
    """Run the programs in lock step and return the Trace the dumps would give.

    ``completion``: "gloo" (state scheduled, retired, pg_status), "nccl" (states), "none".
    ``absent``: ranks whose dump is missing. ``wrap``: rank -> number of oldest entries
    dropped by its ring buffer. ``delay_ms``: extra lateness per collective for a rank.
    ``wedge``: a (group, seq) that never completes although every member issues it;
    ``unstarted``: ranks whose wedged op never starts (NCCL state "scheduled").
    """
    delay_ms = delay_ms or {}
    pc = {r: 0 for r in programs}
    blocked: dict[int, tuple] = {}
    seqs: dict[tuple[int, str], int] = {}
    p2p_seqs: dict[tuple[int, str], int] = {}
    pair_counts: dict[tuple, int] = {}
    issued: dict[tuple, dict[int, tuple]] = {}  # op key -> rank -> (signature, entry idx)
    entries: list[dict] = []
    clock = 0
    for _round in range(10_000):
        progressed = False
        clock += 10 * MS
        for r in sorted(programs):
            if r in blocked or pc[r] >= len(programs[r]):
                continue
            op = programs[r][pc[r]]
            if op == STOP:
                continue
            pc[r] += 1
            progressed = True
            is_p2p = op.op in ("send", "recv")
            if is_p2p:
                p2p_seqs[(r, op.pg)] = p2p_seqs.get((r, op.pg), 0) + 1
                sender, receiver = (r, op.peer) if op.op == "send" else (op.peer, r)
                pk = (op.pg, sender, receiver, op.op)
                k = pair_counts.get(pk, 0)
                pair_counts[pk] = k + 1
                key = ("p2p", op.pg, sender, receiver, k)
                seq = 0
            else:
                seqs[(r, op.pg)] = seqs.get((r, op.pg), 0) + 1
                seq = seqs[(r, op.pg)]
                key = ("coll", op.pg, seq)
            t = clock + r * 1000 + int(delay_ms.get(r, 0) * MS)
            entries.append(
                {
                    "rank": r,
                    "record_id": sum(1 for e in entries if e["rank"] == r),
                    "pg_name": op.pg,
                    "pg_desc": job.descs.get(op.pg, "undefined"),
                    "collective_seq_id": seq,
                    "p2p_seq_id": p2p_seqs.get((r, op.pg), 0) if is_p2p else 0,
                    "is_p2p": is_p2p,
                    "op": op.op,
                    "profiling_name": f"{'gloo' if completion == 'gloo' else 'nccl'}:{op.op}",
                    "peer": op.peer,
                    "input_sizes": op.sizes,
                    "output_sizes": op.out or op.sizes,
                    "input_dtypes": op.dtypes,
                    "output_dtypes": op.dtypes,
                    "state": "scheduled",
                    "time_created_ns": t,
                    "call_site": f"train.py:{100 + pc[r]} in step" if frames else None,
                    "_done": False,
                }
            )
            issued.setdefault(key, {})[r] = (op.agreement, len(entries) - 1)
            blocked[r] = key
        # completions
        for key, who in list(issued.items()):
            if wedge is not None and key == ("coll", *wedge):
                continue
            if key[0] == "coll":
                members = job.groups[key[1]]
                if set(who) != set(members):
                    continue
                if len({sig for sig, _ in who.values()}) != 1:
                    continue
            else:
                _, _pg, sender, receiver, _k = key
                if set(who) != {sender, receiver}:
                    continue
                if len({sig[1:] for sig, _ in who.values()}) != 1:  # send/recv sizes
                    continue
            for r, (_sig, idx) in who.items():
                if not entries[idx]["_done"]:
                    entries[idx]["_done"] = True
                    entries[idx]["time_completed_ns"] = clock + 5 * MS
                    progressed = True
                if blocked.get(r) == key:
                    del blocked[r]
        if not progressed:
            break

    ranks: dict[int, RankInfo] = {}
    rows = []
    for r in sorted(programs):
        if r in absent:
            continue
        mine = [e for e in entries if e["rank"] == r]
        drop = (wrap or {}).get(r, 0)
        kept = mine[drop:]
        info = RankInfo(rank=r, host=f"node{r // 4}", pid=1000 + r, local_rank=r % 4)
        info.device = f"cuda:{r % 4}"
        info.wrapped = drop > 0
        if alive and r in alive:
            info.alive = alive[r]
        for e in kept:
            row = {k: v for k, v in e.items() if not k.startswith("_")}
            if completion == "gloo":
                row["retired"] = e["_done"]
            elif completion == "nccl":
                row["state"] = "completed" if e["_done"] else "started"
                if r in unstarted and not e["_done"]:
                    row["state"] = "scheduled"
                row["retired"] = e["_done"]
            rows.append(row)
        if completion == "gloo":
            for (rr, pg), n in seqs.items():
                if rr != r:
                    continue
                done = [
                    e["collective_seq_id"]
                    for e in mine
                    if e["pg_name"] == pg and not e["is_p2p"] and e["_done"]
                ]
                info.pg_status[pg] = {
                    "last_enqueued_collective": n,
                    "last_started_collective": -1,
                    "last_completed_collective": max(done) if done else -1,
                }
        ranks[r] = info
    pgs = {
        name: ProcessGroup(name, job.descs.get(name, "undefined"), tuple(members), False)
        for name, members in job.groups.items()
    }
    return Trace(entries=entries_table(rows), ranks=ranks, process_groups=pgs, world_size=job.world)


def training(job: Job, steps: int, fault=None) -> dict[int, list]:
    """``steps`` steps of ``step_program`` for every rank; ``fault(rank, step, ops)`` may
    rewrite a rank's ops of one step."""
    programs: dict[int, list] = {}
    for r in range(job.world):
        prog: list = []
        for s in range(steps):
            ops = step_program(r)
            if fault is not None:
                ops = fault(r, s, ops)
            prog.extend(ops)
        programs[r] = prog
    return programs


def write_fr_pickles(trace: Trace, directory, skip: tuple[int, ...] = ()) -> None:
    """Write the trace as PyTorch Flight Recorder 2.10 pickles ``rank_<R>.pkl`` (Gloo shape:
    empty pg_config, pg_status keyed by the rank-local pg_id, frames innermost first)."""
    import pickle
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    df = trace.entries.to_pandas()
    for rank, info in trace.ranks.items():
        if rank in skip:
            continue
        mine = df[df["rank"] == rank].sort_values("record_id")
        local_ids: dict[str, int] = {}
        for name in ["0", *sorted(set(mine["pg_name"]) - {"0"})]:
            local_ids.setdefault(name, len(local_ids))
        entries = []
        for e in mine.to_dict("records"):
            site = e["call_site"] or "train.py:1 in step"
            filename, rest = site.split(":", 1)
            line, func = rest.split(" in ")
            entries.append(
                {
                    "record_id": int(e["record_id"]),
                    "pg_id": local_ids[e["pg_name"]],
                    "process_group": (e["pg_name"], e["pg_desc"]),
                    "collective_seq_id": int(e["collective_seq_id"]),
                    "p2p_seq_id": int(e["p2p_seq_id"]),
                    "op_id": int(e["record_id"]) + 1,
                    "profiling_name": f"gloo:{e['op']}",
                    "time_created_ns": int(e["time_created_ns"]),
                    "input_sizes": _parse_sizes(e["input_sizes"]),
                    "input_dtypes": e["input_dtypes"].split(","),
                    "output_sizes": _parse_sizes(e["output_sizes"]),
                    "output_dtypes": e["output_dtypes"].split(","),
                    "state": e["state"],
                    "time_discovered_started_ns": None,
                    "time_discovered_completed_ns": None,
                    "retired": bool(e["retired"]) if e["retired"] is not None else False,
                    "timeout_ms": 1800000,
                    "is_p2p": bool(e["is_p2p"]),
                    "thread_id": "1",
                    "thread_name": "python",
                    "frames": [
                        {
                            "name": "all_reduce",
                            "filename": "/x/torch/distributed/distributed_c10d.py",
                            "line": 3245,
                        },
                        {"name": func, "filename": filename, "line": int(line)},
                    ],
                }
            )
        status = {str(local_ids[pg]): st for pg, st in info.pg_status.items() if pg in local_ids}
        dump = {
            "version": "2.10",
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
            "pg_status": status,
            "comm_lib_version": "",
            "entries": entries,
        }
        (directory / f"rank_{rank}.pkl").write_bytes(pickle.dumps(dump))


def _parse_sizes(text):
    import json

    return json.loads(text) if text else []
