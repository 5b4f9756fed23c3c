"""Fleet analysis on Ray (docs/fleet.md): the per-node task and how a node finds its job's
records (every layout ``frtools analyze`` reads) without Ray, then a real local multi-node
Ray cluster (``ray.cluster_utils.Cluster``) whose nodes each hold one host's black boxes,
and a part of a PyTorch Flight Recorder job's dumps, under their own ``FRTOOLS_DIR``.

The cluster tests share one cluster (~25-40 s to start on two loaded cores); they carry the
``ray`` marker (``-m 'not ray'`` leaves them out) and are skipped where Ray is not
installed."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from frtools.analyze.diagnose import diagnose
from frtools.analyze.ray_fleet import _select_nodes, find_job_dirs, summarize_node
from frtools.analyze.readers import load_trace
from frtools.formats.summary_packed import decode_packed, to_summaries
from frtools.synth import synthesize

JOB = "train-42"
PT_JOB = "pt-7"  # PyTorch's own recorder only: nccl_trace_rank_<R> pickles
PT_SPLIT = ((0, 6), (6, 11), (11, 16))  # node -> its ranks [a, b) of the 16
SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"


def _verdict_key(v) -> tuple:
    pg = v.process_group
    return (v.kind, tuple(sorted(v.guilty_ranks)), pg.name if pg else None, v.op)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], tuple]:
    """A 24-rank job (3 hosts of 8) with a missing rank, as boxes under three nodes'
    FRTOOLS_DIR/<job>/, and the verdict from all the boxes in one place."""
    root = tmp_path_factory.mktemp("fleet")
    boxes = root / "all"
    synthesize(boxes, 24, tp=4, pp=2, fault="missing", fault_ranks=[13], seed=4,
               buffer_size=400, format="frtools", workers=1)  # fmt: skip
    dirs = {}
    for host in range(3):
        d = root / f"node{host}" / JOB
        d.mkdir(parents=True)
        for r in range(8 * host, 8 * host + 8):
            os.link(boxes / f"rank_{r}.frt", d / f"rank_{r}.frt")
        dirs[f"node{host}"] = d.parent
    return root, dirs, _verdict_key(diagnose(load_trace(boxes, workers=1)))


@pytest.fixture(scope="module")
def torch_job(fleet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple]:
    """A 16-rank job's PyTorch FR pickles (rank 11 missing), as TORCH_FR_DUMP_TEMP_FILE
    writes them: a part under each fleet node's FRTOOLS_DIR/pt-7/, and the verdict from all
    of them in one place."""
    _, dirs, _ = fleet
    dumps = tmp_path_factory.mktemp("torch") / "all"
    synthesize(dumps, 16, tp=4, pp=2, fault="missing", fault_ranks=[11], seed=3,
               buffer_size=300, format="torch", workers=1)  # fmt: skip
    for (a, b), node in zip(PT_SPLIT, sorted(dirs), strict=True):
        d = dirs[node] / PT_JOB
        d.mkdir()
        for r in range(a, b):
            os.link(dumps / f"nccl_trace_rank_{r}", d / f"nccl_trace_rank_{r}")
    return dumps, _verdict_key(diagnose(load_trace(dumps, workers=1)))


def _as_json(src: Path, dst: Path, name: str = "{}.json") -> None:
    """PyTorch FR pickles -> the same dumps as JSON (``_dump_fr_trace_json``'s form)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.glob("nccl_trace_rank_*"):
        data = pickle.loads(p.read_bytes())  # our own synthesized file
        (dst / name.format(p.name)).write_text(json.dumps(data, sort_keys=True))


def test_a_node_task_summarizes_its_job_under_frtools_dir(fleet, monkeypatch) -> None:
    _, dirs, _ = fleet
    monkeypatch.setenv("FRTOOLS_DIR", str(dirs["node1"]))
    report = summarize_node(job=JOB, window=32)
    assert report.error is None and report.ranks == list(range(8, 16))
    assert report.host == "node00001"
    summaries = to_summaries(decode_packed(report.data))
    assert [s.rank for s in summaries] == report.ranks
    assert all(len(s.entries) >= 32 for s in summaries)


def test_a_node_without_records_says_so_and_is_not_an_error(tmp_path: Path) -> None:
    report = summarize_node(root=str(tmp_path), job=JOB)
    assert report.data is None and report.error is None
    assert "no records of job 'train-42'" in report.note


def test_a_node_with_two_jobs_asks_which(fleet, tmp_path: Path) -> None:
    _, dirs, _ = fleet
    for name in ("a", "b"):
        shutil.copytree(dirs["node0"] / JOB, tmp_path / name)
    assert set(find_job_dirs(tmp_path)) == {"a", "b"}
    report = summarize_node(root=str(tmp_path))
    assert report.data is None and "2 jobs" in (report.error or "")
    assert summarize_node(root=str(tmp_path), job="b").ranks == list(range(8))


def test_a_node_finds_its_job_in_every_layout_the_analyzer_reads(
    fleet, torch_job, tmp_path: Path
) -> None:
    _, dirs, _ = fleet
    dumps, _ = torch_job
    # the recorder's FRTOOLS_DIR/<job>/rank_<R>.frt, beside a job of PyTorch pickles
    assert find_job_dirs(dirs["node1"]) == {
        JOB: dirs["node1"] / JOB,
        PT_JOB: dirs["node1"] / PT_JOB,
    }
    # PyTorch pickles straight in the folder TORCH_FR_DUMP_TEMP_FILE names
    assert find_job_dirs(dumps) == {"all": dumps}
    # PyTorch JSON dumps, any file name, under job folders
    _as_json(dumps, tmp_path / "json" / "pt-9", "fr-{}.json")
    assert list(find_job_dirs(tmp_path / "json")) == ["pt-9"]
    # an `frtools dump` folder (manifest, boxes, host summary), and host summaries alone
    shutil.copytree(SAMPLES / "crashed-frtools", tmp_path / "dumps" / "incident-3")
    summaries = tmp_path / "summaries" / "incident-4"
    summaries.mkdir(parents=True)
    shutil.copy(SAMPLES / "crashed-frtools" / "vm.summary", summaries)
    assert list(find_job_dirs(tmp_path / "dumps")) == ["incident-3"]
    assert list(find_job_dirs(tmp_path / "summaries")) == ["incident-4"]
    # files no reader claims are no job, whatever their names say
    noise = tmp_path / "noise" / "job"
    noise.mkdir(parents=True)
    (noise / "nccl_trace_rank_0").write_bytes(b"not a dump")
    (noise / "README.txt").write_text("rank_1 notes")
    (noise / "rank_2.stacks").write_text("Thread 1\n")
    assert find_job_dirs(tmp_path / "noise") == {}


def test_a_node_summarizes_pytorch_dumps_like_frtools_summarize(torch_job, tmp_path) -> None:
    dumps, _ = torch_job
    report = summarize_node(root=str(dumps))
    assert report.error is None and report.ranks == list(range(16))
    out = subprocess.run(
        [sys.executable, "-m", "frtools", "summarize", str(dumps), "-o", "-"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    summaries = lambda data: [(s.rank, len(s.entries)) for s in to_summaries(decode_packed(data))]  # noqa: E731
    assert summaries(report.data) == summaries(out.stdout)


def test_a_pattern_picks_one_jobs_dumps_from_a_shared_folder(torch_job, tmp_path: Path) -> None:
    dumps, _ = torch_job
    shared = tmp_path / "fr"  # one /tmp-like folder, two jobs' prefixes
    shared.mkdir()
    for r in range(8):
        os.link(dumps / f"nccl_trace_rank_{r}", shared / f"jobA_rank_{r}")
        os.link(dumps / f"nccl_trace_rank_{r + 8}", shared / f"jobB_rank_{r + 8}")
    assert summarize_node(root=str(shared), pattern="jobA_").ranks == list(range(8))
    assert summarize_node(root=str(shared), pattern="jobB_*").ranks == list(range(8, 16))
    assert summarize_node(root=str(shared)).ranks == list(range(16))
    nothing = summarize_node(root=str(shared), pattern="nccl_trace_rank_")
    assert nothing.data is None and nothing.error is None
    assert nothing.note == f"no records matching 'nccl_trace_rank_' under {shared}"
    assert sorted(p.name for p in shared.iterdir())[:2] == ["jobA_rank_0", "jobA_rank_1"]


def test_pattern_without_ray_is_a_usage_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(SAMPLES / "healthy"),
         "--pattern", "rank_"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "frtools analyze: error: --job, --pattern, --window, --summaries and --fan-in go with --ray"
    )
    out = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", "--ray", "--fan-in", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr.strip() == "frtools analyze: error: --fan-in must be at least 2 (0: no merging)"
    )


def test_nodes_are_chosen_by_name_ip_resource_or_label() -> None:
    nodes = [
        {"NodeID": "a1", "Alive": True, "NodeManagerHostname": "gpu-a", "NodeManagerAddress": "10.0.0.1",
         "Resources": {"frtools_host": 1.0}, "Labels": {"rack": "r1"}},
        {"NodeID": "b2", "Alive": True, "NodeManagerHostname": "gpu-b", "NodeManagerAddress": "10.0.0.2",
         "Resources": {}, "Labels": {"rack": "r2"}},
        {"NodeID": "c3", "Alive": False, "NodeManagerHostname": "gpu-c", "NodeManagerAddress": "10.0.0.3",
         "Resources": {"frtools_host": 1.0}, "Labels": {}},
    ]  # fmt: skip
    ids = lambda chosen: [n["NodeID"] for n in chosen]  # noqa: E731
    assert ids(_select_nodes(nodes, None, None, None)) == ["a1", "b2"]
    assert ids(_select_nodes(nodes, ["gpu-b", "10.0.0.1"], None, None)) == ["a1", "b2"]
    assert ids(_select_nodes(nodes, None, "frtools_host", None)) == ["a1"]
    assert ids(_select_nodes(nodes, None, None, "rack=r2")) == ["b2"]


@pytest.fixture(scope="module")
def cluster(fleet, torch_job, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A local Ray cluster: a head without records and one node per fleet host, each with
    its own FRTOOLS_DIR (the boxes of train-42 and a part of pt-7's PyTorch dumps)."""
    with pytest.MonkeyPatch.context() as mp:
        # every node, the driver and the command line on 127.0.0.1, not this host's
        # interface (Ray reads the variable when it is imported)
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if "ray" in sys.modules:
            pytest.skip("Ray was imported before the loopback-only setting could apply")
        ray = pytest.importorskip("ray")
        from ray.cluster_utils import Cluster

        _, dirs, _ = fleet
        empty = tmp_path_factory.mktemp("head")
        loopback = {"node_ip_address": "127.0.0.1", "num_cpus": 1}
        c = Cluster(
            initialize_head=True,
            head_node_args={**loopback, "include_dashboard": False,
                            "env_vars": {"FRTOOLS_DIR": str(empty)}},
        )  # fmt: skip
        try:
            for name, d in dirs.items():
                c.add_node(
                    **loopback,
                    resources={"frtools_host": 1},
                    labels={"frtools-host": name},
                    env_vars={"FRTOOLS_DIR": str(d)},
                )
            c.wait_for_nodes()
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def _connect(cluster) -> None:  # noqa: ANN001
    import ray

    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)


def _cli_on_ray(cluster, *args: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    """``frtools analyze --ray=ADDRESS ARGS --format json`` from another process."""
    return subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", f"--ray={cluster.address}", *args,
         "--format", "json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""},
    )  # fmt: skip


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_cluster_summarizes_on_each_node_and_gives_the_full_records_verdict(
    fleet, cluster, tmp_path: Path
) -> None:
    import ray

    from frtools.analyze.ray_fleet import analyze_on_ray

    _, _, expected = fleet
    _connect(cluster)
    seen = []
    kept = tmp_path / "summaries"
    # merge tasks on the cluster, two summaries at a time: the driver receives two partials
    result = analyze_on_ray(job=JOB, summaries_dir=kept, on_report=seen.append, fan_in=2)
    assert _verdict_key(result.verdict) == expected
    assert sorted(r for report in seen for r in report.ranks) == list(range(24))
    assert len(seen) == 4  # three nodes with records and the head without
    partials = sorted(kept.iterdir())
    assert [p.name for p in partials] == ["node00000..node00001.summary", "node00002.summary"]
    assert [len(decode_packed(p.read_bytes()).hosts) for p in partials] == [2, 1]
    # the flat gather: every host summary to the driver
    flat = tmp_path / "flat"
    result = analyze_on_ray(job=JOB, summaries_dir=flat, fan_in=None)
    assert _verdict_key(result.verdict) == expected
    assert sorted(p.name for p in flat.iterdir()) == [
        "node00000.summary", "node00001.summary", "node00002.summary"
    ]  # fmt: skip
    # only the nodes with a custom resource (the head has none)
    assert len(analyze_on_ray(job=JOB, resource="frtools_host").reports) == 3
    ray.shutdown()
    # the command line, from another process, to the same cluster
    cli_kept = tmp_path / "cli-summaries"
    out = _cli_on_ray(cluster, "--job", JOB, "--fan-in", "2", "--summaries", str(cli_kept))
    assert out.returncode == 1, out.stderr[-2000:]
    verdict = json.loads(out.stdout)["verdict"]
    assert verdict["kind"] == expected[0]
    assert sorted(g["rank"] for g in verdict["guilty"]) == list(expected[1])
    assert sorted(p.name for p in cli_kept.iterdir()) == [p.name for p in partials]


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_cluster_reads_pytorch_dumps_spread_over_its_nodes(torch_job, cluster) -> None:
    import ray

    from frtools.analyze.ray_fleet import analyze_on_ray

    _, expected = torch_job
    assert expected[:2] == ("missing", (11,))
    _connect(cluster)
    for pattern in (None, "nccl_trace_rank_"):
        seen = []
        result = analyze_on_ray(job=PT_JOB, pattern=pattern, on_report=seen.append)
        assert _verdict_key(result.verdict) == expected
        assert sorted(sorted(r.ranks) for r in seen if r.ranks) == [
            list(range(a, b)) for a, b in PT_SPLIT
        ]
    ray.shutdown()
    out = _cli_on_ray(cluster, "--job", PT_JOB, "--pattern", "nccl_trace_rank_", "--fan-in", "0")
    assert out.returncode == 1, out.stderr[-2000:]
    verdict = json.loads(out.stdout)["verdict"]
    assert verdict["kind"] == "missing"
    assert [g["rank"] for g in verdict["guilty"]] == [11]
    # a pattern no node's files match: the one-line error the user reads
    out = _cli_on_ray(cluster, "--job", PT_JOB, "--pattern", "rank_")
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]  # after Ray's own "Connecting ..." lines
    assert line.startswith("frtools: error: no node of the Ray cluster had records: ")
    assert "no records of job 'pt-7' matching 'rank_' under" in line
