"""Diagnosis on small explicit traces: one Verdict, the right guilty ranks, victims not blamed.

Layout (trace_builder.megatron8): 8 ranks, TP pairs (0,1)(2,3)(4,5)(6,7), DP groups
(0,2,4,6)(1,3,5,7), world. Each step: 2 TP all_reduces, 1 DP all_reduce, 1 world all_reduce.
"""

from __future__ import annotations

import pytest
from trace_builder import STOP, Job, Op, dp, megatron8, simulate, step_program, tp, training

from frtools.analyze.diagnose import diagnose
from frtools.model.trace import ProcessGroup, RankInfo, Trace, entries_table

pytestmark = pytest.mark.timeout(60)

JOB = megatron8()


def stop_at(rank: int, step: int, index: int = 0):
    """Rank stops issuing (stuck in compute) before op ``index`` of ``step``."""

    def fault(r, s, ops):
        if r == rank and s == step:
            return ops[:index] + [STOP]
        return ops

    return fault


@pytest.mark.parametrize("completion", ["gloo", "nccl", "none"])
def test_healthy_job_has_no_guilty_rank(completion):
    v = diagnose(simulate(JOB, training(JOB, 3), completion=completion))
    assert v.kind == "healthy"
    assert v.guilty == [] and v.waiting == []
    assert v.exit_code == 0


@pytest.mark.parametrize("completion", ["gloo", "nccl", "none"])
def test_rank_stuck_in_compute_is_the_only_one_blamed(completion):
    v = diagnose(simulate(JOB, training(JOB, 3, stop_at(5, 1)), completion=completion))
    assert v.kind == "missing"
    assert v.guilty_ranks == [5]
    # Its TP partner and the DP/world victims wait; none of them is blamed.
    assert v.waiting == [0, 1, 2, 3, 4, 6, 7]
    assert 5 in v.process_group.ranks
    assert v.guilty[0].host == "node1" and v.guilty[0].device == "cuda:1"
    assert v.exit_code == 1


def test_megatron_cascade_names_only_the_root():
    # Rank 5 stops in the middle of step 2, after its first TP all_reduce: its partner 4
    # waits in TP, the DP groups wait for 4 and 5, the world waits for everyone.
    v = diagnose(simulate(JOB, training(JOB, 3, stop_at(5, 2, index=1))))
    assert v.kind == "missing"
    assert v.guilty_ranks == [5]
    assert set(v.waiting) == set(range(8)) - {5}
    assert v.headline.startswith("Rank 5")
    missing_rows = [g for g in v.groups if g.state == "not issued"]
    assert [g.ranks for g in missing_rows] == [[5]]


def test_two_simultaneous_bad_ranks_are_both_blamed():
    def fault(r, s, ops):
        if (r, s) in ((2, 1), (7, 1)):
            return [STOP]
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "missing"
    assert v.guilty_ranks == [2, 7]
    assert set(v.waiting) == {0, 1, 3, 4, 5, 6}


def test_rank_without_dump_is_dead():
    v = diagnose(simulate(JOB, training(JOB, 3, stop_at(3, 1)), absent=(3,)))
    assert v.kind == "dead"
    assert v.guilty_ranks == [3]
    assert v.ranks_missing == [3]
    assert "no usable dump" in v.guilty[0].reason


def test_missing_dump_with_no_recorded_wait_is_a_low_confidence_dead():
    # A Gloo peer's op that failed because a rank died is recorded as completed: nobody
    # seems to wait, only the dump is missing.
    v = diagnose(simulate(JOB, training(JOB, 2), absent=(6,)))
    assert v.kind == "dead"
    assert v.guilty_ranks == [6]
    assert v.confidence <= 0.5


def test_rank_whose_process_is_gone_is_dead():
    v = diagnose(simulate(JOB, training(JOB, 3, stop_at(6, 2)), alive={6: False}))
    assert v.kind == "dead"
    assert v.guilty_ranks == [6]


def test_absent_rank_nobody_waits_for_is_only_an_input_note():
    # Rank 7 finished cleanly but its file is missing; rank 2 hangs the job.
    v = diagnose(simulate(JOB, training(JOB, 3, stop_at(2, 1)), absent=(7,)))
    assert v.guilty_ranks == [2]
    assert any("rank(s) 7" in e for e in v.evidence)


def test_size_mismatch_blames_the_minority_and_names_the_attribute():
    def fault(r, s, ops):
        if r == 3 and s == 1:
            ops = list(ops)
            ops[1] = Op(tp(3), "all_reduce", "[[8,8]]")
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "mismatch"
    # A TP pair is a 1:1 tie; the other TP groups at the same seq break it.
    assert v.guilty_ranks == [3]
    assert v.process_group.ranks == (2, 3)
    assert "input_sizes" in v.headline
    sizes = {tuple(g.ranks): g.input_sizes for g in v.groups}
    assert sizes == {(2,): "[[16,8]]", (3,): "[[8,8]]"}


