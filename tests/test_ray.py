"""Fleet analysis on Ray (docs/fleet.md): the per-node task without Ray, then a real local
multi-node Ray cluster (``ray.cluster_utils.Cluster``) whose nodes each hold one host's
black boxes under their own ``FRTOOLS_DIR``.

The cluster test starts Ray (~25-40 s on two loaded cores); it carries the ``ray`` marker
(``-m 'not ray'`` leaves it out) and is skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
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


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_cluster_summarizes_on_each_node_and_gives_the_full_records_verdict(
    fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every node, the driver and the command line on 127.0.0.1, not this host's interface
    # (Ray reads the variable when it is imported)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "ray" in sys.modules:
        pytest.skip("Ray was imported before the loopback-only setting could apply")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from frtools.analyze.ray_fleet import analyze_on_ray

    _, dirs, expected = fleet
    empty = tmp_path / "head"
    empty.mkdir()
    loopback = {"node_ip_address": "127.0.0.1", "num_cpus": 1}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**loopback, "include_dashboard": False,
                        "env_vars": {"FRTOOLS_DIR": str(empty)}},
    )  # fmt: skip
    try:
        for name, d in dirs.items():
            cluster.add_node(
                **loopback,
                resources={"frtools_host": 1},
                labels={"frtools-host": name},
                env_vars={"FRTOOLS_DIR": str(d)},
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        seen = []
        kept = tmp_path / "summaries"
        result = analyze_on_ray(job=JOB, summaries_dir=kept, on_report=seen.append)
        assert _verdict_key(result.verdict) == expected
        assert sorted(r for report in seen for r in report.ranks) == list(range(24))
        assert len(seen) == 4  # three nodes with records and the head without
        assert sorted(p.name for p in kept.iterdir()) == [
            "node00000.summary", "node00001.summary", "node00002.summary"
        ]  # fmt: skip
        # only the nodes with a custom resource (the head has none)
        assert len(analyze_on_ray(job=JOB, resource="frtools_host").reports) == 3
        ray.shutdown()
        # the command line, from another process, to the same cluster
        out = subprocess.run(
            [sys.executable, "-m", "frtools", "analyze", f"--ray={cluster.address}",
             "--job", JOB, "--format", "json"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""},
        )  # fmt: skip
        assert out.returncode == 1, out.stderr[-2000:]
        verdict = json.loads(out.stdout)["verdict"]
        assert verdict["kind"] == expected[0]
        assert sorted(g["rank"] for g in verdict["guilty"]) == list(expected[1])
    finally:
        ray.shutdown()
        cluster.shutdown()
