"""Device evidence: what a guilty rank's host, GPU and NIC showed at dump time, joined to the
verdict; and hosts named right from file names (issue 25).

A host without GPUs stands in for one: a fake ``nvidia-smi`` on the PATH prints XML shaped after
NVIDIA's ``nvsmi_device_v12.dtd``, a kernel-log file holds Xid lines, a sysfs-shaped tree holds
InfiniBand ports (``device_fixtures``). The collector runs as a real process (``python -m
frtools.collect.device_facts`` and ``frtools dump``) and the job is a real 4-rank Gloo job under
``frtools run`` whose rank 1 never issues the last all_reduce.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from device_fixtures import (
    BILLION_LAUGHS,
    device_env,
    fake_nvidia_smi,
    infiniband_tree,
    kernel_log,
    nvidia_smi_xml,
    xid_line,
)
from jobs import start_ranks, wait_ranks

from frtools.analyze.hardware import attach_device_evidence
from frtools.analyze.readers import load_trace
from frtools.analyze.readers.base import rank_from_filename
from frtools.analyze.verdict import GuiltyRank, Verdict
from frtools.formats import device_facts
from frtools.formats.private_files import FILE_MODE
from frtools.model.devices import HostDevices, IbPort
from frtools.model.trace import RankInfo, Trace, entries_table

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "verdict.schema.json").read_text())
WORLD = 4
GUILTY = 1
JOB = """
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
t = torch.ones(4)
for step in range(3):
    if step == 2 and rank == 1:
        time.sleep(8)  # the others wait in all_reduce #3: their watchdogs see a stall
        sys.exit(0)  # rank 1 leaves without the last all_reduce
    dist.all_reduce(t)
