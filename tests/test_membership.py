"""One owner of group membership (``frtools.analyze.membership``): the loader, the
alignment and the diagnosis see the same members, stated, recorded, then inferred from
sibling groups; one test of the default group; readers declare what their format lists."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from frtools.analyze import membership
from frtools.analyze.align import align
from frtools.analyze.diagnose import diagnose
from frtools.analyze.diagnosis.facts import gather_facts
from frtools.analyze.readers import load_trace
from frtools.analyze.readers.base import Capabilities
from frtools.analyze.readers.registry import READERS, capabilities
from frtools.model.trace import ProcessGroup, is_default


def _entry(i: int, pg: tuple[str, str], pg_id: int, seq: int, state: str) -> dict:
    """One PyTorch 2.10 Flight Recorder entry (Gloo: states stay "scheduled")."""
    return {
        "record_id": i,
        "pg_id": pg_id,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": i + 1,
        "profiling_name": "gloo:all_reduce",
        "time_created_ns": 1_000_000 * (i + 1),
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "is_p2p": False,
        "state": state,
        "retired": state == "completed",
        "frames": [{"filename": "/job/train.py", "line": 7, "name": "step"}],
    }


def _gloo_tp_job(folder: Path, ranks: tuple[int, ...]) -> Path:
    """A 4-rank job, tensor-parallel pairs (0, 1) and (2, 3) that no pg_config lists (as
    Gloo's dumps), every rank in a pair all-reduce that never completes; only ``ranks``
    left a dump."""
    folder.mkdir()
    for r in ranks:
        pair = ("1", "tp") if r < 2 else ("2", "tp")
        dump = {
            "version": "2.10",
            "rank": r,
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
            "pg_status": {"0": {"last_enqueued_collective": 1, "last_completed_collective": 1}},
            "entries": [
                _entry(0, ("0", "default_pg"), 0, 1, "completed"),
                _entry(1, pair, 1, 1, "scheduled"),
            ],
        }
        (folder / f"rank_{r}.pkl").write_bytes(pickle.dumps(dump, protocol=2))
    return folder


@pytest.mark.timeout(60)
def test_a_short_gloo_group_is_completed_from_its_sibling_by_one_membership(
    tmp_path: Path,
) -> None:
    trace = load_trace(_gloo_tp_job(tmp_path / "dumps", (0, 1, 2)))
    # stated: the default group; recorded: the pairs, from who recorded on them
    assert trace.process_groups["0"].ranks == (0, 1, 2, 3)
    assert not trace.process_groups["0"].inferred
    assert trace.process_groups["1"] == ProcessGroup("1", "tp", (0, 1), inferred=True)
    assert trace.process_groups["2"] == ProcessGroup("2", "tp", (2,), inferred=True)
    al = align(trace)
    assert al.members["1"] == (0, 1) and al.members["2"] == (2,)
    # inferred from siblings: pair 2 is short of one, and (2, 3) is the one completion
    # shaped like pair 1
    facts = gather_facts(trace, al)
    assert facts.membership.added == {"2": (3,)}
    assert facts.members("2") == (2, 3)
    assert facts.membership.short == {"2": 1}
    assert facts.complete("1") and facts.complete("2")
    verdict = diagnose(trace)
    assert verdict.guilty_ranks == [3]  # the rank that left no dump, named


def test_sibling_inference_names_a_rank_above_every_file_when_the_world_is_unknown() -> None:
    from frtools.model.trace import Trace, empty_entries

    groups = {
        "1": ProcessGroup("1", "tp", (0, 1), inferred=True),
        "2": ProcessGroup("2", "tp", (2, 3), inferred=True),
        "3": ProcessGroup("3", "tp", (4,), inferred=True),
    }
    trace = Trace(entries=empty_entries(), ranks={}, process_groups=groups, inputs=[])
    found = {name: g.ranks for name, g in groups.items()}
    got, expected = membership.from_siblings(
        trace, found, {0, 1, 2, 3, 4}, frozenset(), world_certain=False
    )
    assert got.beyond == (5,) and 5 in expected
    assert got.added == {"3": (5,)} and got.members["3"] == (4, 5)


def test_most_common_member_list_wins_and_an_unsupported_one_is_refused() -> None:
    from frtools.analyze.readers.base import RankDump
    from frtools.model.trace import RankInfo, empty_entries

    def dump(rank: int, ranks: tuple[int, ...]) -> RankDump:
        groups = {"5": ProcessGroup("5", "dp", ranks), "9": ProcessGroup("9", "", (0, 10**6))}
        return RankDump(RankInfo(rank=rank), empty_entries(), groups)

    stated = membership.stated(
        [dump(0, (0, 1, 2)), dump(1, (0, 1, 2)), dump(2, (0, 2))],
        lambda d: (),
        lambda d: True,
    )
    assert stated.groups["5"].ranks == (0, 1, 2) and stated.disputed == {"5"}
    assert stated.groups["9"].inferred and stated.groups["9"].ranks == ()
    assert "claims 1,000,001" in stated.refused["9"]


def test_a_group_object_shared_by_many_dumps_counts_once_for_each() -> None:
    """The ranks of a host share their ProcessGroup objects (a partial: thousands of ranks
    one object): membership counts each dump that names it, not each distinct object."""
    from frtools.analyze.readers.base import RankDump
    from frtools.model.trace import RankInfo, empty_entries

    shared = ProcessGroup("5", "dp", (0, 1, 2))
    lone = [ProcessGroup("5", "data", (0, 2)) for _ in range(2)]
    dumps = [RankDump(RankInfo(rank=r), empty_entries(), {"5": shared}) for r in (0, 1, 2)]
    dumps += [
        RankDump(RankInfo(rank=r), empty_entries(), {"5": g})
        for r, g in ((3, lone[0]), (4, lone[1]))
    ]
    stated = membership.stated(dumps, lambda d: (), lambda d: True)
    assert stated.groups["5"].ranks == (0, 1, 2) and stated.groups["5"].desc == "dp"
    assert stated.disputed == {"5"}
    # two more dumps name the lone lists: four uses against the shared object's three
    dumps += [RankDump(RankInfo(rank=r), empty_entries(), {"5": lone[r % 2]}) for r in (5, 6)]
    stated = membership.stated(dumps, lambda d: (), lambda d: True)
    assert stated.groups["5"].ranks == (0, 2) and stated.groups["5"].desc == "data"
    assert all(d.process_groups["5"].ranks is stated.groups["5"].ranks for d in dumps[3:])


@pytest.mark.parametrize(
    ("name", "desc", "default"),
    [
        ("0", "default_pg", True),
        ("0", "", True),  # PyTorch 1.x: no description; every process's first group is "0"
        ("0", "undefined", True),
        ("7", "default_pg", True),
        ("1", "tp", False),
        ("", "", False),
        (None, None, False),
    ],
)
def test_the_default_group_is_named_0_or_described_default_pg(
    name: str | None, desc: str | None, default: bool
) -> None:
    assert is_default(name, desc) is default
    if name is not None:
        assert ProcessGroup(name, desc or "").is_default is default


def test_readers_declare_what_their_format_lists() -> None:
    formats = {r.FORMAT: capabilities(r) for r in READERS}
    # a black box's and a summary's group table name every group their ops are on
    assert formats["frtools"].lists_all_groups and formats["frtools-summary"].lists_all_groups
    # Gloo's Flight Recorder dumps record ops on groups their pg_config leaves out
    assert not formats["torch-pickle"].lists_all_groups
    assert not formats["torch-json"].lists_all_groups
    # a black box's header states the world size; a PyTorch dump's does not
    assert formats["frtools"].states_world_size and not formats["torch-json"].states_world_size
    assert formats["frtools-summary"].several_ranks and formats["frtools-summary"].batches
    assert not formats["torch-pickle"].several_ranks
    # a dump's format name asks the same; a format no reader knows declares nothing
    assert capabilities("frtools") == formats["frtools"]
    assert capabilities("no-such-format") == Capabilities()
