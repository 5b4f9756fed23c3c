"""The next action in every verdict (docs/actions.md): drain the host on hardware evidence or
a repeat offender, fix the code of a mismatch, order or skip at its call site, restart a
transient fault, investigate the rest; shown in every report; `frtools history`'s drain list
says which hosts to drain and why, with the evidence per host.

The sample dumps are real 4-rank Gloo jobs' dumps (sample_dumps/README.md); the catalog tests
run real `frtools analyze --history` / `frtools history` processes over `frtools synth` dump
sets whose hosts are known (8 ranks a host).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from frtools.analyze.action import RULES, HostHistory, decide_action, with_history
from frtools.analyze.verdict import ACTIONS, DeviceFinding, GuiltyRank, Verdict
from frtools.formats.incidents import (
    FindingRecord,
    GuiltyRecord,
    IncidentRecord,
    open_catalog,
    record_incident,
)

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_dumps"
SCHEMA = json.loads((ROOT / "docs" / "verdict.schema.json").read_text())

# sample set -> the action its verdict asks for
SAMPLE_ACTIONS = {
    "healthy": "none",
    "moe-healthy": "none",
    "torch2.15-moe-healthy": "none",
    "order": "fix code",
    "torch2.15-order": "fix code",
    "size-mismatch": "fix code",
    "op-mismatch": "fix code",
    "skipped": "fix code",
    "dead": "restart",
    "dead-partner": "restart",
    "crashed-frtools": "restart",
    "torch2.15-crashed": "restart",
    "crashed": "investigate",  # a missing dump is the only evidence (confidence 50%)
    "missing": "investigate",
    "missing-chain": "investigate",
    "missing-stacks": "investigate",
    "missing-wrapped": "investigate",
    "damaged": "investigate",
    "straggler": "investigate",
}


def frtools(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def json_of(p: subprocess.CompletedProcess) -> dict:
    assert p.stdout.strip(), p.stderr
    return json.loads(p.stdout)


# -- every sample verdict carries its action -----------------------------------------------


def test_every_sample_set_is_covered() -> None:
    assert {p.name for p in SAMPLES.iterdir() if p.is_dir()} == set(SAMPLE_ACTIONS)


@pytest.mark.parametrize("name", sorted(SAMPLE_ACTIONS))
def test_every_sample_verdict_carries_its_action_with_reasons(name: str) -> None:
    from frtools.analyze.diagnose import diagnose
    from frtools.analyze.readers import load_trace

    verdict = diagnose(load_trace(SAMPLES / name))
    action = verdict.action
    assert action is not None
    assert action.kind == SAMPLE_ACTIONS[name], (verdict.kind, action)
    assert action.rule in RULES
    assert action.reasons and all(r.strip() for r in action.reasons)
    if action.kind == "fix code":  # the call site and its file, for the owner of that file
        assert action.call_sites and action.files
        assert all(Path(f).name.endswith(".py") for f in action.files)
        assert any(site.startswith(action.files[0]) for site in action.call_sites)
    if action.kind == "restart":
        assert action.ranks == verdict.guilty_ranks
    if action.kind == "investigate" and verdict.kind == "inconclusive":
        assert action.missing


def test_json_action_follows_the_schema_and_says_it_in_the_cli() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    p = frtools("analyze", str(SAMPLES / "order"), "--format", "json")
    assert p.returncode == 1, p.stderr
    doc = json_of(p)
    jsonschema.validate(doc["verdict"]["action"], {**SCHEMA, **SCHEMA["$defs"]["action"]})
    action = doc["verdict"]["action"]
    assert action["kind"] == "fix code" and action["rule"] == "code_fault"
    (file,) = action["files"]  # where the dumps were recorded: not this checkout's path
    assert file.endswith("/examples/faulty_job.py")
    text = frtools("analyze", str(SAMPLES / "order")).stdout
    assert "Next:  FIX CODE " in text and "faulty_job.py" in text


def test_schema_lists_every_action_and_rule() -> None:
    props = SCHEMA["$defs"]["action"]["properties"]
    assert tuple(props["kind"]["enum"]) == ACTIONS
    assert tuple(props["rule"]["enum"]) == RULES
    assert SCHEMA["$defs"]["verdict"]["properties"]["action"] == {"$ref": "#/$defs/action"}


# -- the rules, on verdicts built by hand --------------------------------------------------


def xid(host: str = "node7", gpu: int = 3, hardware: bool = True) -> DeviceFinding:
    return DeviceFinding(
        host=host,
        source="kmsg",
        code="xid:79" if hardware else "throttle:thermal",
        text=f"GPU {gpu} (PCI 0000:47:00.0): Xid 79 at 12:03:11 (fell off the bus)"
        if hardware
        else f"GPU {gpu}: clocks throttled (thermal)",
        hardware=hardware,
        gpu=gpu,
        pci_bus_id="0000:47:00.0",
        time="12:03:11",
    )


def dead_verdict(*findings: DeviceFinding, confidence: float = 0.9, **guilty) -> Verdict:
    g = GuiltyRank(
        rank=5,
        host="node7",
        reason="its process was killed without a word",
        call_site="/src/train.py:88 in step",
        gpu=3,
        findings=list(findings),
        **guilty,
    )
    return Verdict(
        kind="dead",
        headline="Rank 5 dead",
        confidence=confidence,
        guilty=[g],
        ranks_expected=8,
        device_sources=["node7: kmsg collected"] if findings else [],
    )


def test_an_xid_on_the_guilty_gpu_drains_the_host_and_names_the_gpu() -> None:
    action = decide_action(dead_verdict(xid()), {5: ("gone", "killed")})
    assert action.kind == "drain" and action.rule == "hardware_evidence"
    assert action.hosts == ["node7"] and action.ranks == [5]
    assert [(g.host, g.gpu, g.pci_bus_id) for g in action.gpus] == [("node7", 3, "0000:47:00.0")]
    assert any("Xid 79" in r and "fell off the bus" in r for r in action.reasons)


def test_an_inferred_gpu_is_said_to_be_inferred() -> None:
    action = decide_action(dead_verdict(xid(), gpu_inferred=True))
    assert action.gpus[0].inferred
    assert "GPU inferred from the local rank" in action.reasons[0]


def test_hardware_evidence_on_an_unnamed_host_names_no_host_to_drain() -> None:
    verdict = dead_verdict(xid(host=""))
    verdict.guilty[0].host = None
    action = decide_action(verdict)
    assert action.kind == "drain" and action.hosts == [] and action.gpus == []
    assert action.reasons[0].startswith("hardware evidence on an unnamed host")


def test_hardware_evidence_drains_even_a_mismatch_and_says_both() -> None:
    verdict = dead_verdict(xid())
    verdict.kind = "mismatch"
    action = decide_action(verdict)
    assert action.kind == "drain"
    assert "also a mismatch" in action.reasons[-1]


def test_a_finding_that_is_not_hardware_evidence_does_not_drain() -> None:
    action = decide_action(dead_verdict(xid(hardware=False)), {5: ("gone", "killed")})
    assert action.kind == "restart" and action.hosts == ["node7"]
    assert any("not hardware evidence" in r and "throttled" in r for r in action.reasons)
    assert action.missing == []  # device facts were collected: nothing to ask for


def test_dead_without_device_facts_restarts_and_asks_for_them() -> None:
    action = decide_action(dead_verdict(), {5: ("gone", "killed")})
    assert action.kind == "restart" and action.rule == "transient_fault"
    assert any("device facts of node7" in m for m in action.missing)
    assert action.reasons[-1].startswith("no incident catalog")


def test_a_process_that_raised_is_investigated_not_restarted() -> None:
    action = decide_action(dead_verdict(), {5: ("gone", "exception")})
    assert action.kind == "investigate" and action.rule == "own_failure"
    assert "read its error first" in action.reasons[0]


def test_a_weak_verdict_is_investigated_below_the_confidence_threshold() -> None:
    action = decide_action(dead_verdict(confidence=0.5), {5: ("absent", None)})
    assert action.kind == "investigate" and action.rule == "low_confidence"
    assert "FRTOOLS_ACTION_MIN_CONFIDENCE" in action.reasons[0]
    assert decide_action(dead_verdict(confidence=0.5), min_confidence=0.4).kind == "restart"


def test_a_skipped_collective_is_fix_code_with_the_call_site() -> None:
    verdict = dead_verdict()
    verdict.kind = "missing"
    action = decide_action(verdict, {5: ("skipped", None)})
    assert action.kind == "fix code"
    assert action.call_sites == ["/src/train.py:88 in step"]
    assert action.files == ["/src/train.py"]
    assert "rank 5 at /src/train.py:88 in step" in action.reasons


def test_a_mismatch_without_a_call_site_says_what_is_missing() -> None:
    verdict = dead_verdict()
    verdict.kind = "mismatch"
    verdict.guilty[0].call_site = None
    action = decide_action(verdict)
    assert action.kind == "fix code" and action.files == []
    assert "the call site" in action.missing[0]


def test_healthy_gets_none() -> None:
    action = decide_action(Verdict(kind="healthy", headline="Healthy", confidence=0.9))
    assert (action.kind, action.rule, action.hosts) == ("none", "healthy", [])


def history(n: int) -> HostHistory:
    return HostHistory(catalog="c.sqlite", window="the last 7d", incidents={"node7": n})


def test_a_host_guilty_in_the_threshold_of_incidents_is_drained() -> None:
    verdict = dead_verdict()
    verdict.action = decide_action(verdict, {5: ("gone", "killed")})
    once = with_history(verdict, history(1))
    assert once.kind == "restart"
    assert "not a repeat offender: node7 guilty in 1" in once.reasons[-1]
    assert not any(r.startswith("no incident catalog") for r in once.reasons)
    twice = with_history(verdict, history(2))
    assert twice.kind == "drain" and twice.rule == "repeat_offender"
    assert twice.hosts == ["node7"] and twice.ranks == [5]
    assert "node7 was guilty in 2 incidents of the last 7d" in twice.reasons[0]


def test_the_repeat_rule_never_drains_a_code_fault_or_the_whole_job() -> None:
    verdict = dead_verdict()
    verdict.kind = "mismatch"
    verdict.action = decide_action(verdict)
    assert with_history(verdict, history(9)).kind == "fix code"
    everyone = dead_verdict()
    everyone.ranks_expected = 1
    everyone.action = decide_action(everyone)
    action = with_history(everyone, history(9))
    assert action.kind == "restart" and "every rank is guilty" in action.reasons[-1]


def test_an_unreadable_catalog_is_said_and_decides_nothing() -> None:
    verdict = dead_verdict()
    verdict.action = decide_action(verdict)
    broken = HostHistory(catalog="c", window="the last 7d", unreadable="c: not an SQLite file")
    action = with_history(verdict, broken)
    assert action.kind == "restart"
    assert "cannot be read (c: not an SQLite file)" in action.reasons[-1]


# -- shown everywhere ----------------------------------------------------------------------


def test_every_report_format_shows_the_drain_with_host_and_gpu() -> None:
    from frtools.analyze.reporters import github, junit, markdown, terminal

    verdict = dead_verdict(xid())
    verdict.action = decide_action(verdict)
    text = terminal.render(verdict)
    assert "Next:  DRAIN  node7 GPU 3 (PCI 0000:47:00.0)" in text
    assert "Xid 79" in text
    md = markdown.render(verdict)
    assert "### Next action: `drain`" in md and "Drain: `node7` GPU 3" in md
    assert "next action: drain (node7 GPU 3, node7)" in github.render(verdict, env={})
    xml = junit.render(verdict)
    assert '<property name="action.kind" value="drain" />' in xml
    assert '<property name="action.gpus" value="node7:3" />' in xml


def test_html_report_shows_the_action_first_and_escaped(tmp_path: Path) -> None:
    p = frtools("report", str(SAMPLES / "size-mismatch"), "-o", str(tmp_path / "r.html"))
    assert p.returncode in (0, 1), p.stderr
    page = (tmp_path / "r.html").read_text()
    section = page[page.index('<div id="action"') :]
    assert 'data-kind="fix code"' in section[:200] and "FIX CODE" in section[:300]
    assert "faulty_job.py:" in section[: section.index("</div>")]
    assert page.index('id="action"') < page.index('id="map"')


def test_hostile_finding_text_cannot_reach_the_terminal_or_the_page() -> None:
    from frtools.analyze.reporters import html as html_report
    from frtools.analyze.reporters import terminal

    evil = DeviceFinding(
        host="node7", source="kmsg", code="xid:79", text="\x1b[2J<script>x</script>", hardware=True
    )
    verdict = dead_verdict(evil)
    verdict.action = decide_action(verdict)
    assert "\x1b" not in terminal.render(verdict)
    assert "<script>x" not in html_report._action_html(verdict)


# -- the catalog and `frtools history` -----------------------------------------------------


def synth(out: Path, seed: int, fault: str = "stuck", rank: int = 12) -> Path:
    from frtools.synth import synthesize

    synthesize(
        out, 16, fault=fault, fault_ranks=[rank], seed=seed, steps=2, workers=1, format="frtools"
    )
    return out


def test_a_host_guilty_again_is_drained_by_analyze_and_listed_by_history(tmp_path: Path) -> None:
    """Two stuck jobs whose guilty rank 12 ran on node00001: the first verdict restarts, the
    second drains node00001; `frtools history --format json` lists it to drain, with both
    incidents and their actions as its evidence."""
    catalog = tmp_path / "incidents.sqlite"
    actions = []
    for seed in (1, 2):
        p = frtools("analyze", str(synth(tmp_path / f"job{seed}", seed)), "--format", "json",
                    "--history", str(catalog))  # fmt: skip
        assert p.returncode == 1 and p.stderr == "", p.stderr
        actions.append(json_of(p)["verdict"]["action"])
    assert actions[0]["kind"] == "restart"
    assert actions[1]["kind"] == "drain" and actions[1]["rule"] == "repeat_offender"
    assert actions[1]["hosts"] == ["node00001"]
    # the same dumps again are the same incident: not a third one
    again = json_of(frtools("analyze", str(tmp_path / "job1"), "--format", "json",
                            "--history", str(catalog)))  # fmt: skip
    assert "guilty in 2 incidents" in again["verdict"]["action"]["reasons"][0]

    doc = json_of(frtools("history", str(catalog), "--format", "json"))
    assert doc["schema_version"] == "1.1"
    (host,) = doc["drain"]["hosts"]
    assert host["host"] == "node00001" and host["incidents"] == 2 and host["drain"]
    assert host["why"] == ["node00001 was guilty in 2 of 2 incidents (drain at 2)"]
    # job1 analyzed again keeps its newest verdict: a drain too, now that node00001 repeats
    assert [e["action"] for e in host["evidence"]] == ["drain", "drain"]
    assert host["drain_actions"] == 2 and host["hardware_incidents"] == 0
    # FRTOOLS_DRAIN_INCIDENTS is the one threshold: analyze's and history's
    doc3 = json_of(frtools("history", str(catalog), "--format", "json",
                           env={"FRTOOLS_DRAIN_INCIDENTS": "3"}))  # fmt: skip
    assert doc3["min_incidents"] == 3 and doc3["drain"]["hosts"] == []


def incident(n: int, host: str, findings: list[FindingRecord], action: str) -> IncidentRecord:
    return IncidentRecord(
        fingerprint=f"dumps-{n}",
        job_id=f"job-{n}",
        job_id_source="path",
        path=f"/dumps/{n}",
        kind="dead",
        headline=f"incident {n}",
        verdict_document={"verdict": {"kind": "dead"}},
        guilty=[GuiltyRecord(rank=5, host=host, device="cuda:3")],
        action=action,
        findings=findings,
    )


XID = FindingRecord(
    rank=5,
    host="node7",
    source="kmsg",
    code="xid:79",
    text="GPU 3 (PCI 0000:47:00.0): Xid 79 at 12:03:11 (fell off the bus)",
    hardware=True,
    gpu=3,
    pci_bus_id="0000:47:00.0",
    time="12:03:11",
)


def test_history_drains_a_host_with_hardware_evidence_in_one_incident(tmp_path: Path) -> None:
    catalog = tmp_path / "c.sqlite"
    record_incident(catalog, incident(1, "node7", [XID], "drain"))
    record_incident(catalog, incident(2, "node8", [], "restart"))
    doc = json_of(frtools("history", str(catalog), "--format", "json"))
    (host,) = doc["drain"]["hosts"]
    assert host["host"] == "node7" and host["incidents"] == 1
    assert host["why"] == ["hardware evidence against node7 in 1 incident(s)"]
    (evidence,) = host["evidence"]
    assert evidence["action"] == "drain"
    assert evidence["findings"] == [
        {"host": "node7", "source": "kmsg", "code": "xid:79", "text": XID.text,
         "hardware": True, "gpu": 3, "pci_bus_id": "0000:47:00.0", "time": "12:03:11"}
    ]  # fmt: skip
    text = frtools("history", str(catalog)).stdout
    assert text.splitlines()[0].lstrip().startswith("DRAIN")
    assert "To drain, and why" in text and "incident 1: GPU 3 (PCI 0000:47:00.0): Xid 79" in text


def test_a_version_1_catalog_is_read_and_migrated_without_losing_incidents(tmp_path) -> None:
    """A catalog written before actions and findings: `frtools history` reads it as it is
    (read-only), the next recorded verdict brings it to version 2 in its transaction."""
    from frtools.formats import incidents

    catalog = tmp_path / "old.sqlite"
    conn = sqlite3.connect(catalog)
    for statement in incidents._SCHEMA_V1:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1, ?, 0, '0.1')", (incidents.CATALOG_KIND,))
    conn.execute(
        "INSERT INTO incidents (fingerprint, job_id, job_id_source, path, recorded_ns, "
        "analyzed_ns, kind, headline, frtools_version, verdict_json) VALUES "
        "('old', 'job-0', 'path', '/d', 1, 1, 'dead', 'old one', '0.1', '{}')"
    )
    conn.execute("INSERT INTO guilty (incident_id, rank, host) VALUES (1, 5, 'node7')")
    conn.commit()
    conn.close()
    doc = json_of(frtools("history", str(catalog), "--format", "json", "--since", "all"))
    assert doc["hosts"][0]["evidence"][0]["action"] is None
    record_incident(catalog, incident(2, "node7", [XID], "drain"))
    with open_catalog(catalog) as reader:
        assert reader.has_findings and reader.count_all() == 2
    doc = json_of(frtools("history", str(catalog), "--format", "json", "--since", "all"))
    (host,) = doc["drain"]["hosts"]
    assert host["incidents"] == 2 and host["hardware_incidents"] == 1
    assert len(host["why"]) == 2
