"""The real-job corpus: training-shaped multi-process Gloo jobs (DDP, FSDP2, MoE, pipeline,
multi-group) with real injected faults, recorded the two ways users record them (PyTorch's
Flight Recorder in-process, and ``frtools run`` + ``frtools dump``), and the exact verdict
``frtools analyze`` owes each one (``tests/corpus/cases.py``, with why).

Each case's job runs once per session, when its first test needs it, one job at a time
(``tests/corpus/harness.py``: own session per rank, free loopback port, bounded hang
detection, every process killed). ``frtools analyze DIR --format json`` runs as a CLI
subprocess. ``python -m tests.corpus.report`` runs the same corpus and prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # ``tests.corpus`` is imported from the repository root
    sys.path.insert(0, str(REPO))

from tests.corpus.cases import CASES, Case  # noqa: E402
from tests.corpus.harness import JOB_LIMIT  # noqa: E402
from tests.corpus.report import evaluate  # noqa: E402

# one job (at most JOB_LIMIT, killed past it), the dump, and the analysis
CASE_TIMEOUT = int(JOB_LIMIT + 150)


@pytest.mark.slow
@pytest.mark.timeout(CASE_TIMEOUT)
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.fr_recorder] if c.recorder == "fr" else []) for c in CASES],
    ids=[c.id for c in CASES],
)
def test_real_job_gets_its_verdict(case: Case, corpus_runs) -> None:  # noqa: ANN001
    run = corpus_runs(case)
    assert run.ending != "limit", f"the job did not end or hang in time\n{run.tail()}"
    outcome = evaluate(case, run)
    if not outcome.right:
        pytest.fail(
            f"{case.id}: expected {case.expected}, frtools said {outcome.got} "
            f"(exit {outcome.rc}): {outcome.headline}\n  "
            + "\n  ".join(outcome.problems)
            + f"\nwhat should happen: {case.why}\njob: {run.summary()}",
            pytrace=False,
        )
    assert_action_for(outcome.kind, outcome.action, case.id)


def assert_action_for(kind: str, action: dict | None, case_id: str) -> None:
    """Every verdict carries its next action with reasons (docs/actions.md): healthy ones
    none, code faults fix code at a call site, the rest never none."""
    assert action is not None, f"{case_id}: the {kind} verdict has no action"
    assert action["reasons"] and all(r.strip() for r in action["reasons"]), case_id
    if kind == "healthy":
        assert action["kind"] == "none", (case_id, action)
    else:
        assert action["kind"] != "none", (case_id, action)
    if kind in ("mismatch", "order"):
        assert action["kind"] in ("fix code", "drain"), (case_id, action)