def test_op_mismatch_in_world_group_blames_the_odd_rank():
    def fault(r, s, ops):
        if r == 6 and s == 2:
            ops = list(ops)
            ops[3] = Op("0", "broadcast", "[[1]]")
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "mismatch"
    assert v.guilty_ranks == [6]
    assert v.op == "all_reduce"
    assert "op" in v.guilty[0].reason
    assert v.waiting == [0, 1, 2, 3, 4, 5, 7]


def test_skipped_collective_whose_seq_is_taken_by_the_next_op_is_a_mismatch():
    # Rank 1 skips its first TP all_reduce of step 1 and issues a TP all_gather next:
    # the all_gather occupies the seq its partner's all_reduce has.
    def fault(r, s, ops):
        if r == 1 and s == 1:
            return [Op(tp(1), "all_gather", "[[16,8]]")] + ops[2:]
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "mismatch"
    assert v.guilty_ranks == [1]


def test_skipped_collective_followed_by_other_groups_is_blamed_on_the_skipper():
    # Rank 3 skips one of its two TP all_reduces in step 1 and moves on to DP and world:
    # rank 2 waits for it in TP while it waits for the others in the world group, a cycle.
    # From the records alone a skip cannot be told from a reordering, so the kind is
    # "order"; the reason says the rank's recent ops leave one collective out.
    def fault(r, s, ops):
        if r == 3 and s == 1:
            return ops[1:]
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "order"
    assert v.guilty_ranks == [3]
    assert 2 in v.waiting
    assert "left out" in v.guilty[0].reason


@pytest.mark.parametrize("step", [0, 1])
def test_cross_group_order_deadlock_blames_the_reordered_rank(step):
    # Rank 0 issues the world all_reduce before its TP ops; rank 1 waits in TP for rank 0,
    # rank 0 waits in the world group for everybody: a cycle.
    def fault(r, s, ops):
        if r == 0 and s == step:
            return [ops[3], ops[0], ops[1], ops[2]]
        return ops

    v = diagnose(simulate(JOB, training(JOB, 3, fault)))
    assert v.kind == "order"
    assert v.guilty_ranks == [0]
    assert 1 in v.waiting
    assert v.process_group.name == "0"


def test_ring_buffer_wrap_is_not_blamed():
    # Rank 3's buffer dropped its first 6 entries; rank 5 hangs the job.
    trace = simulate(JOB, training(JOB, 3, stop_at(5, 2)), wrap={3: 6})
    v = diagnose(trace)
    assert v.guilty_ranks == [5]
    assert 3 in v.waiting


@pytest.mark.parametrize("completion", ["gloo", "none"])
def test_ring_buffer_wrap_alone_is_healthy(completion):
    trace = simulate(JOB, training(JOB, 3), wrap={3: 9, 4: 2}, completion=completion)
    v = diagnose(trace)
    assert v.kind == "healthy"


def test_straggler_is_named_when_nothing_hangs():
    v = diagnose(simulate(JOB, training(JOB, 4), delay_ms={6: 40}))
    assert v.kind == "straggler"
    assert v.guilty_ranks == [6]
    assert "ms" in v.guilty[0].reason


@pytest.mark.parametrize("late_ms", [1, 10])
def test_small_jitter_is_not_a_straggler(late_ms):
    """10 ms: what one rank of a healthy job showed in CI, beside two other jobs on 2 cores."""
    v = diagnose(simulate(JOB, training(JOB, 4), delay_ms={6: late_ms}))
    assert v.kind == "healthy", v.headline


# A healthy 4-step DDP job (examples/train_ddp.py, 4 Gloo ranks under frtools run, torch 2.15,
# a loaded 2-core machine): when each rank entered each world collective, ms. Rank 1 started
# last, then was last into the broadcasts and bucket all-reduces issued back to back.
HEALTHY_DDP_ON_A_LOADED_HOST = {
    1: ("all_gather", (172.0, 225.7, 0.0, 201.6)),
    2: ("broadcast", (235.2, 234.3, 235.4, 239.5)),
    3: ("broadcast", (236.5, 246.0, 236.4, 242.4)),
    4: ("all_reduce", (261.6, 275.4, 265.9, 262.2)),
    5: ("broadcast", (304.6, 306.5, 303.0, 301.4)),
    6: ("broadcast", (309.4, 319.1, 305.0, 318.8)),
    7: ("all_reduce", (321.0, 330.6, 311.3, 327.1)),
    8: ("all_reduce", (321.4, 349.8, 311.6, 327.6)),
    9: ("all_reduce", (358.8, 362.6, 361.0, 354.9)),
    10: ("all_reduce", (359.2, 363.0, 363.6, 355.3)),
    11: ("all_reduce", (369.8, 371.6, 375.3, 373.5)),
    12: ("all_reduce", (370.0, 371.9, 375.4, 373.8)),
    13: ("barrier", (404.0, 405.1, 405.7, 405.1)),
}


