"""``frtools synth`` writes what it says, in the format PyTorch writes; ``frtools export``
round-trips what the readers see."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import run_job

from frtools.synth import synthesize

MEGATRON_DESCS = {
    "default_pg",
    "DATA_PARALLEL_GROUP",
    "CONTEXT_PARALLEL_GROUP",
    "TENSOR_MODEL_PARALLEL_GROUP",
    "PIPELINE_MODEL_PARALLEL_GROUP",
    "EXPERT_MODEL_PARALLEL_GROUP",
}


def frtools(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args], capture_output=True, text=True, timeout=timeout
    )


def load(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)  # test-side reading of a file this test just wrote


@pytest.fixture(scope="session")
def missing_job(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """32 ranks (tp 2, pp 2, dp 8), rank 5 stops calling; a 300-entry buffer that wraps."""
    out = tmp_path_factory.mktemp("synth") / "missing"
    proc = frtools(
        "synth", "-o", str(out), "-n", "32", "--tp", "2", "--pp", "2",
        "--fault", "missing", "--fault-ranks", "5", "--seed", "1", "--buffer-size", "300",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.mark.timeout(120)
def test_synth_writes_every_rank_with_megatron_groups_and_a_wrapped_buffer(missing_job):
    out, proc = missing_job
    assert "Wrote 32 rank dumps" in proc.stdout
    assert "expected verdict: missing, guilty [5]" in proc.stdout
    files = sorted(out.glob("nccl_trace_rank_*"))
    assert len(files) == 32
    names_by_group: dict[tuple[str, tuple[int, ...]], set[str]] = {}
    for f in files:
        dump = load(f)
        assert dump["version"] == "2.10"
        assert dump["comm_lib_version"]
        entries = dump["entries"]
        assert len(entries) == 300  # the ring buffer is full ...
        assert entries[0]["record_id"] > 0  # ... and has dropped older calls
        assert [e["record_id"] for e in entries] == list(
            range(entries[0]["record_id"], entries[0]["record_id"] + 300)
        )
        assert {c["desc"] for c in dump["pg_config"].values()} == MEGATRON_DESCS
        for name, cfg in dump["pg_config"].items():
            ranks = tuple(json.loads(cfg["ranks"]))
            names_by_group.setdefault((cfg["desc"], ranks), set()).add(name)
    # a group has one name on every rank, and groups cover the world as Megatron lays it out
    assert all(len(names) == 1 for names in names_by_group.values())
    assert ("TENSOR_MODEL_PARALLEL_GROUP", (4, 5)) in names_by_group  # neighbours
    assert ("PIPELINE_MODEL_PARALLEL_GROUP", (5, 21)) in names_by_group  # same spot, next stage
    assert ("DATA_PARALLEL_GROUP", (1, 3, 5, 7, 9, 11, 13, 15)) in names_by_group
    assert ("default_pg", tuple(range(32))) in names_by_group


@pytest.mark.timeout(120)
def test_synth_truth_names_the_fault_and_peers_wait_for_it(missing_job):
    out, _ = missing_job
    truth = json.loads((out / "truth.json").read_text())
    assert truth["kind"] == "missing" and truth["guilty"] == [5]
    assert truth["layout"] == {"world_size": 32, "tp": 2, "cp": 1, "ep": 1, "dp": 8, "pp": 2}
    pg, seq = truth["process_group"]["name"], truth["collective_seq_id"]
    faulty = load(out / "nccl_trace_rank_5")["entries"]
    assert all(e["state"] == "completed" for e in faulty)  # alive, idle, everything done
    issued = [e for e in faulty if e["process_group"][0] == pg]
    assert max(e["collective_seq_id"] for e in issued) == seq - 1
    peer = 4 if truth["process_group"]["desc"] == "TENSOR_MODEL_PARALLEL_GROUP" else None
    if peer is not None:
        waiting = [
            e
            for e in load(out / f"nccl_trace_rank_{peer}")["entries"]
            if e["process_group"][0] == pg
        ]
        hung = next(e for e in waiting if e["collective_seq_id"] == seq)
        assert hung["state"] == "started"


@pytest.mark.timeout(120)
def test_dead_rank_leaves_no_dump(tmp_path: Path):
    result = synthesize(tmp_path, 16, tp=4, fault="dead", fault_ranks=[6], buffer_size=100, seed=2)
    assert result.truth["kind"] == "dead" and result.truth["guilty"] == [6]
    assert not (tmp_path / "nccl_trace_rank_6").exists()
    assert len(list(tmp_path.glob("nccl_trace_rank_*"))) == 15


@pytest.mark.timeout(120)
def test_same_seed_writes_the_same_bytes(tmp_path: Path):
    a = synthesize(tmp_path / "a", 16, tp=2, pp=2, fault="mismatch-size", seed=9, buffer_size=120)
    b = synthesize(tmp_path / "b", 16, tp=2, pp=2, fault="mismatch-size", seed=9, buffer_size=120)
    assert a.truth == b.truth
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


@pytest.mark.timeout(60)
def test_impossible_layout_is_a_one_line_error(tmp_path: Path):
    proc = frtools("synth", "-o", str(tmp_path / "x"), "-n", "30", "--tp", "4")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: world size 30 is not divisible by tp*pp*ep*cp = 4"
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_synth_refuses_a_directory_with_files(missing_job):
    out, _ = missing_job
    proc = frtools("synth", "-o", str(out), "-n", "8")
    assert proc.returncode == 2
    assert "directory is not empty" in proc.stderr


@pytest.mark.timeout(180)
def test_torchfrtrace_reads_the_output_and_finds_the_missing_rank(missing_job):
    out, _ = missing_job
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "Not all ranks joining collective" in text
    assert "missing ranks: {5}" in text


REAL_DUMP_JOB = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.barrier()
    with open(f"{sys.argv[1]}/rank_{dist.get_rank()}.pkl", "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_synth_dump_has_the_keys_torch_writes(tmp_path: Path, missing_job):
    script = tmp_path / "job.py"
    script.write_text(REAL_DUMP_JOB)
    result = run_job(
        script, world_size=2, args=[str(tmp_path)], env={"TORCH_FR_BUFFER_SIZE": "100"}, timeout=90
    )
    assert not result.timed_out and all(r.returncode == 0 for r in result.ranks), result.output()
    real = load(tmp_path / "rank_0.pkl")
    synth = load(missing_job[0] / "nccl_trace_rank_0")
    assert set(synth) == set(real)
    assert synth["version"] == real["version"]
    real_keys = set().union(*(e.keys() for e in real["entries"]))
    synth_keys = set().union(*(e.keys() for e in synth["entries"]))
    # duration_ms appears only where timing is on; everything else is the same
    assert synth_keys - {"duration_ms"} == real_keys - {"duration_ms"}
    for key, value in real["entries"][0].items():
        if value is not None and key != "duration_ms":
            assert type(synth["entries"][0][key]) is type(value), key
    real_pg = next(iter(real["pg_config"].values()))
    assert {k: type(v) for k, v in real_pg.items()} == {
        k: type(v) for k, v in synth["pg_config"]["0"].items()
    }


@pytest.mark.timeout(120)
def test_export_round_trips_the_trace(missing_job, tmp_path: Path):
    import pandas as pd

    from frtools.analyze.readers import load_trace

    out, _ = missing_job
    target = tmp_path / "entries.parquet"
    proc = frtools("export", str(out), "-o", str(target))
    assert proc.returncode == 0, proc.stderr
    assert "Wrote 9,600 entries of 32 ranks" in proc.stdout
    entries = pd.read_parquet(target)
    trace = load_trace(out)
    expected = trace.entries.to_pandas()
    pd.testing.assert_frame_equal(
        entries.sort_values(["rank", "record_id"]).reset_index(drop=True),
        expected.sort_values(["rank", "record_id"]).reset_index(drop=True),
    )
    ranks = pd.read_parquet(tmp_path / "ranks.parquet")
    assert sorted(ranks["rank"]) == list(range(32))
    groups = pd.read_parquet(tmp_path / "process_groups.parquet")
    tp = groups[groups["pg_desc"] == "TENSOR_MODEL_PARALLEL_GROUP"]
    assert len(tp) == 16 and set(tp["size"]) == {2}


@pytest.mark.timeout(60)
def test_export_of_a_missing_directory_is_a_one_line_error(tmp_path: Path):
    proc = frtools("export", str(tmp_path / "nope"), "-o", str(tmp_path / "e.parquet"))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("no such file or directory")
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_synth_frtools_snapshots_are_read_and_diagnosed(tmp_path: Path):
    from frtools.formats.blackbox import read_snapshot

    out = tmp_path / "frt"
    proc = frtools(
        "synth", "-o", str(out), "-n", "16", "--tp", "4", "--format", "frtools",
        "--fault", "missing", "--fault-ranks", "6", "--buffer-size", "200", "--seed", "4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("rank_*.frt"))) == 16
    snap = read_snapshot(out / "rank_5.frt")
    assert snap.wrapped and snap.capacity == 200
    assert snap.identity["rank"] == 5 and snap.identity["host"] == "node00000"
    verdict = json.loads(frtools("analyze", str(out), "--format", "json").stdout)["verdict"]
    assert verdict["kind"] == "missing"
    assert [g["rank"] for g in verdict["guilty"]] == [6]


@pytest.mark.timeout(60)
def test_order_fault_that_cannot_deadlock_is_refused(tmp_path: Path):
    # ranks 12 and 14 are the whole context-parallel group they swap their order with
    proc = frtools(
        "synth", "-o", str(tmp_path / "o"), "-n", "16", "--tp", "2", "--cp", "2", "--pp", "4",
        "--fault", "order", "--fault-ranks", "12,14", "--buffer-size", "100",
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: order on ranks [12, 14] does not hang this job (the faulty ranks only wait "
        "for each other); choose other ranks"
    )


@pytest.mark.timeout(120)
def test_every_hang_fault_leaves_a_call_incomplete(tmp_path: Path):
    for i, fault in enumerate(["missing", "mismatch-op", "order", "stuck"]):
        out = tmp_path / fault
        synthesize(
            out, 16, tp=2, cp=2, pp=4, fault=fault, n_faulty=2, seed=524357 + i, buffer_size=60
        )
        states = {e["state"] for f in out.glob("nccl_trace_rank_*") for e in load(f)["entries"]}
        assert states & {"started", "scheduled"}, fault
