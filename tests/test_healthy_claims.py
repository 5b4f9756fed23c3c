"""Healthy means healthy: Gloo's retirement lag at a job's end is not a hang once every
member is accounted for (the nameless pg_config entry of torch 2.13's Gloo dumps lists the
world; ``--world-size`` states it), and no member is invented where nothing states one."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from test_readers import fr_dump, write_pickle

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers.loader import load_trace


def _barrier_end(tmp_path: Path, nameless: str, lagging: tuple[int, ...] = (0, 2)) -> Path:
    """A 4-rank Gloo job's dumps right after its last barrier (#3), as torch 2.13 wrote
    them: ranks in ``lagging`` show the barrier not yet retired."""
    for rank in range(4):
        d = fr_dump("2.10", n=3)
        d["comm_lib_version"] = ""
        d["pg_config"] = {"": {"name": "", "desc": "", "ranks": nameless}}
        for e in d["entries"]:
            e.update(profiling_name="gloo:all_reduce", state="scheduled", retired=True,
                     time_discovered_started_ns=None, time_discovered_completed_ns=None)  # fmt: skip
        d["entries"][-1]["profiling_name"] = "gloo:barrier"
        d["pg_status"]["0"]["last_enqueued_collective"] = 3
        if rank in lagging:
            d["entries"][-1]["retired"] = False
            d["pg_status"]["0"]["last_completed_collective"] = 2
        write_pickle(tmp_path / f"rank_{rank}.pkl", d)
    return tmp_path


@pytest.mark.timeout(60)
def test_torch_2_13_nameless_world_group_makes_a_barrier_lag_healthy(tmp_path: Path) -> None:
    trace = load_trace(_barrier_end(tmp_path, "[0, 1, 2, 3]"))
    world = trace.process_groups["0"]
    assert world.ranks == (0, 1, 2, 3) and not world.inferred
    assert diagnose(trace).kind == "healthy"


@pytest.mark.timeout(60)
def test_stated_world_size_accounts_for_every_member(tmp_path: Path) -> None:
    # torch 2.15's placeholder '[0, 1]' lists nobody: only --world-size says who belongs
    _barrier_end(tmp_path, "[0, 1]")
    assert diagnose(load_trace(tmp_path)).kind == "inconclusive"
    assert diagnose(load_trace(tmp_path, world_size=4)).kind == "healthy"


@pytest.mark.timeout(60)
def test_a_real_hang_stays_a_hang_with_the_world_listed(tmp_path: Path) -> None:
    # rank 3 never issued the barrier: its peers wait for it, listed world or not
    _barrier_end(tmp_path, "[0, 1, 2, 3]", lagging=(0, 1, 2))
    path = tmp_path / "rank_3.pkl"
    d = pickle.loads(path.read_bytes())
    d["entries"] = d["entries"][:-1]
    d["pg_status"]["0"].update(last_enqueued_collective=2, last_completed_collective=2)
    write_pickle(path, d)
    v = diagnose(load_trace(tmp_path))
    assert (v.kind, [g.rank for g in v.guilty]) == ("missing", [3]), v.headline


def test_placeholder_two_rank_list_is_not_read_as_a_world(tmp_path: Path) -> None:
    _barrier_end(tmp_path, "[0, 1]", lagging=())
    assert load_trace(tmp_path).process_groups["0"].inferred


def test_nameless_list_of_a_job_with_subgroups_is_not_read_as_a_world(tmp_path: Path) -> None:
    # with subgroups, Gloo's nameless entry lists '[]' or a subgroup: no statement
    _barrier_end(tmp_path, "[0, 1, 2, 3]", lagging=())
    for rank in range(4):
        path = tmp_path / f"rank_{rank}.pkl"
        d = pickle.loads(path.read_bytes())
        d["pg_status"]["1"] = dict(d["pg_status"]["0"])
        write_pickle(path, d)
    assert load_trace(tmp_path).process_groups["0"].inferred


def _arrivals(tmp_path: Path, late_ms) -> Path:  # noqa: ANN001
    """A healthy 4-rank NCCL-recorded job of 12 collectives; rank r enters collective k
    ``late_ms(r, k)`` ms after the step's start."""
    for rank in range(4):
        d = fr_dump("2.10", n=12)
        for k, e in enumerate(d["entries"]):
            e["time_created_ns"] = k * 1_000_000_000 + int(late_ms(rank, k) * 1e6)
        write_pickle(tmp_path / f"rank_{rank}.pkl", d)
    return tmp_path


def test_lateness_in_stage_order_every_step_is_the_pipeline_schedule(tmp_path: Path) -> None:
    # a 4-stage 1F1B job reaches its per-step loss broadcast in stage order: 50, 35, 17, 0 ms
    stair = {0: 50, 1: 35, 2: 17, 3: 0}
    v = diagnose(load_trace(_arrivals(tmp_path, lambda r, k: stair[r] + (k * 7 + r) % 3)))
    assert v.kind == "healthy", v.headline


def test_one_slow_rank_among_ranks_in_any_order_is_a_straggler(tmp_path: Path) -> None:
    jitter = [[0, 4, 2, 1], [3, 0, 1, 4], [1, 2, 4, 0], [4, 1, 0, 3]]
    v = diagnose(
        load_trace(_arrivals(tmp_path, lambda r, k: (60 if r == 1 else 0) + jitter[k % 4][r]))
    )
    assert (v.kind, [g.rank for g in v.guilty]) == ("straggler", [1]), v.headline