def test_start_up_skew_and_back_to_back_delays_are_not_a_straggler():
    rows = [
        {
            "rank": r,
            "record_id": seq - 1,
            "pg_name": "0",
            "pg_desc": "default_pg",
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "op": op,
            "input_sizes": "[[4]]",
            "output_sizes": "[[4]]",
            "input_dtypes": "Float",
            "output_dtypes": "Float",
            "state": "completed",
            "time_created_ns": int(ms * 1_000_000),
            "time_completed_ns": int(ms * 1_000_000) + 5_000_000,
        }
        for seq, (op, times) in HEALTHY_DDP_ON_A_LOADED_HOST.items()
        for r, ms in enumerate(times)
    ]
    trace = Trace(
        entries=entries_table(rows),
        ranks={r: RankInfo(rank=r) for r in range(4)},
        process_groups={"0": ProcessGroup("0", "default_pg", (0, 1, 2, 3))},
        world_size=4,
    )
    v = diagnose(trace)
    assert v.kind == "healthy", v.headline
    assert v.exit_code == 0


# ----- P2P ----------------------------------------------------------------------------

PIPE = Job({"0": (0, 1, 2, 3), "pp0": (0, 2), "pp1": (1, 3)}, {"0": "default_pg"})


def pipeline(recvs_at_2: int, sizes_at_2: str = "[[4,2]]") -> dict[int, list]:
    """Stage 0 (ranks 0,1) sends two activations to stage 1 (ranks 2,3), then a world op."""
    return {
        0: [Op("pp0", "send", peer=2), Op("pp0", "send", peer=2), Op("0")],
        1: [Op("pp1", "send", peer=3), Op("pp1", "send", peer=3), Op("0")],
        2: [Op("pp0", "recv", sizes_at_2, peer=0)] * recvs_at_2 + [STOP],
        3: [Op("pp1", "recv", peer=1), Op("pp1", "recv", peer=1), Op("0")],
    }


def test_p2p_receiver_that_never_posts_its_recv_is_blamed():
    v = diagnose(simulate(PIPE, pipeline(recvs_at_2=1)))
    assert v.kind == "missing"
    assert v.guilty_ranks == [2]
    assert v.op == "send"
    assert v.process_group.name == "pp0"
    assert 0 in v.waiting
    assert "0->2" in v.headline


def test_p2p_send_recv_size_mismatch_names_both_global_peers():
    v = diagnose(simulate(PIPE, pipeline(recvs_at_2=2, sizes_at_2="[[8]]")))
    assert v.kind == "mismatch"
    assert v.guilty_ranks == [0, 2]
    assert v.process_group.name == "pp0"
    assert {tuple(g.ranks) for g in v.groups} >= {(0,), (2,)}


# ----- stuck ----------------------------------------------------------------------------


def _stuck_trace(states: list[str]) -> Trace:
    rows = []
    for r in range(4):
        for seq, state in ((1, "completed"), (2, states[r])):
            rows.append(
                {
                    "rank": r,
                    "record_id": seq - 1,
                    "pg_name": "0",
                    "pg_desc": "default_pg",
                    "collective_seq_id": seq,
                    "p2p_seq_id": 0,
                    "is_p2p": False,
                    "op": "all_reduce",
                    "input_sizes": "[[4]]",
                    "output_sizes": "[[4]]",
                    "input_dtypes": "Float",
                    "output_dtypes": "Float",
                    "state": state,
                    "time_created_ns": seq * 1_000_000 + r,
                }
            )
    return Trace(
        entries=entries_table(rows),
        ranks={r: RankInfo(rank=r) for r in range(4)},
        process_groups={"0": ProcessGroup("0", "default_pg", (0, 1, 2, 3))},
        world_size=4,
    )


def test_collective_everyone_issued_and_nobody_completed_is_stuck():
    v = diagnose(_stuck_trace(["started"] * 4))
    assert v.kind == "stuck"
    assert v.collective_seq_id == 2
    assert v.guilty_ranks == [0, 1, 2, 3]


def test_stuck_collective_blames_the_rank_that_never_started_it():
    v = diagnose(_stuck_trace(["started", "started", "scheduled", "started"]))
    assert v.kind == "stuck"
    assert v.guilty_ranks == [2]
    assert v.waiting == [0, 1, 3]


