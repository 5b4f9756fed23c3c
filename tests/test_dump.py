"""``frtools dump`` on real hung 4-rank Gloo jobs (``frtools.commands.demo_job``): per host, job-wide
through the job's TCPStore, PyTorch-FR-only, and the stall hand-off with nobody dumping.

Three jobs, each started once per session: rank 2 stuck in compute (run as two launcher
groups with separate FRTOOLS_DIRs, standing in for two hosts), rank 2 holding the GIL,
rank 2 SIGKILLed. Every job is killed before its fixture returns.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from jobs import free_port, rank_env, stop

from frtools.analyze.diagnose import IN_FLIGHT_NS
from frtools.analyze.readers import load_trace
from frtools.analyze.readers.side_files import apply_side_files
from frtools.analyze.stacks import stacks_summary
from frtools.collect.torch_fr import holds_ops

WORLD = 4
GUILTY = 2
JOB_ID = "hang"
STALL_SECONDS = 3.0


def frtools(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args], capture_output=True, text=True, timeout=timeout
    )


@dataclass
class HungJob:
    port: int
    tmp: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    hung_at: float = 0.0  # wall time when the guilty rank reached its fault
    results: dict = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)


def launch(tmp: Path, fault: str, dirs: dict[int, Path], env: dict[str, str], args=()) -> HungJob:
    """Start a 4-rank job; rank r writes its black box under ``dirs[r]``."""
    job = HungJob(port=free_port(), tmp=tmp)
    for rank in range(WORLD):
        extra = {"FRTOOLS_DIR": str(dirs[rank]), "FRTOOLS_JOB_ID": JOB_ID, **env}
        job.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "frtools.commands.demo_job", "--fault", fault,
                 "--fault-rank", str(GUILTY), "--marker-dir", str(tmp / "markers"), *args],
                env=rank_env(rank, WORLD, job.port, extra),
                stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"rank_{rank}.err", "w"),  # noqa: SIM115
                start_new_session=True,
            )
        )  # fmt: skip
    markers = tmp / "markers"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if markers.is_dir() and len(list(markers.iterdir())) == WORLD:
            job.hung_at = (markers / f"rank_{GUILTY}.ready").stat().st_mtime
            time.sleep(0.5)  # the victims enter their all-reduce
            return job
        if any(p.poll() not in (None, -9) for p in job.procs):
            break
        time.sleep(0.1)
    finish(job)
    pytest.fail("job did not reach the hang:\n" + "\n".join(job.stderr.values()))


def finish(job: HungJob) -> None:
    stop(job.procs)
    for rank in range(len(job.procs)):
        job.stderr[rank] = (job.tmp / f"rank_{rank}.err").read_text(errors="replace")


def manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


# -- jobs ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def compute_job(tmp_path_factory):
    """Rank 2 stuck in compute; ranks 0-1 on "host A", 2-3 on "host B"; also PyTorch's own FR
    with worker-server sockets. Waits for the stall hand-off, then runs every dump form."""
    tmp = tmp_path_factory.mktemp("compute")
    host_a, host_b, socks = tmp / "hostA", tmp / "hostB", tmp / "socks"
    dirs = {0: host_a, 1: host_a, 2: host_b, 3: host_b}
    env = {"FRTOOLS_STALL_SECONDS": str(STALL_SECONDS), "TORCH_FR_BUFFER_SIZE": "200"}
    job = launch(tmp, "compute", dirs, env, ["--torch-socket-dir", str(socks)])
    try:
        stall_dirs = [host_a / JOB_ID / "dumps", host_b / JOB_ID / "dumps"]

        def stall_files() -> set[str]:
            return {p.name for d in stall_dirs if d.is_dir() for p in d.glob("rank_*.frt")}

        deadline = job.hung_at + STALL_SECONDS + 15
        while time.time() < deadline and len(stall_files()) < WORLD:
            time.sleep(0.1)
        job.results["stall_elapsed"] = time.time() - job.hung_at
        job.results["stall_files"] = stall_files()
        job.results["stall_dirs"] = stall_dirs

        t = time.monotonic()
        job.results["jobwide"] = frtools(
            "dump",
            "--job-wide",
            "--store",
            f"127.0.0.1:{job.port}",
            # generous for a loaded CI box: how fast answers come is measured, not tested
            "--timeout",
            "20",
            "-o",
            str(tmp / "shared"),
        )
        job.results["jobwide_s"] = time.monotonic() - t
        job.results["local_a"] = frtools("dump", "--dir", str(host_a), "-o", str(tmp / "outA"))
        job.results["torch"] = frtools(
            "dump", "--torch-socket", str(socks / "*.sock"), "-o", str(tmp / "torch")
        )
    finally:
        finish(job)
    return job


@pytest.fixture(scope="session")
def gil_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gil")
    shm, socks = tmp / "shm", tmp / "socks"
    env = {"FRTOOLS_STALL_SECONDS": "0", "TORCH_FR_BUFFER_SIZE": "200"}
    args = ["--torch-socket-dir", str(socks)]
    job = launch(tmp, "gil", dict.fromkeys(range(WORLD), shm), env, args)
    try:
        # an op younger than the analyzer's in-flight window is not yet a hang: dump when the
        # victims' all-reduce is older than that, as an on-call engineer would
        time.sleep(max(0.0, job.hung_at + IN_FLIGHT_NS / 1e9 + 1 - time.time()))
        t = time.monotonic()
        job.results["dump"] = frtools("dump", "--dir", str(shm), "-o", str(tmp / "out"))
        job.results["dump_s"] = time.monotonic() - t
        job.results["torch"] = frtools(
            "dump",
            "--torch-socket",
            str(socks / "*.sock"),
            "--timeout",
            "2",
            "-o",
            str(tmp / "torch"),
        )
    finally:
        finish(job)
    return job


@pytest.fixture(scope="session")
def killed_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    shm = tmp / "shm"
    job = launch(tmp, "kill", dict.fromkeys(range(WORLD), shm), {"FRTOOLS_STALL_SECONDS": "0"})
    try:
        t = time.monotonic()
        # answers are waited for at most 4 s, so the whole command fits the 5 s promise
        job.results["dump"] = frtools(
            "dump", "hang", "--dir", str(shm), "--timeout", "4", "-o", str(tmp / "out")
        )
        job.results["dump_s"] = time.monotonic() - t
    finally:
        finish(job)
    return job


def guilty_stack_names(directory: Path) -> list[str]:
    trace = load_trace(directory)
    apply_side_files(trace, directory)
    summary = stacks_summary(trace, [GUILTY])
    return [f.name for f in summary.guilty[0].frames]


# -- per host ---------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_dump_collects_every_rank_and_the_gil_holders_stack(gil_job):
    res = gil_job.results["dump"]
    assert res.returncode == 0, res.stderr
    # the speed (~0.3 s here) is measured in docs/dump.md; on a loaded CI box this only
    # guards against the command waiting out a long timeout
    assert gil_job.results["dump_s"] < 30
    out = gil_job.tmp / "out"
    m = manifest(out)
    assert m["ranks_found"] == [0, 1, 2, 3]
    assert m["ranks_answered"] == [0, 1, 2, 3]
    assert "hold_gil_forever" in (out / "rank_2.stacks").read_text()
    assert f"frtools analyze {out}" in res.stdout


@pytest.mark.timeout(180)
def test_analysis_blames_the_gil_holder_and_shows_its_stack(gil_job):
    out = gil_job.tmp / "out"
    res = frtools("analyze", str(out))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Rank 2" in res.stdout
    names = guilty_stack_names(out)
    assert names[:2] == ["hold_gil_forever", "train"]


@pytest.mark.timeout(180)
def test_dump_of_a_killed_rank_names_it_gone_and_keeps_its_black_box(killed_job):
    res = killed_job.results["dump"]
    assert res.returncode == 0, res.stderr
    assert killed_job.results["dump_s"] < 30  # not waiting out a timeout for the dead rank
    out = killed_job.tmp / "out"
    m = manifest(out)
    # Gloo may take the killed rank's peers down with it (their collective fails on the
    # reset connection): the killed rank is gone, every other rank answered or is gone too
    assert 2 in m["ranks_gone"]
    assert 2 not in m["ranks_answered"]
    assert sorted(m["ranks_gone"] + m["ranks_answered"]) == [0, 1, 2, 3]
    assert all((out / f"rank_{r}.frt").exists() for r in range(4))
    assert "process gone" in res.stdout


@pytest.mark.timeout(180)
def test_analysis_blames_the_killed_rank(killed_job):
    res = frtools("analyze", str(killed_job.tmp / "out"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Rank 2" in res.stdout


@pytest.mark.timeout(180)
def test_per_host_dump_collects_only_that_hosts_ranks(compute_job):
    res = compute_job.results["local_a"]
    assert res.returncode == 0, res.stderr
    assert manifest(compute_job.tmp / "outA")["ranks_found"] == [0, 1]


@pytest.mark.timeout(10)
def test_dump_without_recorder_files_is_one_clear_error(tmp_path):
    res = frtools("dump", "--dir", str(tmp_path / "none"), "-o", str(tmp_path / "out"))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("frtools dump: no recorder files under")
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(10)
def test_dump_names_an_unreadable_rank_file_and_collects_the_rest(tmp_path, gil_job):
    bad = tmp_path / "shm" / JOB_ID
    bad.mkdir(parents=True)
    (bad / "rank_0.frt").write_bytes(b"garbage")
    (bad / "rank_1.frt").write_bytes((gil_job.tmp / "out" / "rank_1.frt").read_bytes())
    res = frtools("dump", "--dir", str(tmp_path / "shm"), "-o", str(tmp_path / "out"))
    assert res.returncode == 0
    assert (
        res.stderr.strip()
        == f"frtools dump: {bad / 'rank_0.frt'}: not an frtools snapshot (bad magic)"
    )
    m = manifest(tmp_path / "out")
    assert m["ranks_unreadable"] == [0] and m["ranks_found"] == [0, 1]
    assert m["ranks_gone"] == [1]  # its process ended with the job


# -- job-wide and the stall hand-off ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_stall_snapshots_of_all_ranks_appear_without_anyone_dumping(compute_job):
    r = compute_job.results
    assert r["stall_files"] == {f"rank_{i}.frt" for i in range(WORLD)}
    assert r["stall_elapsed"] <= STALL_SECONDS + 15  # the hand-off, not a poll much later
    logs = "\n".join(compute_job.stderr.values())
    assert "stall detected" in logs and "dumps" in logs
    # the rank that asked everybody wrote a manifest of who answered
    manifests = [manifest(d) for d in r["stall_dirs"] if (d / "manifest.json").exists()]
    assert manifests and manifests[0]["mode"] == "stall"


@pytest.mark.timeout(180)
def test_job_wide_dump_reaches_both_launcher_groups(compute_job):
    res = compute_job.results["jobwide"]
    assert res.returncode == 0, res.stderr
    shared = compute_job.tmp / "shared"
    m = manifest(shared)
    assert m["ranks_answered"] == [0, 1, 2, 3]
    assert m["world_size"] == 4
    assert "compute_forever" in (shared / "rank_2.stacks").read_text()


@pytest.mark.timeout(180)
def test_job_wide_analysis_blames_the_rank_stuck_in_compute(compute_job):
    shared = compute_job.tmp / "shared"
    res = frtools("analyze", str(shared))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Rank 2" in res.stdout
    assert guilty_stack_names(shared)[0] == "compute_forever"


@pytest.mark.timeout(30)
def test_job_wide_dump_with_no_store_is_one_clear_error(tmp_path):
    port = free_port()
    res = frtools(
        "dump", "--job-wide", "--store", f"127.0.0.1:{port}", "--timeout", "1", "-o", str(tmp_path)
    )
    assert res.returncode == 2
    assert f"cannot reach the job's store at 127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr


# -- PyTorch's own Flight Recorder ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_torch_fr_socket_of_a_gil_holder_gives_its_trace_but_says_stacks_are_missing(gil_job):
    res = gil_job.results["torch"]
    assert res.returncode == 0, res.stderr
    out = gil_job.tmp / "torch"
    assert (out / "rank_2.json").exists() and not (out / "rank_2.stacks").exists()
    assert "rank 2: trace collected, but no stacks" in res.stdout
    assert manifest(out)["ranks_answered"] == [0, 1, 2, 3]


@pytest.mark.timeout(30)
def test_nccl_debug_pipe_request_collects_the_dump_written_in_answer(tmp_path):
    """Our side of the NCCL pipe protocol (a rank's FIFO reader stands in for
    ProcessGroupNCCL's monitor thread, which Gloo and CPU builds do not have)."""
    prefix, dump_prefix = str(tmp_path / "pipe_"), str(tmp_path / "nccl_trace_rank_")
    for rank in (0, 1):
        os.mkfifo(f"{prefix}{rank}.pipe")

    def rank0_monitor() -> None:
        fd = os.open(f"{prefix}0.pipe", os.O_RDONLY)  # blocks until frtools opens it
        assert os.read(fd, 16)
        os.close(fd)
        Path(f"{dump_prefix}0").write_bytes(b"\x80\x04trace-bytes")

    reader = threading.Thread(target=rank0_monitor, daemon=True)
    reader.start()
    time.sleep(0.2)
    res = frtools("dump", "--torch-pipe", prefix, "--torch-dump-prefix", dump_prefix,
                  "--timeout", "3", "-o", str(tmp_path / "out"))  # fmt: skip
    reader.join(timeout=5)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "rank_0.pkl").read_bytes() == b"\x80\x04trace-bytes"
    assert "rank 1: nobody reads the pipe" in res.stdout


