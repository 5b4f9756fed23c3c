"""The recorder sees every c10d op of real 4-rank Gloo jobs, and its files outlive the ranks.

Each job runs ``examples/train_ddp.py`` under ``frtools run`` (tests/jobs.py ranks: plain
python processes with RANK/WORLD_SIZE/MASTER_* set), once per scenario, shared by the tests
through session fixtures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import start_ranks, stop, wait_ranks

from frtools.analyze.readers.loader import load_trace
from frtools.formats.blackbox import SnapshotError, read_header, read_snapshot

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train_ddp.py")
WORLD = 4


def frtools_run(out_dir: Path, job_id: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "frtools",
        "run",
        "--dir",
        str(out_dir),
        "--job-id",
        job_id,
        "--",
        sys.executable,
        TRAIN,
        *args,
    ]


def analyze_json(path: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"stderr": proc.stderr}
    return proc.returncode, report


def guilty_ranks(report: dict) -> list[int]:
    return [g["rank"] for g in report.get("verdict", {}).get("guilty", [])]


# --------------------------------------------------------------------------------------
# A healthy DDP run, recorded by frtools and by PyTorch's Flight Recorder at once
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("ddp_run")
    argv = frtools_run(
        base / "frt", "ddp", "--steps", "4", "--extras", "--torch-fr-dump", str(base / "torch")
    )
    procs = start_ranks(argv, WORLD, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    result = wait_ranks(procs, timeout=150)
    assert [r.returncode for r in result.ranks] == [0] * WORLD, result.output()
    return {"frt": base / "frt" / "ddp", "torch": base / "torch", "result": result}


@pytest.mark.timeout(200)
def test_ddp_reducer_allreduces_are_recorded_like_pytorch_flight_recorder(ddp_run: dict) -> None:
    ours = load_trace(ddp_run["frt"]).entries.to_pandas()
    theirs = load_trace(ddp_run["torch"]).entries.to_pandas()
    assert sorted(ours["rank"].unique()) == list(range(WORLD))
    for rank in range(WORLD):
        mine = ours[(ours["rank"] == rank) & (ours["pg_name"] == "0") & ~ours["is_p2p"]]
        torch_fr = theirs[(theirs["rank"] == rank) & (theirs["pg_name"] == "0")]
        torch_fr = torch_fr[torch_fr["collective_seq_id"] > 0]
        got = list(zip(mine["collective_seq_id"], mine["op"], mine["input_sizes"], strict=True))
        want = list(
            zip(torch_fr["collective_seq_id"], torch_fr["op"], torch_fr["input_sizes"], strict=True)
        )
        assert got == want, f"rank {rank}: frtools {got}\n!= PyTorch FR {want}"
        # the reducer's bucket all-reduces, issued from C++ during backward()
        reducer = mine[(mine["op"] == "all_reduce") & mine["stack"].str.contains("backward")]
        assert len(reducer) >= 4
        assert set(mine["state"]) == {"completed"}


@pytest.mark.timeout(200)
def test_subgroups_and_p2p_carry_global_ranks(ddp_run: dict) -> None:
    trace = load_trace(ddp_run["frt"])
    groups = {pg.desc: pg.ranks for pg in trace.process_groups.values()}
    assert groups["default_pg"] == (0, 1, 2, 3)
    assert groups["evens"] == (0, 2)
    assert groups["odds"] == (1, 3)
    e = trace.entries.to_pandas()
    p2p = e[e["is_p2p"]]
    for rank in range(WORLD):
        mine = p2p[p2p["rank"] == rank]
        sends = mine[mine["op"] == "send"]
        recvs = mine[mine["op"] == "recv"]
        assert list(sends["peer"]) == [(rank + 1) % WORLD]
        assert list(recvs["peer"]) == [(rank - 1) % WORLD]
        assert sorted(mine["p2p_seq_id"]) == [1, 2]
        assert (mine["collective_seq_id"] == 0).all()
    sub = e[e["pg_desc"].isin(["evens", "odds"])]
    assert list(sub["collective_seq_id"]) == [1] * WORLD
    assert set(sub["input_sizes"]) == {"[[5]]"}


@pytest.mark.timeout(200)
def test_healthy_run_is_diagnosed_healthy(ddp_run: dict) -> None:
    code, report = analyze_json(ddp_run["frt"])
    assert code == 0, report
    assert report["verdict"]["kind"] == "healthy"


# --------------------------------------------------------------------------------------
# Ranks that die or wedge: their black boxes still tell
# --------------------------------------------------------------------------------------

FAULT_RANK = 2


def fault_args(kind: str) -> list[str]:
    return ["--steps", "6", "--fault", kind, "--fault-rank", str(FAULT_RANK), "--fault-step", "3"]


@pytest.fixture(scope="session")
def dead_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = {}
    for kind in ("kill", "exit"):
        base = tmp_path_factory.mktemp(f"fault_{kind}")
        # survivors fail fast on Gloo when a peer dies; --linger keeps them blocked a while,
        # as NCCL ranks would be, so their last op is visibly old
        argv = frtools_run(base, kind, *fault_args(kind), "--timeout", "20", "--linger", "7")
        result = wait_ranks(start_ranks(argv, WORLD, env={"FRTOOLS_STALL_SECONDS": "2"}), 90)
        runs[kind] = {"dir": base / kind, "result": result}
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["kill", "exit"])
def test_dead_rank_file_holds_its_last_ops(dead_rank_runs: dict, kind: str) -> None:
    run = dead_rank_runs[kind]
    assert run["result"].ranks[FAULT_RANK].returncode in (-9, 3), run["result"].output()
    snap = read_snapshot(run["dir"] / f"rank_{FAULT_RANK}.frt")
    ops = [snap.string(op) for op in snap.slots["op"]]
    # DDP start-up (5) + 3 steps x (1 or 2 buckets): the steps before the fault, and no more
    assert ops.count("gloo:all_reduce") >= 3
    survivors = [read_snapshot(run["dir"] / f"rank_{r}.frt") for r in (0, 1, 3)]
    for s in survivors:
        assert s.records_written > snap.records_written  # they went on to the next op


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["kill", "exit"])
def test_dead_rank_is_blamed_by_analyze(dead_rank_runs: dict, kind: str) -> None:
    code, report = analyze_json(dead_rank_runs[kind]["dir"])
    assert code == 1, report
    assert guilty_ranks(report) == [FAULT_RANK], report.get("verdict")


def _stalled(path: Path) -> bool:
    """The rank's watchdog flagged a stall; False while its file is still being created
    (it exists, sized, before the black box writes its header)."""
    try:
        return bool(read_header(path)["stalled"])
    except (OSError, SnapshotError):
        return False


@pytest.fixture(scope="session")
def gil_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 2 holds the GIL forever; looked at while it is still alive."""
    base = tmp_path_factory.mktemp("fault_gil")
    argv = frtools_run(base, "gil", *fault_args("gil"), "--timeout", "25")
    procs = start_ranks(argv, WORLD, env={"FRTOOLS_STALL_SECONDS": "2"})
    out: dict = {"dir": base / "gil"}
    try:
        path = base / "gil" / f"rank_{FAULT_RANK}.frt"
        deadline = time.monotonic() + 90
        # wait until the others are blocked on the hog for a while (their watchdogs stall)
        while time.monotonic() < deadline:
            if all(_stalled(base / "gil" / f"rank_{r}.frt") for r in (0, 1, 3)):
                break
            time.sleep(0.5)
        time.sleep(4)  # ops in flight for under 5 s are not called hung by the analyzer
        out["alive"] = procs[FAULT_RANK].poll() is None
        out["now_ns"] = time.time_ns()
        out["snapshot"] = read_snapshot(path)
        out["analyze"] = analyze_json(base / "gil")
    finally:
        stop(procs)
    return out