def test_wedged_tp_collective_is_stuck_and_its_dp_victims_are_not_blamed():
    # Step 1's first TP all_reduce of pair (2,3) never completes; rank 3's kernel never
    # started. The DP groups then wait for 2 and 3, which are blocked, not elsewhere.
    trace = simulate(JOB, training(JOB, 3), completion="nccl", wedge=("tp1", 3), unstarted=(3,))
    v = diagnose(trace)
    assert v.kind == "stuck"
    assert v.guilty_ranks == [3]
    assert v.process_group.ranks == (2, 3)
    assert v.collective_seq_id == 3
    assert set(v.waiting) == set(range(8)) - {3}


def test_victims_of_a_hang_in_dp_are_not_blamed_for_missing_world_op():
    # Everyone but rank 4 reaches the world op; 4 stops before DP in step 0.
    v = diagnose(simulate(JOB, training(JOB, 2, stop_at(4, 0, index=2))))
    assert v.guilty_ranks == [4]
    assert v.process_group.name == dp(4)


def test_program_helper_is_one_step():
    assert len(step_program(0)) == 4


STACKS = """Current thread 0x00007fb3d17fa6c0 (most recent call first):
  File "/job/train.py", line 102 in write_dump
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007fb3f9ff2b80 (most recent call first):
  File "/job/model.py", line 212 in slow_loss
  File "/job/train.py", line 250 in main
  File "/job/train.py", line 283 in <module>
"""


def test_stuck_rank_call_site_comes_from_its_main_thread_stack():
    trace = simulate(JOB, training(JOB, 3, stop_at(5, 1)))
    trace.ranks[5].stacks = STACKS
    v = diagnose(trace)
    assert v.guilty_ranks == [5]
    assert v.guilty[0].call_site == "/job/model.py:212 in slow_loss"


def test_run_ahead_order_deadlock_where_every_rank_issued_both_ops():
    # NCCL-style: a CPU runs ahead, so every rank *issued* both the DP and the world op of
    # the last step; rank 1 issued them in the other order. Nobody is missing anything: the
    # wait comes from ranks blocked in an older op of their own (busy), forming a cycle.
    groups = {"0": (0, 1, 2, 3), "a": (0, 1), "b": (2, 3)}
    rows = []

    def add(rank, pg, seq, state, t):
        rows.append(
            {
                "rank": rank,
                "record_id": len([x for x in rows if x["rank"] == rank]),
                "pg_name": pg,
                "collective_seq_id": seq,
                "op": "all_reduce",
                "input_sizes": "[[8]]" if pg != "0" else "[[1]]",
                "output_sizes": "[[8]]" if pg != "0" else "[[1]]",
                "input_dtypes": "Float",
                "output_dtypes": "Float",
                "state": state,
                "time_created_ns": t,
            }
        )

    for r in range(4):
        dp = "a" if r < 2 else "b"
        add(r, dp, 1, "completed", 10 + r)  # step 0: DP then world, everyone
        add(r, "0", 1, "completed", 20 + r)
        if r == 1:  # step 1: rank 1 enters the world op first
            add(r, "0", 2, "started", 30 + r)
            add(r, dp, 2, "scheduled", 40 + r)
        elif r == 0:
            add(r, dp, 2, "started", 30 + r)
            add(r, "0", 2, "scheduled", 40 + r)
        else:
            add(r, dp, 2, "completed", 30 + r)
            add(r, "0", 2, "started", 40 + r)
    trace = Trace(
        entries=entries_table(rows),
        ranks={r: RankInfo(rank=r) for r in range(4)},
        process_groups={g: ProcessGroup(g, "", m) for g, m in groups.items()},
        world_size=4,
    )
    v = diagnose(trace)
    assert v.kind == "order"
    assert v.guilty_ranks == [1]
    assert set(v.waiting) == {0, 2, 3}


def test_ops_issued_moments_before_a_live_dump_are_in_flight_not_hung():
    # Rank 7 was dumped just before it reached the world all_reduce the others are in.
    trace = simulate(JOB, training(JOB, 2, stop_at(7, 1, index=3)))
    assert diagnose(trace).guilty_ranks == [7]  # without dump times: a hang
    last = max(trace.entries.column("time_created_ns").to_pylist())
    for info in trace.ranks.values():
        info.dump_time_ns = last + 1_000_000
    assert diagnose(trace).kind == "healthy"


def test_fresh_ops_are_a_hang_when_their_peers_process_is_gone():
    # The same fresh dump, but `frtools dump` found rank 7's process gone: it can never
    # join, so the others' young all_reduce is a hang and rank 7 is blamed.
    trace = simulate(JOB, training(JOB, 2, stop_at(7, 1, index=3)))
    last = max(trace.entries.column("time_created_ns").to_pylist())
    for info in trace.ranks.values():
        info.dump_time_ns = last + 1_000_000
    trace.ranks[7].alive = False
    v = diagnose(trace)
    assert v.kind in ("dead", "missing")
    assert v.guilty_ranks == [7]


