"""What counts as completed (frtools/analyze/diagnosis/completion.py), on tiny explicit traces:
each rule of the module alone, without the wait-for graph."""

from __future__ import annotations

import pytest

from frtools.analyze.align import align
from frtools.analyze.diagnosis.completion import effective_completion, quitters
from frtools.analyze.diagnosis.facts import JobFacts, gather_facts
from frtools.model.trace import ProcessGroup, RankInfo, Trace, entries_table

MS = 1_000_000
# what every op of these traces shares: an all_reduce of 4 floats on the default group
_ALL_REDUCE = dict(pg_name="0", pg_desc="default_pg", p2p_seq_id=0, is_p2p=False,
                   op="all_reduce", profiling_name="nccl:all_reduce", input_sizes="[[4]]",
                   output_sizes="[[4]]", input_dtypes="Float", output_dtypes="Float")  # fmt: skip


def _facts(
    ops: dict[int, list[tuple[int, str | None]]],
    *,
    gone: tuple[int, ...] = (),
    gloo: bool = False,
    engine: str = "",
    world: int = 3,
) -> JobFacts:
    """One group "0" of ``world`` ranks; ``ops``: rank -> [(seq, outcome)] with outcome
    "completed" / "pending" (NCCL-style states) or, with ``gloo``, PyTorch FR's retired flag
    ("completed": retired) on "scheduled" entries; ``engine``: the profiling names' prefix
    (default: gloo with ``gloo``, else nccl); ``gone``: processes known ended."""
    engine = engine or ("gloo" if gloo else "nccl")
    rows = []
    ranks = {}
    for rank, mine in ops.items():
        for k, (seq, outcome) in enumerate(mine):
            done = outcome == "completed"
            state = "scheduled" if gloo else ("completed" if done else "started")
            row = dict(
                rank=rank,
                record_id=k,
                collective_seq_id=seq,
                state=state,
                retired=done,
                profiling_name=f"{engine}:all_reduce",
            )
            rows.append({**_ALL_REDUCE, **row, "time_created_ns": (10 * seq + rank) * MS})
        info = RankInfo(rank=rank, host="node0", pid=100 + rank, local_rank=rank)
        info.device = f"cuda:{rank}"
        if rank in gone:
            info.alive = False
        ranks[rank] = info
    pgs = {"0": ProcessGroup("0", "default_pg", tuple(range(world)), False)}
    trace = Trace(entries=entries_table(rows), ranks=ranks, process_groups=pgs, world_size=world)
    return gather_facts(trace, align(trace))


def _read(facts: JobFacts, failed_last: tuple[int, ...] = ()) -> dict[tuple[int, int], bool]:
    """(rank, seq) -> completed, as the graph reads it."""
    coll = facts.al.collectives
    done = effective_completion(facts, failed_last)
    return {
        (int(r), int(s)): bool(d)
        for r, s, d in zip(coll["rank"], coll["seq"], done.to_numpy(), strict=True)
    }


def test_marks_stand_when_no_rule_applies() -> None:
    facts = _facts(
        {r: [(1, "completed"), (2, "pending")] for r in range(3)},
    )
    read = _read(facts)
    assert read == {(r, 1): True for r in range(3)} | {(r, 2): False for r in range(3)}
    assert effective_completion(facts).equals(facts.al.collectives["completed"])


def test_completion_without_a_gone_member_is_hollow() -> None:
    """Rank 2's process is gone after seq 1: the seq 2 its peers "completed" cannot have
    finished without it (Gloo records an op that failed on a dead peer as completed)."""
    facts = _facts(
        {
            0: [(1, "completed"), (2, "completed")],
            1: [(1, "completed"), (2, "completed")],
            2: [(1, "completed")],
        },
        gone=(2,),
    )
    read = _read(facts)
    assert read[(0, 1)] and read[(1, 1)] and read[(2, 1)]
    assert not read[(0, 2)] and not read[(1, 2)]


def test_pending_op_overtaken_on_a_gloo_rank_completed() -> None:
    """Gloo's FR (retired flags): rank 1's seq 1 never reported completion, its seq 2 did;
    its CPU runs ops in issue order, so seq 1 completed."""
    facts = _facts(
        {
            0: [(1, "completed"), (2, "completed")],
            1: [(1, "pending"), (2, "completed")],
            2: [(1, "completed"), (2, "completed")],
        },
        gloo=True,
    )
    assert _read(facts)[(1, 1)] is True


def test_pending_op_every_member_issued_on_gloo_passed() -> None:
    """Gloo, a fully listed group: every member issued seq 2 with one signature; nothing
    but a missing, disagreeing or dead member keeps it pending there."""
    facts = _facts(
        {
            0: [(1, "completed"), (2, "pending")],
            1: [(1, "completed"), (2, "pending")],
            2: [(1, "completed"), (2, "completed")],
        },
        gloo=True,
    )
    read = _read(facts)
    assert read[(0, 2)] and read[(1, 2)]


@pytest.mark.parametrize("engine", ["nccl", "nccl2"])
def test_nccl_retired_flags_infer_nothing_from_issue_order(engine: str) -> None:
    """The same retired flags (no timing: states stay "scheduled") from an NCCL engine: its
    groups' ops run on GPU streams, not in turn on the CPU, and one every member issued may
    wait behind a member's GPU stuck elsewhere. Rank 1's seq 1 and every rank's seq 3 stay
    pending."""
    facts = _facts(
        {
            0: [(1, "completed"), (2, "completed"), (3, "pending")],
            1: [(1, "pending"), (2, "completed"), (3, "pending")],
            2: [(1, "completed"), (2, "completed"), (3, "pending")],
        },
        gloo=True,
        engine=engine,
    )
    read = _read(facts)
    assert read[(1, 1)] is False
    assert [read[(r, 3)] for r in range(3)] == [False, False, False]
    gloo = _read(
        _facts(
            {r: [(1, "completed"), (2, "completed"), (3, "pending")] for r in range(3)},
            gloo=True,
        )
    )
    assert [gloo[(r, 3)] for r in range(3)] == [True, True, True]


def test_failed_last_reads_a_ranks_latest_op_as_failed() -> None:
    facts = _facts({r: [(1, "completed"), (2, "completed")] for r in range(3)})
    read = _read(facts, failed_last=(1,))
    assert read[(1, 1)] and not read[(1, 2)]
    assert read[(0, 2)] and read[(2, 2)]


def test_roots_stopped_at_an_op_retired_beside_a_dead_member_quit() -> None:
    """Gloo's FR, rank 2 left no record: ranks 0 and 1 stop at the seq 2 Gloo retired (it
    failed on the dead peer and they raised): they are its victims, not roots."""
    facts = _facts(
        {0: [(1, "completed"), (2, "completed")], 1: [(1, "completed"), (2, "completed")]},
        gloo=True,
    )
    assert facts.absent == {2}
    assert quitters(facts, roots={0, 1}, blocked_at=set()) == {0, 1}
    # a root that is blocked somewhere is not read this way
    assert quitters(facts, roots={0, 1}, blocked_at={0}) == {1}


def test_roots_of_a_group_whose_members_all_left_records_do_not_quit() -> None:
    facts = _facts({r: [(1, "completed"), (2, "completed")] for r in range(3)}, gloo=True)
    assert quitters(facts, roots={0, 1, 2}, blocked_at=set()) == frozenset()