@pytest.mark.timeout(200)
def test_rank_holding_gil_has_a_current_readable_file(gil_run: dict) -> None:
    assert gil_run["alive"]
    snap = gil_run["snapshot"]
    assert snap.records_written > 5
    # the native watchdog beats without the GIL
    assert gil_run["now_ns"] - snap.header["heartbeat_ns"] < 5e9


@pytest.mark.timeout(200)
def test_rank_holding_gil_is_blamed(gil_run: dict) -> None:
    code, report = gil_run["analyze"]
    assert code == 1, report
    assert guilty_ranks(report) == [FAULT_RANK], report.get("verdict")


# --------------------------------------------------------------------------------------
# Never hurt the job
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_unwritable_dir_warns_once_and_the_job_completes(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the recorder wants a directory")
    argv = frtools_run(blocker / "sub", "j", "--steps", "2")
    result = wait_ranks(start_ranks(argv, WORLD), 150)
    assert [r.returncode for r in result.ranks] == [0] * WORLD, result.output()
    for r in result.ranks:
        lines = [line for line in r.stderr.splitlines() if "frtools" in line]
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith("frtools: recording disabled: cannot create ")
        assert str(blocker) in lines[0]
        assert "step 1" in r.stdout


# --------------------------------------------------------------------------------------
# CUDA completion, judged as tests/gpu/check_recorder_gpu.py judges it, with fake events
# --------------------------------------------------------------------------------------


def _fake_cuda_box(path: Path, end_done: bool) -> None:
    from frtools.recorder.native import load_native

    identity = {"job_id": "gpu", "rank": 0, "world_size": 1, "device": "cuda:0"}
    box = load_native().BlackBox(str(path), 16, 1 << 16, json.dumps(identity))
    box._fake_events(True)
    pg = box.add_process_group("0", "default_pg", [0])
    op, sizes, dtypes = box.intern("nccl:all_reduce"), box.intern("[[4]]"), box.intern("Float")
    rid = box.record(pg, op, 1, 0, -1, False, sizes, sizes, dtypes, dtypes, 0)
    box._fake_event_set(101, True, 10.0)
    box._fake_event_set(102, end_done, 12.5)
    box.watch_cuda(rid, 101, 102)
    box._poll_once()
    box.close()


@pytest.mark.timeout(30)
def test_gpu_check_accepts_ops_completed_by_cuda_events(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from check_recorder_gpu import check_snapshot

    _fake_cuda_box(tmp_path / "done.frt", end_done=True)
    assert check_snapshot(tmp_path / "done.frt", 1) == []
    assert read_snapshot(tmp_path / "done.frt").slots["duration_ms"][0] == pytest.approx(2.5)

    _fake_cuda_box(tmp_path / "running.frt", end_done=False)
    problems = check_snapshot(tmp_path / "running.frt", 1)
    assert len(problems) == 1 and "is 'started', not completed" in problems[0]


# --------------------------------------------------------------------------------------
# enable() / disable() in-process
# --------------------------------------------------------------------------------------

ENABLE_SCRIPT = """
import sys, torch, torch.distributed as dist, frtools.recorder as fr
mode, out = sys.argv[1], sys.argv[2]
if mode == "before":
    assert fr.enable(dir=out, job_id="j")
dist.init_process_group("gloo")
if mode == "after":
    assert fr.enable(dir=out, job_id="j")
later = dist.new_group([0], group_desc="later")
dist.all_reduce(torch.ones(2))
dist.all_reduce(torch.ones(3), group=later)
fr.disable()
dist.all_reduce(torch.ones(4), group=later)
from frtools.recorder import capture
print(dist.get_backend(), dist.get_backend(later), fr.is_enabled(), capture.capture_mode())
dist.destroy_process_group()
"""

BOTH = [("default_pg", "[[2]]"), ("later", "[[3]]")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "recorded"),
    # enabled after init: hooks attach to the groups that exist too, wrapping cannot
    [("before", {"hooks": BOTH, "wrap": BOTH}), ("after", {"hooks": BOTH, "wrap": BOTH[1:]})],
)
def test_enable_before_or_after_init_records_the_groups_created_after_it(
    tmp_path: Path, mode: str, recorded: dict
) -> None:
    from jobs import run_job

    script = tmp_path / "enable_job.py"
    script.write_text(ENABLE_SCRIPT)
    result = run_job(script, world_size=1, args=[mode, str(tmp_path / "out")], timeout=100)
    assert result.ranks[0].returncode == 0, result.output()
    *names, capture = result.ranks[0].stdout.split()
    assert names == ["gloo", "gloo", "False"]  # names unchanged
    entries = load_trace(tmp_path / "out" / "j").entries.to_pandas()
    got = list(zip(entries["pg_desc"], entries["input_sizes"], strict=True))
    assert got == recorded[capture]
