"""The confidence a verdict states, settled once the rule has answered: its named level,
less what the rest of the records leave unexplained, kept in [FLOOR, CEILING]
(docs/verdict.md "Confidence"). Decided here, beside the rules, so that the wording only
prints it."""

from __future__ import annotations

from dataclasses import replace

from .facts import JobFacts
from .model import Confidence, Finding


def settle(finding: Finding, facts: JobFacts) -> Finding:
    """``finding`` with its final confidence and the absent ranks it does not explain
    (nobody waits for them in the recorded ops: a rank lost without a trace weakens any
    verdict that does not name it)."""
    unexplained = tuple(sorted(facts.absent - set(finding.guilty)))
    confidence = float(finding.confidence)
    if unexplained:
        # and the more of the job is unseen, the less any verdict rests on: one record of
        # sixteen names a suspect, not a cause
        share = len(unexplained) / max(1, len(facts.absent | facts.present))
        confidence -= Confidence.UNEXPLAINED_ABSENT + Confidence.UNSEEN_SHARE * share
    confidence = float(min(Confidence.CEILING, max(Confidence.FLOOR, confidence)))
    return replace(finding, confidence=confidence, unexplained=unexplained)
