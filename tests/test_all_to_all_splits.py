"""all_to_all pair by pair: the recorder keeps each member's split sizes, the readers take
them from frtools' black box and from PyTorch FR dumps that carry them, and a verdict names
the pair of ranks whose sends and receives disagree; uneven splits that agree stay healthy.

Real 4-rank Gloo jobs under ``frtools run`` (MoE-style uneven ``all_to_all_single`` and a
list ``all_to_all`` each step), and tiny explicit PyTorch FR dumps.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import start_ranks, wait_ranks

from frtools.analyze.readers.loader import load_trace
from frtools.formats.blackbox import parse_splits, splits_text

WORLD = 4
WIDTH = 3  # elements per row: a token's hidden size

JOB = textwrap.dedent(
    f"""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    def send_rows(i, j, step):
        return (2 * i + j + step) % 4 + 1  # uneven, as MoE token dispatch is

    def main():
        bad = sys.argv[1] == "bad"
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.all_reduce(torch.ones(4))
        for step in range(3):
            ins = [send_rows(rank, j, step) for j in range(world)]
            outs = [send_rows(i, rank, step) for i in range(world)]
            if bad and step == 2 and rank == 1:
                ins[3] += 2  # rank 1 sends rank 3 two rows more than rank 3 expects
            inp = torch.full((sum(ins), {WIDTH}), float(rank))
            out = torch.empty((sum(outs), {WIDTH}))
            dist.all_to_all_single(out, inp, outs, ins)
            dist.all_to_all([torch.empty(2) for _ in range(world)],
                            [torch.ones(2) for _ in range(world)])
        dist.barrier()
        dist.destroy_process_group()

    main()
    """
)


def send_rows(i: int, j: int, step: int) -> int:
    return (2 * i + j + step) % 4 + 1


def analyze_json(path: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)["verdict"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("a2a")
    script = base / "moe_job.py"
    script.write_text(JOB)
    out = {}
    for kind in ("good", "bad"):
        argv = [sys.executable, "-m", "frtools", "run", "--dir", str(base / "frt")]
        argv += ["--job-id", kind, "--", sys.executable, str(script), kind]
        result = wait_ranks(start_ranks(argv, WORLD, env={"FRTOOLS_JOBWIDE": "0"}), 90)
        assert not result.timed_out, result.output()
        if kind == "good":
            assert all(r.returncode == 0 for r in result.ranks), result.output()
        out[kind] = base / "frt" / kind
    return out


def a2a_rows(path: Path, seq: int) -> dict[int, dict]:
    e = load_trace(path).entries.to_pandas()
    rows = e[(e["op"] == "all_to_all") & (e["collective_seq_id"] == seq)]
    return {int(r["rank"]): r for _, r in rows.iterrows()}


@pytest.mark.timeout(300)
def test_uneven_splits_are_recorded_per_peer_and_agreeing_ones_are_healthy(jobs: dict) -> None:
    # all_reduce #1, then per step all_to_all_single and list all_to_all: step 1 is #4, #5
    rows = a2a_rows(jobs["good"], 4)
    for r in range(WORLD):
        assert list(rows[r]["input_split_sizes"]) == [send_rows(r, j, 1) * WIDTH for j in range(4)]
        assert list(rows[r]["output_split_sizes"]) == [send_rows(i, r, 1) * WIDTH for i in range(4)]
    listed = a2a_rows(jobs["good"], 5)
    assert all(list(listed[r]["input_split_sizes"]) == [2, 2, 2, 2] for r in range(WORLD))
    rc, verdict = analyze_json(jobs["good"])
    assert (rc, verdict["kind"]) == (0, "healthy"), verdict["headline"]


@pytest.mark.timeout(300)
def test_one_rank_sending_a_peer_more_than_it_expects_is_named_with_the_pair(
    jobs: dict,
) -> None:
    rows = a2a_rows(jobs["bad"], 6)
    assert list(rows[1]["input_split_sizes"]) == [3, 6, 9, 18]  # 2 rows more to rank 3
    assert list(rows[3]["output_split_sizes"]) == [6, 12, 6, 12]  # expects 4 rows from rank 1
    rc, verdict = analyze_json(jobs["bad"])
    assert rc == 1 and verdict["kind"] == "mismatch", verdict["headline"]
    assert [g["rank"] for g in verdict["guilty"]] == [1, 3]
    assert verdict["headline"] == (
        "Ranks 1 and 3 disagree in all_to_all #6 on group 0 (default_pg): rank 1 sends 18 "
        "elements to rank 3, rank 3 expects 12"
    )
    assert verdict["collective_seq_id"] == 6
    evidence = "\n".join(verdict["evidence"])
    assert "rank 1 sends 18 elements to rank 3; rank 3 expects 12 from rank 1" in evidence
    assert "cannot tell whose split sizes are wrong" in evidence  # one pair: a tie


@pytest.mark.timeout(300)
def test_the_pair_is_named_after_frtools_dump_too(jobs: dict, tmp_path: Path) -> None:
    # what a user runs: frtools dump collects the boxes and writes the host summary the
    # analysis reads; the summary keeps the split sizes
    job = jobs["bad"]
    out = tmp_path / "dumped"
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "dump", job.name, "--dir", str(job.parent), "-o",
         str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert list(out.glob("*.summary"))
    rc, verdict = analyze_json(out)
    assert rc == 1 and [g["rank"] for g in verdict["guilty"]] == [1, 3]
    assert "rank 1 sends 18 elements to rank 3, rank 3 expects 12" in verdict["headline"]


KILLED_MID_CALL = textwrap.dedent(
    """
    import os, signal
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pg = dist.distributed_c10d._get_default_group()

    def die(args):  # runs after the recorder's pre hook: the op is recorded, not yet issued
        if "ALLTOALL" in str(args.name).upper():
            os.kill(os.getpid(), signal.SIGKILL)

    pg.register_pre_hook(0x7FFFFFFF, die)  # hooks run in id order: the recorder's first
    dist.all_to_all_single(torch.empty(6), torch.ones(6), [6], [6])
    """
)


@pytest.mark.timeout(300)
def test_splits_survive_a_rank_killed_while_its_all_to_all_is_in_flight(tmp_path: Path) -> None:
    # Gloo aborts a rank that receives more than it expects from inside the call; the split
    # sizes must already be on the record then, not written once the call returns
    import torch.distributed as dist

    if not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("process-group pre hooks need torch >= 2.15")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_CALL)
    argv = [sys.executable, "-m", "frtools", "run", "--dir", str(tmp_path / "frt"), "--job-id",
            "killed", "--", sys.executable, str(script)]  # fmt: skip
    result = wait_ranks(start_ranks(argv, 1, env={"FRTOOLS_JOBWIDE": "0"}), 90)
    assert not result.timed_out and result.ranks[0].returncode != 0, result.output()
    rows = a2a_rows(tmp_path / "frt" / "killed", 1)
    assert list(rows[0]["input_split_sizes"]) == [6], result.output()
    assert list(rows[0]["output_split_sizes"]) == [6]


# --- PyTorch FR dumps ---------------------------------------------------------------------


def fr_a2a(i: int, seq: int, ins: list[int] | None, outs: list[int] | None) -> dict:
    """One all_to_all_single entry of rank ``i`` in a 2.11 dump (split keys where given)."""
    e: dict = {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "profiling_name": "nccl:all_to_all",
        "time_created_ns": 1_000 * seq + i,
        "input_sizes": [[_total(ins)]],
        "output_sizes": [[_total(outs)]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "state": "completed",
        "time_discovered_started_ns": 1_000 * seq + 100,
        "time_discovered_completed_ns": 1_000 * seq + 200,
        "retired": True,
        "timeout_ms": 600_000,
        "frames": [{"filename": "/job/moe.py", "line": 7, "name": "dispatch"}],
    }
    if ins is not None:
        e["input_split_sizes"] = ins
    if outs is not None:
        e["output_split_sizes"] = outs
    return e


def _total(splits: list | None) -> int:
    counts = [v for v in splits or [] if isinstance(v, int)]
    return sum(counts) if counts else 8


def write_dumps(path: Path, splits: dict[int, list[tuple[list[int] | None, list[int] | None]]]):
    path.mkdir(parents=True, exist_ok=True)
    for rank, ops in splits.items():
        dump = {
            "version": "2.11",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
            "pg_status": {
                "0": {
                    "last_enqueued_collective": len(ops),
                    "last_started_collective": len(ops),
                    "last_completed_collective": len(ops),
                }
            },  # fmt: skip
            "entries": [fr_a2a(rank, k + 1, ins, outs) for k, (ins, outs) in enumerate(ops)],
        }
        (path / f"rank_{rank}.pkl").write_bytes(pickle.dumps(dump, protocol=2))
    return path


# send[i][j]: elements rank i sends rank j (uneven, agreeing)
SEND = [[1, 2, 3, 4], [4, 1, 2, 3], [3, 4, 1, 2], [2, 3, 4, 1]]


def agreeing(rank: int) -> tuple[list[int], list[int]]:
    return SEND[rank], [SEND[i][rank] for i in range(4)]


@pytest.mark.timeout(120)
def test_fr_dump_whose_splits_disagree_for_one_pair_names_it(tmp_path: Path) -> None:
    ops = {r: [agreeing(r), agreeing(r)] for r in range(4)}
    ins, outs = agreeing(2)
    ops[2][1] = (ins, [outs[0], outs[1], outs[2], 9])  # rank 2 expects 9 from rank 3, sent 4
    rc, verdict = analyze_json(write_dumps(tmp_path / "dumps", ops))
    assert rc == 1 and verdict["kind"] == "mismatch"
    assert [g["rank"] for g in verdict["guilty"]] == [2, 3]
    assert verdict["headline"] == (
        "Ranks 2 and 3 disagree in all_to_all #2 on group 0 (default_pg): rank 3 sends 4 "
        "elements to rank 2, rank 2 expects 9"
    )


@pytest.mark.timeout(120)
def test_fr_dump_rank_disagreeing_with_several_peers_is_the_one_blamed(tmp_path: Path) -> None:
    ops = {r: [agreeing(r)] for r in range(4)}
    ops[0] = [([1, 5, 6, 4], agreeing(0)[1])]  # rank 0 sends ranks 1 and 2 too much
    rc, verdict = analyze_json(write_dumps(tmp_path / "dumps", ops))
    assert verdict["kind"] == "mismatch" and [g["rank"] for g in verdict["guilty"]] == [0]
    assert verdict["headline"].startswith("Rank(s) 0 disagree with their peers in all_to_all #1")
    assert (
        "rank 0 sends 5 elements to rank 1, rank 1 expects 2; 1 more pair(s)"
        in (verdict["headline"])
    )


@pytest.mark.timeout(120)
def test_fr_dump_uneven_agreeing_splits_and_even_empty_lists_are_healthy(tmp_path: Path) -> None:
    ops = {r: [agreeing(r), ([], [2, 2, 2, 2])] for r in range(4)}  # []: the even split of 8
    trace = load_trace(write_dumps(tmp_path / "dumps", ops))
    e = trace.entries.to_pandas().sort_values(["rank", "collective_seq_id"])
    assert [list(v) for v in e["input_split_sizes"]][:2] == [SEND[0], []]
    rc, verdict = analyze_json(tmp_path / "dumps")
    assert (rc, verdict["kind"]) == (0, "healthy"), verdict["headline"]


@pytest.mark.timeout(120)
def test_fr_dump_without_split_keys_reads_and_judges_as_before(tmp_path: Path) -> None:
    ops = {r: [(None, None), (None, None)] for r in range(4)}
    trace = load_trace(write_dumps(tmp_path / "dumps", ops))
    e = trace.entries
    assert e["input_split_sizes"].null_count == e.num_rows == 8
    rc, verdict = analyze_json(tmp_path / "dumps")
    assert (rc, verdict["kind"]) == (0, "healthy"), verdict["headline"]


@pytest.mark.timeout(120)
def test_hostile_split_values_are_null_not_an_error(tmp_path: Path) -> None:
    ops = {r: [agreeing(r)] for r in range(4)}
    ops[1] = [(["x", 1, 2, 3], [-1, 2, 3, 4])]  # type: ignore[list-item]
    trace = load_trace(write_dumps(tmp_path / "dumps", ops))
    e = trace.entries.to_pandas()
    mine = e[e["rank"] == 1].iloc[0]
    assert mine["input_split_sizes"] is None and mine["output_split_sizes"] is None
    assert [i.status for i in trace.inputs] == ["ok"] * 4


def test_box_split_text_round_trips_and_refuses_what_is_not_counts() -> None:
    assert parse_splits(splits_text([6, 2, 0], [4, 4, 0])) == ([6, 2, 0], [4, 4, 0])
    for text in ("", "1,2", "1/2/3", "a/1", "-1/2", "1,,2/3"):
        assert parse_splits(text) is None, text