"""


def collect(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "frtools.collect.device_facts", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def sources(path: Path) -> dict[str, tuple[str, str]]:
    facts = device_facts.read(path)
    return {s.source: (s.status, s.detail) for s in facts.sources}


# -- collection ------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_fake_host_facts_are_collected_private_and_read_back(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", nvidia_smi_xml(4, **{"2": {"dram_uncorrectable": 2}}))
    log = kernel_log(
        tmp_path / "kmsg", [xid_line(2, 79, "pid=4102, name=python, GPU has fallen off the bus.")]
    )
    ib = infiniband_tree(
        tmp_path / "ib", {"mlx5_0": {}, "mlx5_1": {"state": "1: DOWN", "link_downed": 4}}
    )
    env = device_env(tmp_path, nvidia_smi_dir=tmp_path / "bin", kmsg=log, sysfs=ib)

    proc = collect(tmp_path / "out", env)

    assert proc.returncode == 0, proc.stderr
    [path] = (tmp_path / "out").glob("device_*.json")
    assert path.stat().st_mode & 0o777 == FILE_MODE
    facts = device_facts.read(path)
    assert [g.pci_bus_id for g in facts.gpus] == [
        "0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0"
    ]  # fmt: skip
    assert facts.gpus[2].ecc["volatile"]["dram_uncorrectable"] == 2
    assert facts.gpus[2].processes == [(4102, "python")]
    [xid] = facts.kernel_events
    assert (xid.code, xid.pci_bus_id) == (79, "0000:47:00.0")  # the log's id has no function
    assert facts.gpu_by_pci(xid.pci_bus_id) is facts.gpus[2]
    assert {(p.device, p.state, p.counters["link_downed"]) for p in facts.ib_ports} == {
        ("mlx5_0", "ACTIVE", 0),
        ("mlx5_1", "DOWN", 4),
    }
    assert sources(path)["ncclras"][0] == "absent"


@pytest.mark.timeout(90)
def test_entity_expanding_nvidia_smi_xml_is_refused_in_one_line(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", BILLION_LAUGHS)
    env = device_env(tmp_path, nvidia_smi_dir=tmp_path / "bin", kmsg=None, sysfs=None)

    proc = collect(tmp_path / "out", env)

    assert proc.returncode == 0, proc.stderr
    status, detail = sources(next((tmp_path / "out").glob("device_*.json")))["nvidia-smi"]
    assert status == "failed"
    assert detail == "nvidia-smi XML refused: it declares entities (no entity is expanded)"
    with pytest.raises(device_facts.DeviceFactsError, match="declares entities"):
        device_facts.parse_nvidia_smi_xml(BILLION_LAUGHS.encode())


@pytest.mark.timeout(90)
def test_huge_nvidia_smi_output_is_cut_off_and_refused(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", huge_bytes=device_facts.MAX_XML_BYTES + 1)
    env = device_env(tmp_path, nvidia_smi_dir=tmp_path / "bin", kmsg=None, sysfs=None)

    assert collect(tmp_path / "out", env).returncode == 0

    status, detail = sources(next((tmp_path / "out").glob("device_*.json")))["nvidia-smi"]
    assert (status, detail) == ("failed", "printed over 16 MiB; refused")


@pytest.mark.timeout(60)
def test_absent_sources_are_one_line_each_never_an_error(tmp_path: Path) -> None:
    env = device_env(tmp_path, nvidia_smi_dir=None, kmsg=None, sysfs=None)

    proc = collect(tmp_path / "out", env)

    assert proc.returncode == 0 and proc.stderr == ""
    got = sources(next((tmp_path / "out").glob("device_*.json")))
    assert got["infiniband"] == (
        "absent", f"{tmp_path / 'no-infiniband'} does not exist (no InfiniBand/RoCE devices)"
    )  # fmt: skip
    assert got["kmsg"] == ("absent", f"{tmp_path / 'no-kmsg'} does not exist")
    assert got["nvidia-smi"][0] == "absent"


@pytest.mark.parametrize(
    "doc, reason",
    [
        ({"kind": "frtools-device-facts", "version": 1}, "device facts name no host"),
        ({"kind": "something-else"}, "not an frtools device-facts file"),
        ("[" * 100_000, "nests too deeply"),
    ],
)
def test_hostile_device_file_is_refused_naming_it(tmp_path: Path, doc: object, reason: str) -> None:
    path = tmp_path / "device_x.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(device_facts.DeviceFactsError) as exc:
        device_facts.read(path)
    assert str(exc.value).startswith(f"{path}: ") and reason in str(exc.value)
    assert "\n" not in str(exc.value)


def test_device_file_fields_of_the_wrong_type_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "device_x.json"
    gpu = {"index": 0, "pci_bus_id": "../../etc", "ecc": {"volatile": {"dram_uncorrectable": -5}}}
    doc = {
        "kind": "frtools-device-facts", "version": 1, "host": "x\x1b[31m",
        "gpus": [gpu, {"index": True}, "junk"],
        "kernel_events": [{"kind": "xid", "code": "79"}, {"kind": "xid", "code": 79}],
        "sources": [{"source": "rm -rf", "status": "collected"}],
    }  # fmt: skip
    path.write_text(json.dumps(doc))
    facts = device_facts.read(path)
    assert facts.host == "x [31m"  # no escape sequence survives
    assert len(facts.gpus) == 1 and facts.gpus[0].pci_bus_id is None and facts.gpus[0].ecc == {}
    assert [e.code for e in facts.kernel_events] == [79]
    assert facts.sources == []


def test_over_sized_device_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "device_x.json"
    path.write_text(" " * (device_facts.MAX_FILE_BYTES + 1))
    with pytest.raises(device_facts.DeviceFactsError, match="refused"):
        device_facts.read(path)


def test_guilty_rank_joins_its_gpu_by_uuid_and_gets_what_is_abnormal_there() -> None:
    xml = nvidia_smi_xml(4, **{"2": {"dram_uncorrectable": 2, "remap_pending": True}})
    host = HostDevices(
        host="gpu-node-a",
        gpus=device_facts.parse_nvidia_smi_xml(xml.encode()),
        kernel_events=device_facts.parse_kernel_log(xid_line(0, 79, "GPU has fallen off the bus.")),
        ib_ports=[
            IbPort(device="mlx5_2", port=1, state="DOWN", phys_state="Disabled",
                   link_layer="InfiniBand", counters={"link_downed": 4}),
        ],
    )  # fmt: skip
    uuid = "5d1b6e3a-0000-4000-8000-000000000002"  # as torch (the recorder) spells GPU 2's
    info = RankInfo(rank=5, host="gpu-node-a", device="cuda:0", device_id=uuid, local_rank=0)
    trace = Trace(entries=entries_table([]), ranks={5: info}, devices={"gpu-node-a": host})
    g = GuiltyRank(rank=5, host="gpu-node-a", device="cuda:0", device_id=uuid, local_rank=0)
    verdict = Verdict(kind="dead", headline="Rank 5 dead", confidence=0.9, guilty=[g])

    attach_device_evidence(verdict, trace)

    assert (g.gpu, g.gpu_inferred, g.pci_bus_id) == (2, False, "0000:47:00.0")
    found = {f.code: f for f in g.findings}
    assert "xid:79" not in found  # GPU 0's Xid is not this rank's GPU
    assert found["ecc:dram_uncorrectable"].text == (
        "GPU 2 (PCI 0000:47:00.0): HBM uncorrectable ECC 2 (since the driver loaded)"
    )
    assert found["ecc:row_remap_pending"].hardware
    assert not found["clocks:hw_slowdown"].hardware
    assert found["ib:port_down"].hardware and found["ib:port_down"].text == (
        "mlx5_2 port 1 is DOWN (Disabled)"
    )
    assert not found["ib:link_downed"].hardware  # counted since the port's reset: a hint
    assert "Rank 5 on gpu-node-a: mlx5_2 port 1 is DOWN (Disabled)." in verdict.evidence


# -- a real job: the verdict names the host and GPU, and shows the finding ---------------------


@pytest.fixture(scope="module")
def job_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 4-rank job under ``frtools run`` on a host whose GPU 1 (rank 1's, by its local rank)
    logged Xid 79; its stall hand-off writes the host's facts beside the ranks' copies. Its
    boxes are then dumped twice: on that host, and on a host with no device evidence."""
    base = tmp_path_factory.mktemp("devjob")
    script = base / "job.py"
    script.write_text(JOB)
    fake_nvidia_smi(base / "bin", nvidia_smi_xml(4))
    line = xid_line(GUILTY, 79, "pid=4101, name=python, GPU has fallen off the bus.")
    log = kernel_log(base / "kmsg", [line])
    ib = infiniband_tree(base / "ib", {"mlx5_0": {}})
    bad = device_env(base, nvidia_smi_dir=base / "bin", kmsg=log, sysfs=ib)
    quiet = kernel_log(base / "quiet", [])
    clean = device_env(base, nvidia_smi_dir=base / "bin", kmsg=quiet, sysfs=ib)

    argv = [sys.executable, "-m", "frtools", "run", "--dir", str(base / "frt"), "--job-id", "j"]
    argv += ["--stall-seconds", "2", "--", sys.executable, str(script)]
    keys = ("PATH", "FRTOOLS_KMSG", "FRTOOLS_INFINIBAND_SYSFS")
    result = wait_ranks(start_ranks(argv, WORLD, env={k: bad[k] for k in keys}), 120)
    assert not result.timed_out, result.output()

    dumps = {"stall": base / "frt" / "j" / "dumps"}
    for name, env in (("xid", bad), ("clean", clean)):
        out = base / name
        proc = subprocess.run(
            [sys.executable, "-m", "frtools", "dump", "j", "--dir", str(base / "frt"), "-o", str(out)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        dumps[name] = out
    return dumps


def analyze(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_xid_on_the_guilty_ranks_gpu_is_joined_to_the_verdict(job_dumps: dict[str, Path]) -> None:
    proc = analyze(job_dumps["xid"], "--format", "json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    [g] = doc["verdict"]["guilty"]
    assert g["rank"] == GUILTY
    assert (g["gpu"], g["gpu_inferred"], g["pci_bus_id"]) == (GUILTY, True, "0000:0f:00.0")
    xid = [f for f in g["findings"] if f["code"] == "xid:79"]
    assert len(xid) == 1 and xid[0]["hardware"] and xid[0]["host"] == g["host"]
    assert "GPU 1 (PCI 0000:0f:00.0): Xid 79 at " in xid[0]["text"]
    assert xid[0]["text"].endswith("(GPU has fallen off the bus)")
    assert f"{g['host']}: kmsg collected" in " ".join(doc["device_sources"])
    action = doc["verdict"].get("action")
    if action is not None:  # the action rules (analyze/action.py) read the findings
        assert action["kind"] == "drain"
        assert g["host"] in action["hosts"]

    text = analyze(job_dumps["xid"]).stdout
    assert "GPU 1 (PCI 0000:0f:00.0) on " in text and "inferred from the rank's local rank" in text
    assert "! GPU 1 (PCI 0000:0f:00.0): Xid 79 at " in text


@pytest.mark.timeout(300)
def test_same_job_without_device_evidence_has_no_findings(job_dumps: dict[str, Path]) -> None:
    proc = analyze(job_dumps["clean"], "--format", "json")
    doc = json.loads(proc.stdout)
    [g] = doc["verdict"]["guilty"]
    assert g["rank"] == GUILTY and g["gpu"] == GUILTY and g["findings"] == []
    action = doc["verdict"].get("action")
    if action is not None:
        assert action["kind"] != "drain"
    assert "! " not in analyze(job_dumps["clean"]).stdout


@pytest.mark.timeout(300)
def test_dump_manifest_has_one_line_per_absent_source(job_dumps: dict[str, Path]) -> None:
    notes = json.loads((job_dumps["xid"] / "manifest.json").read_text())["notes"]
    device = [n for n in notes if n.startswith("device facts on ")]
    assert device == [n for n in device if n.endswith("ncclras (NCCL >= 2.24) is not on PATH")]
    assert len(device) == 1


@pytest.mark.timeout(300)
def test_stall_hand_off_writes_the_hosts_device_facts_beside_the_copies(
    job_dumps: dict[str, Path],
) -> None:
    [path] = job_dumps["stall"].glob("device_*.json")  # one rank of the host collects
    assert path.stat().st_mode & 0o777 == FILE_MODE
    facts = device_facts.read(path)
    assert [(e.code, e.pci_bus_id) for e in facts.kernel_events] == [(79, "0000:0f:00.0")]
    assert sorted(p.name for p in job_dumps["stall"].glob("rank_*.frt")) == [
        f"rank_{r}.frt" for r in range(WORLD)
    ]


# -- hosts named right ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, rank, host",
    [
        ("gpu-node-a.trace_1", 1, "gpu-node-a"),
        ("host-a_rank_5", 5, "host-a"),
        ("node01-rank-5", 5, "node01"),
        ("ip-10-0-3-7.ec2.internal_nccl_trace_rank_12", 12, "ip-10-0-3-7.ec2.internal"),
        ("nccl_trace_rank_3.pkl", 3, None),
    ],
)
def test_host_from_a_file_name_is_cut_at_word_boundaries(name: str, rank: int, host: str) -> None:
    assert rank_from_filename(name) == (rank, host)


def _fr_dump(host: str | None, seqs: int) -> dict:
    """A PyTorch FR dump (format 2.4) of a 2-rank job whose rank issued all_reduce #1..#seqs,
    the last one still waiting."""

    def entry(seq: int) -> dict:
        done = seq < seqs
        return {
            "record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "gloo:all_reduce", "time_created_ns": seq * 10**9,
            "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
            "output_dtypes": ["Float"], "state": "completed" if done else "scheduled",
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": seq * 10**9 + 1 if done else None,
            "retired": done, "timeout_ms": 600000, "is_p2p": False, "frames": [],
        }  # fmt: skip

    dump = {
        "version": "2.4",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {},
        "entries": [entry(s) for s in range(1, seqs + 1)],
    }
    if host is not None:
        dump["host"] = host
    return dump


@pytest.mark.parametrize("own_host", [None, "10.1.2.3"])
def test_record_host_wins_over_the_file_name_and_a_guess_is_marked(
    tmp_path: Path, own_host: str | None
) -> None:
    (tmp_path / "gpu-node-b.trace_0").write_bytes(pickle.dumps(_fr_dump("gpu-node-b", 2)))
    (tmp_path / "gpu-node-a.trace_1").write_bytes(pickle.dumps(_fr_dump(own_host, 1)))
    info = load_trace(tmp_path).ranks[1]
    assert (info.host, info.host_guessed) == (own_host or "gpu-node-a", own_host is None)
    text = analyze(tmp_path).stdout
    assert text.startswith(" MISSING  Rank 1 (") and "never issued all_reduce #2" in text, text
    named = (
        "rank 1 (gpu-node-a, host from the file name" if own_host is None else "rank 1 (10.1.2.3"
    )
    assert named in text
