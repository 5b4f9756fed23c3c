"""CI integrations of ``frtools analyze``: GitHub workflow-command annotations at the
guilty rank's call site (plus the job summary), and JUnit XML."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from trace_builder import STOP, megatron8, simulate, training

from frtools.analyze.diagnose import diagnose
from frtools.analyze.reporters import github, junit
from frtools.analyze.verdict import GuiltyRank, Verdict

pytestmark = pytest.mark.timeout(120)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
JOB = megatron8()


def _missing() -> Verdict:
    def stop5(r, s, ops):
        return [STOP] if (r, s) == (5, 1) else ops

    return diagnose(simulate(JOB, training(JOB, 2, stop5)))


def test_workflow_command_escaping_follows_the_runner_rules():
    assert github.escape_data("100% done\r\nnext") == "100%25 done%0D%0Anext"
    assert github.escape_property("a:b,c%\n") == "a%3Ab%2Cc%25%0A"
    line = github.command("error", "x: y, z\nw", file="a,b:c.py", line=3, title="t: 1")
    assert line == "::error file=a%2Cb%3Ac.py,line=3,title=t%3A 1::x: y, z%0Aw"


def test_error_annotation_sits_at_the_guilty_rank_call_site():
    text = github.render(_missing(), env={})
    lines = text.splitlines()
    assert len(lines) == 1 and text.endswith("\n")
    m = re.match(r"^::error file=([^,]+),line=(\d+),title=([^:]+)::(.*)$", lines[0])
    assert m, lines[0]
    assert m.group(1) == "train.py" and int(m.group(2)) > 100
    assert m.group(3) == "frtools%3A missing%3A rank 5"
    message = m.group(4)
    assert "\n" not in message and "%0A" in message
    assert message.startswith("Rank 5 (node1, cuda:1) never issued all_reduce #3")
    assert "waiting: 0-4,6-7" in message


def test_paths_under_the_workspace_become_repository_relative():
    v = Verdict(kind="missing", headline="h", confidence=0.9)
    v.guilty = [GuiltyRank(1, call_site="/home/runner/work/repo/repo/src/train.py:42 in step")]
    line = github.render(v, env={"GITHUB_WORKSPACE": "/home/runner/work/repo/repo"})
    assert line.startswith("::error file=src/train.py,line=42,")
    assert github.split_call_site("<stdin>:3 in <module>") == ("<stdin>", 3)
    assert github.split_call_site("no line here") == (None, None)
    v.guilty[0].call_site = None
    assert github.render(v, env={}).startswith("::error title=frtools%3A missing%3A rank 1::h")


def test_healthy_job_gets_a_notice():
    text = github.render(diagnose(simulate(JOB, training(JOB, 2))), env={})
    assert text.startswith("::notice title=frtools%3A healthy::Healthy: 8 rank(s)")
    assert "::error" not in text


def _analyze(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )


def test_github_format_appends_the_summary_when_the_runner_asks(tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary))
    p = _analyze(str(SAMPLES / "missing"), "--format", "github", env=env)
    assert p.returncode == 1, p.stderr
    assert p.stdout.startswith("::error file=")
    assert "faulty_job.py,line=" in p.stdout and "title=frtools%3A missing%3A rank 1::" in p.stdout
    text = summary.read_text()
    assert text.startswith("# earlier step\n## ❌ frtools: `missing`")

    env.pop("GITHUB_STEP_SUMMARY")
    quiet = _analyze(str(SAMPLES / "healthy"), "--format", "github", env=env)
    assert quiet.returncode == 0 and quiet.stdout.startswith("::notice ")
    assert quiet.stderr == ""


def test_junit_report_is_one_suite_one_case_failing_when_not_healthy(tmp_path):
    v = _missing()
    v.headline += " \x00\x1b[31m"  # bytes XML cannot carry are dropped, not fatal
    root = ET.fromstring(junit.render(v, name="dumps/hang", time_s=1.5))
    assert root.tag == "testsuites" and root.get("failures") == "1"
    suites = root.findall("testsuite")
    assert len(suites) == 1 and suites[0].get("tests") == "1"
    cases = suites[0].findall("testcase")
    assert len(cases) == 1 and cases[0].get("name") == "dumps/hang"
    failure = cases[0].find("failure")
    assert failure is not None and failure.get("type") == "missing"
    assert failure.get("message").startswith("Rank 5 (node1, cuda:1) never issued")
    assert "train.py:" in failure.text
    props = {p.get("name"): p.get("value") for p in suites[0].iter("property")}
    assert props["verdict.kind"] == "missing" and props["verdict.guilty"] == "5"

    healthy = ET.fromstring(junit.render(diagnose(simulate(JOB, training(JOB, 2)))))
    case = healthy.find("testsuite/testcase")
    assert case.find("failure") is None and healthy.get("failures") == "0"
    assert "HEALTHY" in case.find("system-out").text


def test_junit_format_from_the_command_line(tmp_path):
    out = tmp_path / "frtools.xml"
    p = _analyze(str(SAMPLES / "dead"), "--format", "junit", "-o", str(out))
    assert p.returncode == 1 and p.stdout == ""
    root = ET.parse(out).getroot()
    assert root.find("testsuite/testcase/failure").get("type") == "dead"


def test_machine_formats_never_draw_a_progress_bar(tmp_path, monkeypatch):
    from frtools.commands import _common

    many = tmp_path / "many"
    many.mkdir()
    for i in range(_common.SLOW_LOAD_FILES):
        (many / f"f{i}").write_bytes(b"x")
    few = tmp_path / "few"
    few.mkdir()
    (few / "rank_0.pkl").write_bytes(b"x" * 1000)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _common.progress_wanted(many, human=True)
    assert not _common.progress_wanted(few, human=True)  # a quick load: no bar
    assert not _common.progress_wanted(many, human=False)  # json, github, junit
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not _common.progress_wanted(many, human=True)  # stderr is a file or a pipe
