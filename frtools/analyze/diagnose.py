"""Diagnosis entry point: ``diagnose(trace) -> Verdict`` (``align_and_diagnose``: both
steps, the step diff alongside). The rules live in
``frtools.analyze.diagnosis`` (facts, wait-for graph, rules in priority order, wording)."""

from __future__ import annotations

from frtools.analyze.diagnosis import IN_FLIGHT_NS, align_and_diagnose, diagnose
from frtools.analyze.diagnosis.facts import STALE_DUMP_NS

__all__ = ["IN_FLIGHT_NS", "STALE_DUMP_NS", "align_and_diagnose", "diagnose"]
