"""Failure facts in frtools' own record, from real 2-rank Gloo jobs under ``frtools run``.

Rank 1 ends in one way per job — SIGKILL, ``os._exit(3)``, a segfault, an uncaught
``RuntimeError("CUDA error: …")``, ``sys.exit(3)``, or cleanly — while rank 0 waits in an
all_reduce with it. The reader (and ``frtools analyze``) must say how each rank ended, and the
survivor's all_reduce must be failed with Gloo's peer error, not completed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import start_ranks, wait_ranks

from frtools.analyze.readers.loader import load_trace

WORLD = 2
FAULT_RANK = 1
CUDA_ERROR = "CUDA error: an illegal memory access was encountered"
PEER_ERROR = re.compile(r"Connection (closed|reset) by peer|Read error|Timed out waiting")

JOB = textwrap.dedent(
    f"""
    import ctypes, os, signal, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    def fault(kind):
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "os_exit":
            os._exit(3)
        elif kind == "segfault":
            ctypes.string_at(0)
        elif kind == "exception":
            raise RuntimeError({CUDA_ERROR!r})
        elif kind == "sys_exit":
            sys.exit(3)

    def main():
        kind = sys.argv[1]
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        rank = dist.get_rank()
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        dist.barrier()
        if rank == {FAULT_RANK}:
            time.sleep(0.5)  # the survivor is inside the next all_reduce by now
            fault(kind)
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            print(f"rank {{rank}}: all_reduce failed: {{exc}}", flush=True)
            raise
        dist.destroy_process_group()

    main()
    """
)

ENDINGS = ("kill", "os_exit", "segfault", "exception", "sys_exit", "clean")


def frtools_run(out: Path, job_id: str, script: Path, *args: str) -> list[str]:
    run = [sys.executable, "-m", "frtools", "run", "--dir", str(out), "--job-id", job_id]
    return [*run, "--", sys.executable, str(script), *args]


@pytest.fixture(scope="session")
def endings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("endings")
    script = base / "ending_job.py"
    script.write_text(JOB)
    runs = {}
    for kind in ENDINGS:
        argv = frtools_run(base / "frt", kind, script, kind)
        result = wait_ranks(start_ranks(argv, WORLD, env={"FRTOOLS_JOBWIDE": "0"}), 90)
        job = base / "frt" / kind
        runs[kind] = {"dir": job, "result": result, "trace": load_trace(job)}
    return runs


def rank_facts(run: dict, rank: int) -> tuple[str | None, str | None]:
    info = run["trace"].ranks[rank]
    return info.exit_kind, info.exit_detail


def last_op(run: dict, rank: int) -> dict:
    e = run["trace"].entries.to_pandas()
    mine = e[e["rank"] == rank].sort_values("record_id")
    return mine.iloc[-1].to_dict()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("kind", "returncode", "exit_kind", "detail"),
    [
        ("kill", -9, "killed", None),
        ("os_exit", 3, "os_exit", "exit status 3"),
        ("segfault", -11, "signal", "SIGSEGV"),
        ("exception", 1, "exception", f"RuntimeError: {CUDA_ERROR}"),
        ("sys_exit", 3, "exit", "exit status 3"),
    ],
)
def test_how_the_faulty_rank_ended_is_in_its_record(
    endings: dict, kind: str, returncode: int, exit_kind: str, detail: str | None
) -> None:
    run = endings[kind]
    assert run["result"].ranks[FAULT_RANK].returncode == returncode, run["result"].output()
    assert rank_facts(run, FAULT_RANK) == (exit_kind, detail)
    info = run["trace"].ranks[FAULT_RANK]
    assert info.last_heartbeat_ns and info.last_heartbeat_ns <= info.dump_time_ns + 1
    if kind == "exception":  # where it was raised: the job's own line, not a torch frame
        notes = " ".join(i.reason for i in run["trace"].inputs)
        assert "raised at " in notes and "ending_job.py" in notes and " in fault" in notes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["kill", "os_exit", "segfault", "exception", "sys_exit"])
def test_survivor_op_failed_with_the_peer_error_and_it_died_of_it(endings: dict, kind: str) -> None:
    run = endings[kind]
    survivor = run["result"].ranks[0]
    assert survivor.returncode == 1, run["result"].output()
    op = last_op(run, 0)
    assert op["op"] == "all_reduce" and op["collective_seq_id"] == 5  # 3 + barrier + this
    assert op["error"] is not None and PEER_ERROR.search(op["error"]), op
    assert op["state"] != "completed" and not op["retired"]
    ended, detail = rank_facts(run, 0)
    assert ended == "exception" and PEER_ERROR.search(detail or ""), detail
    # the ops before it completed without an error
    e = run["trace"].entries.to_pandas()
    before = e[(e["rank"] == 0) & (e["collective_seq_id"] < 5)]
    assert set(before["state"]) == {"completed"} and before["error"].isna().all()


@pytest.mark.timeout(600)
def test_clean_job_ends_clean_on_every_rank_without_errors(endings: dict) -> None:
    run = endings["clean"]
    assert [r.returncode for r in run["result"].ranks] == [0] * WORLD, run["result"].output()
    assert [rank_facts(run, r) for r in range(WORLD)] == [("clean", None)] * WORLD
    e = run["trace"].entries.to_pandas()
    assert e["error"].isna().all() and set(e["state"]) == {"completed"}


def analyze_json(path: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["kill", "segfault", "exception"])
def test_analyze_blames_the_rank_that_ended_first(endings: dict, kind: str) -> None:
    code, report = analyze_json(endings[kind]["dir"])
    assert code == 1, report
    assert [g["rank"] for g in report["verdict"]["guilty"]] == [FAULT_RANK], report["verdict"]


@pytest.mark.timeout(600)
def test_analyze_finds_no_hang_in_the_clean_job(endings: dict) -> None:
    code, report = analyze_json(endings["clean"]["dir"])
    # healthy; on a loaded machine a rank whose op took longer may be called a straggler,
    # but no rank of a job that ended cleanly is dead, missing or stuck
    assert report["verdict"]["kind"] in ("healthy", "straggler"), report["verdict"]
    assert code == (0 if report["verdict"]["kind"] == "healthy" else 1)


@pytest.mark.timeout(600)
def test_dump_of_a_killed_rank_reads_killed_from_the_manifest(endings: dict, tmp_path) -> None:
    out = tmp_path / "dump"
    root = str(endings["kill"]["dir"].parent)
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "dump", "kill", "--dir", root, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(out)
    assert trace.ranks[FAULT_RANK].alive is False
    assert rank_facts({"trace": trace}, FAULT_RANK) == ("killed", None)
    assert rank_facts({"trace": trace}, 0)[0] == "exception"