def test_two_stragglers_in_one_pair_do_not_hide_each_other():
    v = diagnose(simulate(JOB, training(JOB, 4), delay_ms={4: 30, 5: 30}))
    assert v.kind == "straggler"
    assert v.guilty_ranks == [4, 5]


# ----- what real jobs do (issue #9) -------------------------------------------------------

EP, DP = "expert_parallel", "data_parallel"
MOE = Job(
    {
        "0": tuple(range(8)),
        "ep0": (0, 1, 2, 3),
        "ep1": (4, 5, 6, 7),
        **{f"dp{i}": (i, i + 4) for i in range(4)},
    },
    {"0": "default_pg", "ep0": EP, "ep1": EP, **{f"dp{i}": DP for i in range(4)}},
)


def moe_step(rank: int, step: int) -> list[Op]:
    """One MoE layer as Gloo's Flight Recorder records it: the sequence-parallel all_gather,
    the token counts' all_to_all, token dispatch and combine all_to_alls with per-rank
    (uneven) sizes, reduce_scatter (recorded as all_reduce), expert grads over DP, stats."""
    ep, dp = f"ep{rank // 4}", f"dp{rank % 4}"
    sent = 8 + (rank * 7 + step * 3) % 11  # tokens this rank routes to the experts
    got = 8 + (rank * 5 + step) % 13  # tokens its expert receives
    return [
        Op(ep, "all_gather", "[[16,32]]", out="[[4,16,32]]"),
        Op(ep, "all_to_all", "[[4]]", "Long"),
        Op(ep, "all_to_all", f"[[{sent},32]]", out=f"[[{got},32]]"),
        Op(ep, "all_to_all", f"[[{got},32]]", out=f"[[{sent},32]]"),
        Op(ep, "all_reduce", "[[64,32]]"),
        Op(dp, "all_reduce", "[[32,32]]"),
        Op("0", "all_reduce", "[[4096]]"),
    ]


def moe_programs(steps: int, fault=None) -> dict[int, list]:
    programs = {}
    for r in range(8):
        prog: list = []
        for s in range(steps):
            ops = moe_step(r, s)
            prog.extend(fault(r, s, ops) if fault is not None else ops)
        programs[r] = prog
    return programs


def gloo_dumps(trace: Trace, tmp_path, world_size: int | None = None) -> Trace:
    """The trace as PyTorch's FR on Gloo writes it, read back as `frtools analyze` reads
    it: no group membership, no world size."""
    from trace_builder import write_fr_pickles

    from frtools.analyze.readers import load_trace

    write_fr_pickles(trace, tmp_path)
    return load_trace(tmp_path, workers=1, world_size=world_size)


def test_uneven_all_to_all_splits_of_a_healthy_moe_job_are_not_a_mismatch(tmp_path):
    # Issue #9: a healthy MoE job was called "MISMATCH ... different input_sizes at
    # all_to_all". Token dispatch sends a different number of tokens from every rank.
    v = diagnose(gloo_dumps(simulate(MOE, moe_programs(3)), tmp_path))
    assert v.kind == "healthy", v.headline
    assert v.exit_code == 0
    v = diagnose(simulate(MOE, moe_programs(3), completion="nccl"))
    assert v.kind == "healthy", v.headline


def test_moe_hang_blames_the_missing_rank_not_the_uneven_all_to_all(tmp_path):
    # Rank 5 hangs in compute before step 1's dispatch: its expert-parallel peers wait in
    # the all_to_all whose sizes differ on every rank; only rank 5 is at fault.
    def fault(r, s, ops):
        return ops[:2] + [STOP] if (r, s) == (5, 1) else ops

    for trace in (simulate(MOE, moe_programs(3, fault)), simulate(MOE, moe_programs(3, fault),
                                                                  completion="nccl")):  # fmt: skip
        v = diagnose(trace)
        assert v.kind == "missing", v.headline
        assert v.guilty_ranks == [5]
        assert v.op == "all_to_all" and v.process_group.ranks == (4, 5, 6, 7)


def test_all_to_all_dtype_still_must_agree():
    def fault(r, s, ops):
        if (r, s) == (6, 1):
            ops = list(ops)
            ops[1] = Op("ep1", "all_to_all", "[[4]]", "Int")
        return ops

    v = diagnose(simulate(MOE, moe_programs(3, fault)))
    assert v.kind == "mismatch"
    assert v.guilty_ranks == [6]
    assert "input_dtypes" in v.headline and "input_sizes" not in v.headline


def _rows(trace: Trace) -> list[dict]:
    return trace.entries.to_pandas().to_dict("records")


