"""The wording only renders: every Reason and every NoteKind has its text in one table, and
the confidence and headline choice a verdict shows are the ones the rules settled.

Input: the 8-rank Megatron layout of trace_builder (TP pairs, DP groups, world), rank 5
stuck in compute at step 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from trace_builder import STOP, megatron8, simulate, training

from frtools.analyze.align import align
from frtools.analyze.diagnosis import wording
from frtools.analyze.diagnosis.facts import gather_facts
from frtools.analyze.diagnosis.graph import build_graph
from frtools.analyze.diagnosis.model import (
    Blame,
    Finding,
    Note,
    NoteKind,
    Reason,
    VerdictKind,
)
from frtools.analyze.diagnosis.rules import Evidence, first_finding
from frtools.analyze.diagnosis.wording import NOTE_TEXT, REASON_TEXT, verdict_of

pytestmark = pytest.mark.timeout(60)

JOB = megatron8()


def _rank5_stops(r, s, ops):
    return [STOP] if (r, s) == (5, 1) else ops


def _evidence(trace):
    al = align(trace)
    facts = gather_facts(trace, al)
    return Evidence(facts, build_graph(facts))


@pytest.fixture(scope="module")
def hang():
    """Facts of a hang and the point its blocked ranks wait in."""
    ev = _evidence(simulate(JOB, training(JOB, 3, _rank5_stops)))
    point = next(p for p in ev.graph.points.values() if p.blockers and p.targets)
    return ev.facts, point


def test_every_note_kind_has_its_text_in_the_table():
    assert set(NOTE_TEXT) == set(NoteKind), "a NoteKind without text renders no evidence"


@pytest.mark.parametrize("kind", list(NoteKind), ids=lambda k: k.value)
def test_each_note_kind_renders_an_evidence_line(hang, kind):
    facts, point = hang
    note = Note(kind, point=point, ranks=(4, 5), others=(0,), count=2, groups=(point.pg_name,),
                values=(8, 16))  # fmt: skip
    finding = Finding(kind=VerdictKind.INCONCLUSIVE, confidence=0.5, notes=(note,))
    evidence = verdict_of(finding, facts).evidence
    line = evidence[0]
    assert line.strip() and line.endswith(".")
    assert "None" not in line


def test_every_reason_has_its_text_in_the_table():
    assert set(REASON_TEXT) == set(Reason), "a Reason without text shows its enum value"


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.value)
def test_each_reason_renders_why_the_rank_is_blamed(hang, reason):
    facts, point = hang
    blame = Blame(5, reason, point=point, lateness=(0.8, 30e6, 12))
    pair = Note(NoteKind.SPLIT_PAIR, point=point, ranks=(5, 4), values=(8, 16))
    finding = Finding(
        kind=VerdictKind.MISSING,
        confidence=0.85,
        blames=(blame,),
        waiting=frozenset({4}),
        point=point,
        notes=(pair,),
    )
    text = verdict_of(finding, facts).guilty[0].reason
    assert text and text != reason.value
    assert "None" not in text


def test_a_note_whose_text_names_a_point_gives_no_line_without_one(hang):
    facts, _ = hang
    finding = Finding(
        kind=VerdictKind.INCONCLUSIVE, confidence=0.5, notes=(Note(NoteKind.BLOCKED),)
    )
    assert verdict_of(finding, facts).evidence == []


def test_wording_shows_the_confidence_the_rules_settled():
    # Rank 5 hangs the job; rank 2 left no record, and nobody waits for it: the verdict
    # does not explain it, which costs confidence -- decided before the wording.
    trace = simulate(JOB, training(JOB, 3, _rank5_stops), absent=(2,))
    ev = _evidence(trace)
    finding = first_finding(ev)
    assert finding.unexplained == (2,)
    assert finding.confidence == pytest.approx(0.85 - 0.1 - 0.4 / 8)  # 1 of 8 ranks unseen
    verdict = verdict_of(finding, ev.facts)
    assert verdict.confidence == finding.confidence
    assert (
        "No usable record for rank(s) 2; nobody waits for them in the recorded ops."
        in verdict.evidence
    )


def test_healthy_headline_follows_the_rules_choice_not_a_confidence():
    trace = simulate(JOB, training(JOB, 3), completion="none")
    ev = _evidence(trace)
    finding = first_finding(ev)
    assert finding.kind is VerdictKind.HEALTHY and not finding.completion_info
    text = verdict_of(finding, ev.facts).headline
    assert text == "Healthy: 8 rank(s) reached the same collectives (no completion info)"


def test_wording_reads_no_confidence_level():
    source = Path(wording.__file__).read_text(encoding="utf-8")
    assert "Confidence" not in source