@pytest.mark.timeout(180)
def test_torch_fr_sockets_are_collected_and_analyzed(compute_job):
    res = compute_job.results["torch"]
    assert res.returncode == 0, res.stderr
    out = compute_job.tmp / "torch"
    assert sorted(p.name for p in out.glob("rank_*.json")) == [f"rank_{r}.json" for r in range(4)]
    assert "compute_forever" in (out / "rank_2.stacks").read_text()
    analysis = frtools("analyze", str(out))
    assert analysis.returncode == 1, analysis.stdout + analysis.stderr
    assert "Rank 2" in analysis.stdout


# What torch 2.15's CUDA build answers ``dump_nccl_trace_pickle`` / ``fr_trace_json?backend=``
# with when that recorder holds nothing (captured from a real Gloo job).
EMPTY_NCCL_PICKLE_2_15 = (
    b"\x80\x02}(X\x07\x00\x00\x00versionq\x00X\x04\x00\x00\x002.10q\x01X\t\x00\x00\x00"
    b"pg_configq\x02}(uX\x10\x00\x00\x00comm_lib_versionq\x03X\x00\x00\x00\x00q\x04X\t\x00"
    b"\x00\x00pg_statusq\x05}(uX\x07\x00\x00\x00entriesq\x06](euq\x07."
)
EMPTY_FR_JSON_2_15 = (
    b'{"comm_lib_version":"","nccl_comm_state":{},"pg_config":{},"pg_status":{},"version":"2.10"}'
)


def test_empty_recorder_answers_are_told_from_traces_with_ops() -> None:
    assert pickle.loads(EMPTY_NCCL_PICKLE_2_15)["entries"] == []
    assert not holds_ops(EMPTY_NCCL_PICKLE_2_15)
    assert not holds_ops(EMPTY_FR_JSON_2_15)
    assert not holds_ops(b'{"entries": [ ], "version": "2.10"}')
    for sample in ("healthy/rank_0.pkl", "torch2.15-order/rank_1.pkl"):
        assert holds_ops(
            (Path(__file__).resolve().parent.parent / "sample_dumps" / sample).read_bytes()
        ), sample
    assert holds_ops(b'{"entries":[{"record_id":0}],"version":"2.10"}')