def _with_rows(trace: Trace, rows: list[dict]) -> Trace:
    for row in rows:
        for key, value in list(row.items()):
            if value is None or (isinstance(value, float) and value != value):
                row[key] = None
    trace.entries = entries_table(rows)
    return trace


WORLD4 = Job({"0": (0, 1, 2, 3)}, {"0": "default_pg"})


def _ddp(steps: int, stop: tuple[int, int] | None = None) -> dict[int, list]:
    """Two world all_reduces a step (gradient buckets, then the logged loss)."""
    programs = {}
    for r in range(4):
        prog: list = []
        for s in range(steps):
            if stop == (r, s):
                prog.append(STOP)
                break
            prog += [Op("0", "all_reduce", "[[2048]]"), Op("0", "all_reduce", "[[1]]")]
        programs[r] = prog
    return programs


def _killed_at_step_20(with_facts: bool) -> Trace:
    """frtools' record of a 4-rank DDP job whose rank 2 was SIGKILLed at step 20: Gloo
    fails the survivors' next all_reduce ("Connection closed by peer") and the recorder saw
    it end; the survivors then exit with the exception. Every process is gone."""
    trace = simulate(WORLD4, _ddp(25, stop=(2, 20)), completion="nccl")
    rows = _rows(trace)
    for row in rows:
        if row["state"] != "completed":  # the survivors' failed all_reduce
            if with_facts:
                row["error"] = "Connection closed by peer [127.0.0.1]:29500"
            else:  # what the recorder wrote before it knew failures: completed
                row["state"] = "completed"
                row["retired"] = True
    for r, info in trace.ranks.items():
        info.alive = False
        info.device = "cpu"
        if with_facts:
            info.exit_kind = "killed" if r == 2 else "exception"
            info.exit_detail = (
                None if r == 2 else "DistBackendError: Connection closed by peer [127.0.0.1]"
            )
    return _with_rows(trace, rows)


@pytest.mark.parametrize("with_facts", [False, True])
def test_rank_killed_mid_job_is_dead_though_gloo_completed_its_peers_failed_op(with_facts):
    # Issue #9: this came out HEALTHY (exit 0). The survivors' all_reduce #41 "completed"
    # while rank 2, whose record ends at #40, never issued it: a collective cannot complete
    # without a member, so that completion is a failure (invariant 1).
    v = diagnose(_killed_at_step_20(with_facts))
    assert v.kind == "dead", v.headline
    assert v.guilty_ranks == [2]
    assert v.waiting == [0, 1, 3]
    assert v.collective_seq_id == 41
    if with_facts:
        assert "killed" in v.guilty[0].reason
        assert any(g.state == "failed" and g.ranks == [0, 1, 3] for g in v.groups)


def _size_mismatch_ddp8() -> Trace:
    """8 ranks, world group only. Rank 7 all-reduces a wrong-sized metrics vector in
    world all_reduce #31; Gloo aborts it (no dump). Its ring neighbours 0 and 6 leave the
    op with an error, which Gloo's FR records as retired; ranks 1-5 stay blocked in it."""
    world = Job({"0": tuple(range(8))}, {"0": "default_pg"})
    programs = {}
    for r in range(8):
        prog = []
        for s in range(16):
            size = "[[769]]" if (r, s) == (7, 15) else "[[1025]]"
            prog += [Op("0", "all_reduce", "[[2048]]"), Op("0", "all_reduce", size)]
        programs[r] = prog
    trace = simulate(world, programs, absent=(7,))
    rows = _rows(trace)
    for row in rows:
        if row["rank"] in (0, 6) and row["collective_seq_id"] == 32:
            row["retired"] = True
    for r in (0, 6):
        trace.ranks[r].pg_status["0"]["last_completed_collective"] = 32
    return _with_rows(trace, rows)


def test_blocked_ranks_with_a_peer_nobody_can_name_are_inconclusive_not_healthy(tmp_path):
    # Issue #9: this came out HEALTHY. Nothing in the 7 Gloo dumps (rank_0..rank_6, no gap)
    # says an 8th rank exists, so none can be named; but 5 ranks are blocked in an op that
    # 2 others "completed" -- a collective completes on no member before every member
    # issued it.
    trace = gloo_dumps(_size_mismatch_ddp8(), tmp_path)
    v = diagnose(trace)
    assert v.kind == "inconclusive", v.headline
    assert v.exit_code == 1
    assert v.guilty == []
    assert set(range(1, 6)) <= set(v.waiting)
    assert v.collective_seq_id == 32
    assert any("--world-size" in d for d in v.decide)


def test_world_size_names_the_dead_rank_behind_a_gloo_retired_failure(tmp_path):
    trace = gloo_dumps(_size_mismatch_ddp8(), tmp_path, world_size=8)
    v = diagnose(trace)
    assert v.kind == "dead"
    assert v.guilty_ranks == [7]
    assert set(v.waiting) == set(range(7))  # 0 and 6 left it with an error: victims


