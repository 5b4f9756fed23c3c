"""JUnit XML: the verdict as a test result, for CI systems that read JUnit reports
(GitLab, Jenkins, Azure Pipelines, GitHub test-report actions).

One ``testsuite`` named ``frtools``, one ``testcase`` for the verdict; it carries a
``failure`` (type = the verdict kind, message = the headline, text = the terminal report)
unless the verdict is healthy. Built with ElementTree, so it is well-formed whatever the
dumps held; characters XML 1.0 cannot carry are dropped.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from frtools.analyze.reporters import terminal
from frtools.analyze.verdict import Verdict
from frtools.model.ranks import format_ranks

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _clean(text: object) -> str:
    return _NOT_XML.sub("", "" if text is None else str(text))


def action_properties(verdict: Verdict) -> list[tuple[str, str]]:
    """The next action as test-suite properties (docs/actions.md); the report text in the
    failure carries its reasons."""
    action = verdict.action
    if action is None:
        return []
    gpus = [f"{g.host}:{g.gpu}" for g in action.gpus if g.gpu is not None]
    return [
        ("action.kind", action.kind),
        ("action.rule", action.rule),
        ("action.hosts", ",".join(action.hosts)),
        ("action.gpus", ",".join(gpus)),
        ("action.files", ",".join(action.files)),
        ("action.reason", action.reasons[0] if action.reasons else ""),
    ]


def render(verdict: Verdict, name: str = "frtools analyze", time_s: float | None = None) -> str:
    """The JUnit XML document; ``name`` names the test case (e.g. the dump folder)."""
    failed = verdict.kind != "healthy"
    seconds = f"{time_s:.3f}" if time_s is not None else "0"
    suites = ET.Element(
        "testsuites",
        name="frtools",
        tests="1",
        failures=str(int(failed)),
        errors="0",
        time=seconds,
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="frtools",
        tests="1",
        failures=str(int(failed)),
        errors="0",
        skipped="0",
        time=seconds,
    )
    props = ET.SubElement(suite, "properties")
    pg = verdict.process_group
    for key, value in (
        ("verdict.kind", verdict.kind),
        ("verdict.confidence", f"{verdict.confidence:.2f}"),
        ("verdict.guilty", format_ranks(verdict.guilty_ranks) if verdict.guilty else ""),
        ("verdict.process_group", pg.name if pg is not None else ""),
        ("verdict.op", verdict.op or ""),
        ("verdict.collective_seq_id", verdict.collective_seq_id),
        ("ranks.found", verdict.ranks_found),
        ("ranks.expected", verdict.ranks_expected),
        *action_properties(verdict),
    ):
        if value not in (None, ""):
            ET.SubElement(props, "property", name=key, value=_clean(value))
    case = ET.SubElement(
        suite, "testcase", classname="frtools.verdict", name=_clean(name), time=seconds
    )
    report = _clean(terminal.render(verdict, verbose=True, width=100))
    if failed:
        failure = ET.SubElement(
            case, "failure", message=_clean(verdict.headline), type=_clean(verdict.kind)
        )
        failure.text = report
    else:
        out = ET.SubElement(case, "system-out")
        out.text = report
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )
