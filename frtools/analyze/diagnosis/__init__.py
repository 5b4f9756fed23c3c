"""Diagnosis: from an aligned Trace to exactly one Verdict.

``facts``    what the inputs establish (present/absent ranks, group membership with sibling
             inference, how each process ended, which completion marks prove success);
``completion`` what counts as completed (the marks each format gives, ranks that left);
``graph``    the wait-for graph on it, built once, then read-only;
``rules``    one function per rule, each returning a Finding; ``PRIORITY`` orders them;
             ``confidence.settle`` gives the chosen Finding its final confidence;
``wording``  a Finding in words (headline, reasons, evidence, what would decide it): it
             only renders.
Then the verdict gets the guilty ranks' device evidence, the step diff and, last, the action.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from frtools.analyze.action import decide_action
from frtools.analyze.align import Alignment, align
from frtools.analyze.hardware import attach_device_evidence
from frtools.analyze.stacks import stacks_summary
from frtools.analyze.steps import StepDiff, step_diff
from frtools.analyze.verdict import Verdict
from frtools.model.trace import Trace

from .facts import gather_facts
from .graph import IN_FLIGHT_NS, build_graph
from .rules import PRIORITY, Evidence, first_finding
from .wording import verdict_of

__all__ = ["IN_FLIGHT_NS", "PRIORITY", "align_and_diagnose", "diagnose"]


def align_and_diagnose(trace: Trace) -> tuple[Alignment, Verdict]:
    """``align`` then ``diagnose``, the step diff worked out in a thread meanwhile: it reads
    only the trace's entries, mostly in numpy and Arrow, which let go of the GIL, so it
    runs on the second core while the alignment runs on the first (131,072 ranks: ~0.6 s
    of the ~0.7 s it takes hidden)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="frtools-step-diff") as pool:
        steps = pool.submit(step_diff, trace)
        alignment = align(trace)
        return alignment, diagnose(trace, alignment, steps=steps)


def diagnose(
    trace: Trace, alignment: Alignment | None = None, *, steps: Future[StepDiff] | None = None
) -> Verdict:
    """The one Verdict for this trace (docs/verdict.md). ``steps``: its step diff, being
    worked out elsewhere (``align_and_diagnose``)."""
    al = alignment if alignment is not None else align(trace)
    facts = gather_facts(trace, al)
    graph = build_graph(facts)
    finding = first_finding(Evidence(facts, graph))
    verdict = verdict_of(finding, facts)
    attach_device_evidence(verdict, trace)  # the guilty ranks' GPUs and what was wrong there
    summary = stacks_summary(trace, verdict.guilty_ranks)
    if summary.ranks_with_stacks:
        verdict.stacks = summary
    verdict.step_diff = steps.result() if steps is not None else step_diff(trace)
    causes = {b.rank: (b.reason.value, b.ending.kind if b.ending else None) for b in finding.blames}
    verdict.action = decide_action(verdict, causes)  # last: it reads the whole verdict
    return verdict