def test_gloo_group_shorter_than_its_siblings_names_the_missing_highest_rank(tmp_path):
    # Rank 7 (the highest: no gap in the file names) hangs and leaves no dump. Its
    # tensor-parallel group has one recorded member where its siblings have two.
    trace = simulate(JOB, training(JOB, 3, stop_at(7, 1)), absent=(7,))
    v = diagnose(gloo_dumps(trace, tmp_path))
    assert v.kind == "dead", v.headline
    assert v.guilty_ranks == [7]
    assert v.ranks_expected == 8
    assert v.confidence < 0.9  # rank 7 is inferred, not read from a file


def test_no_recorded_op_is_inconclusive():
    trace = Trace(entries=entries_table([]), ranks={r: RankInfo(rank=r) for r in range(4)},
                  world_size=4)  # fmt: skip
    v = diagnose(trace)
    assert v.kind == "inconclusive"
    assert v.exit_code == 1 and v.decide


def test_rank_that_died_of_its_own_exception_is_dead_even_if_nobody_waits():
    trace = simulate(JOB, training(JOB, 2))
    trace.ranks[3].alive = False
    trace.ranks[3].exit_kind = "exception"
    trace.ranks[3].exit_detail = "RuntimeError: CUDA error: an illegal memory access"
    v = diagnose(trace)
    assert v.kind == "dead"
    assert v.guilty_ranks == [3]
    assert "illegal memory access" in v.guilty[0].reason


def test_gloo_work_that_never_reports_completion_is_not_a_stuck_collective():
    # frtools on Gloo: the Work of a reduce_scatter never reports completion, so every
    # member's entry stays "scheduled" although every member issued it, agreeing, and went
    # on. On Gloo such a collective completes: the job is healthy, not stuck.
    programs = {
        r: [Op("0", "_reduce_scatter_base", "[[64]]", out="[[16]]"), Op("0", "all_reduce")] * 3
        for r in range(4)
    }
    trace = simulate(WORLD4, programs, completion="nccl")
    rows = _rows(trace)
    for row in rows:
        row["profiling_name"] = f"gloo:{row['op']}"
        if row["op"] == "_reduce_scatter_base":
            row["state"], row["retired"] = "scheduled", False
    for info in trace.ranks.values():
        info.device = "cpu"
    assert diagnose(_with_rows(trace, rows)).kind == "healthy"


def _lines(trace: Trace, line_of: dict[str, int]) -> Trace:
    """Call sites by the op's line in the training script (the same on every rank)."""
    rows = _rows(trace)
    for row in rows:
        row["call_site"] = f"train.py:{line_of[row['op']]} in step"
    return _with_rows(trace, rows)


def test_rank_that_skipped_an_all_to_all_is_told_by_its_call_site():
    # Rank 5 skips the token dispatch of step 1 and goes on to the combine: its combine
    # takes the dispatch's seq (all_to_all against all_to_all, sizes free to differ); its
    # call site is the line its peers reach one collective later.
    def fault(r, s, ops):
        return ops[:2] + ops[3:] if (r, s) == (5, 1) else ops

    trace = simulate(MOE, moe_programs(3, fault))
    rows = _rows(trace)
    for row in rows:  # the dispatch and the combine are two lines of the script
        step_ops = [o.op for o in moe_step(0, 0)]
        row["call_site"] = f"train.py:{300 + step_ops.index(row['op'])} in moe"
        if row["op"] == "all_to_all" and row["input_sizes"] != "[[4]]":
            position = 2 if row["input_sizes"] != row["output_sizes"] else 3
            row["call_site"] = f"train.py:{300 + position} in moe"
    v = diagnose(_with_rows(trace, rows))
    assert v.kind == "missing", v.headline
    assert v.guilty_ranks == [5]
    assert "skipped" in v.guilty[0].reason


def test_dtype_differs_from_every_sibling_group_while_the_partner_left_no_dump():
    # Rank 6 all-reduces in float64 where every tensor-parallel pair uses float32; Gloo
    # aborted its partner 7, which left no dump. The siblings say rank 6 is the odd one.
    def fault(r, s, ops):
        if (r, s) == (6, 1):
            ops = list(ops)
            ops[0] = Op(tp(6), "all_reduce", "[[16,8]]", "Double")
        return ops

    trace = simulate(JOB, training(JOB, 3, fault), absent=(7,))
    v = diagnose(trace)
    assert v.kind == "mismatch", v.headline
    assert v.guilty_ranks == [6]
    assert "input_dtypes" in v.headline


