"""Diagnosis entry point: ``diagnose(trace) -> Verdict``. The rules live in
``frtools.analyze.diagnosis`` (facts, wait-for graph, rules in priority order, wording)."""

from __future__ import annotations

from frtools.analyze.diagnosis import IN_FLIGHT_NS, diagnose
from frtools.analyze.diagnosis.facts import STALE_DUMP_NS

__all__ = ["IN_FLIGHT_NS", "STALE_DUMP_NS", "diagnose"]