def test_ranks_whose_op_gloo_retired_when_a_member_died_are_victims(tmp_path):
    # Rank 3 is killed before step 1 (no dump). Its expert-parallel peers 0-2 fail in the
    # all_gather (Gloo records it retired) and exit; rank 4 then waits for rank 0 in their
    # data-parallel all_reduce. Rank 0 is rank 3's victim, not the cause.
    def fault(r, s, ops):
        return [STOP] if (r, s) == (3, 1) else ops

    trace = simulate(MOE, moe_programs(3, fault), absent=(3,))
    rows = _rows(trace)
    for row in rows:
        if row["rank"] in (0, 1, 2) and row["retired"] is False:
            row["retired"] = True  # the failed all_gather
    for r in (0, 1, 2):
        trace.ranks[r].pg_status["ep0"]["last_completed_collective"] += 1
    v = diagnose(gloo_dumps(_with_rows(trace, rows), tmp_path))
    assert v.kind == "dead", v.headline
    assert v.guilty_ranks == [3]


def test_rank_gloo_aborted_for_a_peers_dtype_is_a_casualty_not_the_cause():
    """Real job (corpus fsdp2-dtype-r3-frtools): rank 3 all-reduces its metrics in float64,
    its peers in float32. Gloo aborts rank 2, which receives 1032 bytes where it expects 516
    (SIGABRT); ranks 0, 1, 3 leave the op with an error. Rank 2 issued the op as the majority
    did: the disagreement is the cause, its death a consequence (this was 'dead [2, 3]')."""
    programs = {
        r: [Op("0", "all_reduce", "[[2048]]"), Op("0", "all_reduce", "[[1025]]",
                                                  "Double" if r == 3 else "Float")]
        for r in range(4)
    }  # fmt: skip
    trace = simulate(WORLD4, programs, completion="nccl")
    rows = _rows(trace)
    for row in rows:
        if row["collective_seq_id"] == 2 and row["rank"] != 2:
            row["state"] = "failed"
            row["error"] = "Connection closed by peer [127.0.0.1]:29500"
    for r, info in trace.ranks.items():
        info.alive = False
        info.exit_kind = "signal" if r == 2 else "exception"
        info.exit_detail = "SIGABRT" if r == 2 else "DistBackendError: Connection closed by peer"
    v = diagnose(_with_rows(trace, rows))
    assert v.kind == "mismatch", v.headline
    assert v.guilty_ranks == [3]
    assert v.collective_seq_id == 2
    assert 2 in v.waiting


def test_status_table_answers_as_a_dict_of_every_status_row():
    """facts.status looks (rank, group) up in al.status where asked; it must answer as the
    dict of every row did, misses and NA counters included."""
    from frtools.analyze.align import align
    from frtools.analyze.diagnosis.facts import StatusTable

    al = align(simulate(JOB, training(JOB, 3, stop_at(5, 0)), completion="states"))
    st = al.status
    assert st["last_completed"].isna().any()  # NA counters are among the rows
    columns = [st[c].tolist() for c in ("first_seq", "last_issued", "last_completed")]
    rows = {(int(r), str(g)): v for (r, g), *v in zip(st.index, *columns, strict=True)}
    rows = {k: tuple(v) for k, v in rows.items()}
    table = StatusTable(st)
    assert len(rows) > 8 and len(table) == len(rows) and dict(table.items()).keys() == rows.keys()
    for key, value in rows.items():
        assert repr(table[key]) == repr(value)
    assert table.get((5, "no such group")) is None and table.get((99, "0")) is None


@pytest.mark.parametrize("table", [["B", "A"], ["A", "B"]])
def test_two_mismatches_at_one_moment_name_the_same_group_whatever_the_files_order(table, tmp_path):
    """Two groups disagree at the same moment: the verdict names the first by group name,
    not by the order in which the readers met the groups (a black box's group table, the
    groups its entries use)."""
    from hostile import snapshot

    from frtools.analyze.readers import load_trace

    ranges = {"B": "0-1", "A": "1-2"}  # rank 0's file, read first, is on B alone
    groups = [(name, name, ranges[name]) for name in table]
    pg = {name: table.index(name) for name in table}

    def op(group: str, size: int) -> dict:
        return {"op": "gloo:all_reduce", "pg": pg[group], "seq": 1,
                "input_sizes": f"[[{size}]]", "stack": "t.py:1 in f"}  # fmt: skip

    entries = {0: [op("B", 1)], 1: [op("B", 2), op("A", 1)], 2: [op("A", 2)]}
    for rank, ops in entries.items():
        identity = {"rank": rank, "world_size": 3, "backend": "gloo"}
        (tmp_path / f"rank_{rank}.frbb").write_bytes(
            snapshot(identity=identity, groups=groups, entries=ops)
        )
    v = diagnose(load_trace(tmp_path, workers=1))
    assert v.kind == "mismatch" and v.process_group.name == "A"
