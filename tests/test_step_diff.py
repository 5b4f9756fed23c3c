"""The step diff: what the failing training step did differently from the last good one.

Fast tests read the committed real dumps of ``sample_dumps/`` (PyTorch FR, one good step and
the failing one) through ``frtools analyze --format json`` as a user runs it; the corpus
tests read the real-corpus jobs' dumps (session fixture ``corpus_runs``: each job runs once
per session, whichever file asks first) and check that the diff names the injected change.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow as pa
import pytest

from frtools.analyze.readers import load_trace
from frtools.analyze.steps import step_diff, step_diff_lines

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_dumps"
SCHEMA = json.loads((ROOT / "docs" / "verdict.schema.json").read_text())


def _analyze(path: Path, fmt: str = "json") -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(path), "--format", fmt],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout


def _document(path: Path) -> dict:
    code, out = _analyze(path)
    assert code in (0, 1), out
    doc = json.loads(out)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_order_swap_names_both_ops_and_call_sites() -> None:
    diff = _document(SAMPLES / "order")["step_diff"]
    assert diff["repeats"] and diff["step_length"] == 6
    [change] = diff["changes"]
    assert (change["rank"], change["change"]) == (1, "order")
    assert change["now"]["pg_name"] == "0" and change["skipped"][0]["pg_name"] == "4"
    site = change["now"]["call_site"]  # the checkout the dumps were recorded in
    assert site.endswith("/examples/faulty_job.py:227 in main"), site
    made_in = site[: site.index("/examples/")]
    assert diff["lines"] == [
        f"rank 1 issued all_reduce on group 0 from {made_in}/examples/faulty_job.py:227 in main "
        f"before all_reduce on group 4 from {made_in}/examples/faulty_job.py:229 in main in step 2; "
        "in step 1 it came after"
    ]


def test_changed_size_names_both_sizes() -> None:
    [change] = _document(SAMPLES / "size-mismatch")["step_diff"]["changes"]
    assert (change["rank"], change["change"]) == (2, "shape")
    assert (change["before"]["input_sizes"], change["now"]["input_sizes"]) == ("[[8]]", "[[16]]")
    assert change["now"]["op"] == "broadcast"


def test_op_no_rank_issued_last_step_is_named() -> None:
    diff = _document(SAMPLES / "op-mismatch")["step_diff"]
    [change] = diff["changes"]
    assert (change["rank"], change["change"], change["now"]["op"]) == (3, "new_op", "broadcast")
    assert change["before"]["op"] == "all_reduce" and not change["issued_by_any"]
    assert "which no rank issued in step 1" in diff["lines"][0]


def test_victims_that_only_stop_have_no_change() -> None:
    diff = _document(SAMPLES / "missing")["step_diff"]
    assert diff["repeats"] and diff["changes"] == []
    assert "no rank did anything different" in diff["lines"][0]


def test_records_without_a_repeating_step_say_so_in_one_line() -> None:
    """sample_dumps/skipped: one good step, and the failing one diverges at its first op."""
    diff = _document(SAMPLES / "skipped")["step_diff"]
    assert not diff["repeats"]
    assert diff["lines"] == ["no step repeats in the records (4 ranks looked at)"]
    code, text = _analyze(SAMPLES / "skipped", "terminal")
    assert "Step diff" in text and "no step repeats in the records" in text


def test_step_diff_shows_in_markdown_terminal_and_html(tmp_path: Path) -> None:
    _, md = _analyze(SAMPLES / "order", "markdown")
    assert "### Step diff" in md and "in step 1 it came after" in md
    _, text = _analyze(SAMPLES / "order", "terminal")
    assert "Step diff" in text and "rank 1 issued all_reduce on group 0" in text
    out = tmp_path / "report.html"
    subprocess.run(
        [sys.executable, "-m", "frtools", "report", str(SAMPLES / "order"), "-o", str(out)],
        capture_output=True,
        timeout=120,
    )
    page = out.read_text()
    assert '<section id="step-diff">' in page and "in step 1 it came after" in page


def test_healthy_moe_splits_changing_every_step_are_no_change() -> None:
    """all_to_all sizes change every step by design (MoE routing): not part of the step."""
    diff = step_diff(load_trace(SAMPLES / "moe-healthy"))
    assert diff.ranks_repeating == 8 and diff.changes == []


REAL_GPU = ROOT.parent / "shared" / "real-gpu" / "nvrx"


@pytest.mark.parametrize("folder", ["gpu_error_1st", "lock_gil_1st"])
def test_parts_of_a_step_in_a_short_ring_are_no_step(folder: str) -> None:
    """Real Megatron MoE dumps on H100s: 20-entry rings hold a fraction of a step. Three
    all_to_alls of token dispatch in a row repeat, and the program then goes on to its next
    part: that is no step, and no rank "issued an op no rank issued in the step before" (the
    healthy ranks 8, 10, 11, 12, 13, 15 of lock_gil_1st were listed so)."""
    if not (REAL_GPU / folder).is_dir():
        pytest.skip("the real GPU dumps are not beside this checkout")
    diff = step_diff(load_trace(REAL_GPU / folder))
    assert diff.changes == [], step_diff_lines(diff)


def test_a_run_inside_a_step_is_no_step_and_a_loop_still_is() -> None:
    """What a rank did after the periodic stretch decides whether the stretch was its loop:
    more than a step's worth of ops the step never holds is another part of the program; a
    rank that blocks within a step of the change keeps its step and its change."""
    from tests.trace_builder import STOP, Job, Op, simulate

    job = Job({"0": (0, 1)}, {"0": "default_pg"})
    a2a = [Op("0", "all_to_all", f"[[{n},8]]") for n in (5, 7, 6)]
    rest = [Op("0", "reduce_scatter"), Op("0", "all_gather"), Op("0", "all_reduce", "[[2]]"),
            Op("0", "broadcast")]  # fmt: skip
    # one call site for every op, as a loop's: only group, op and sizes tell ops apart
    parts = simulate(job, {r: [*a2a, *rest, STOP] for r in (0, 1)}, frames=False)
    diff = step_diff(parts)
    assert not diff.repeats and diff.changes == [], step_diff_lines(diff)

    loop = [Op("0", "all_reduce"), Op("0", "broadcast")] * 4
    programs = {0: [*loop, Op("0", "all_gather"), STOP], 1: [*loop, Op("0", "all_reduce")]}
    diff = step_diff(simulate(job, programs, frames=False))
    [change] = diff.changes
    assert (change.rank, change.change, change.now.op) == (0, "new_op", "all_gather")


def test_ranks_whose_rows_are_apart_give_the_same_diff() -> None:
    """A reader that writes ranks' rows interleaved (rank order lost, each rank's record order
    kept) changes nothing: each rank's rows are gathered before its step is looked for."""
    trace = load_trace(SAMPLES / "order")
    expected = step_diff(trace).to_dict()
    ranks = trace.entries.column("rank").to_numpy()
    by_rank = [np.flatnonzero(ranks == r).tolist() for r in sorted(set(ranks.tolist()))]
    mixed = [row for at in range(max(map(len, by_rank))) for rows in by_rank[::-1]
             for row in rows[at : at + 1]]  # fmt: skip
    assert mixed != sorted(mixed)
    trace.entries = trace.entries.take(pa.array(mixed))
    assert step_diff(trace).to_dict() == expected
    assert expected["changes"][0]["rank"] == 1


@pytest.mark.parametrize("sample", ["order", "op-mismatch", "moe-healthy", "size-mismatch"])
def test_rank_by_rank_search_gives_the_batched_answer(sample: str, monkeypatch) -> None:  # noqa: ANN001
    """The all-ranks table of a step length is a shortcut: with it off (past its few
    lengths every rank is searched on its own) the diff is the same."""
    from frtools.analyze import steps

    trace = load_trace(SAMPLES / sample)
    batched = step_diff(trace).to_dict()
    monkeypatch.setattr(steps._Steps, "_LENGTHS", 0)
    assert step_diff(trace).to_dict() == batched
    assert batched["ranks_repeating"] > 0


def test_step_diff_costs_little_per_rank() -> None:
    """Bounded work per rank: each rank's last WINDOW records, a few numpy passes."""
    trace = load_trace(SAMPLES / "order")
    step_diff(trace)
    t0 = time.perf_counter()
    for _ in range(20):
        step_diff(trace)
    assert (time.perf_counter() - t0) / 20 < 0.05


# -- the real corpus: the injected change is named ----------------------------------------

# case -> (rank, change, op now, op before or the skipped op)
CORPUS = {
    "multigroup-skip-r2-fr": (2, "missing_op", "all_gather", "all_reduce"),
    "pipeline-skip-r1-frtools": (1, "missing_op", "recv", "send"),
    "moe8-skip-r5-frtools": (5, "missing_op", "all_to_all", "all_to_all"),
    "multigroup-order-r1-fr": (1, "order", "all_reduce", "all_reduce"),
    "multigroup-order-r2-frtools": (2, "order", "all_reduce", "all_reduce"),
    "multigroup-size-r2-frtools": (2, "shape", "broadcast", "broadcast"),
    "moe8-size-r7-frtools": (7, "shape", "all_reduce", "all_reduce"),
    "multigroup-op-r3-frtools": (3, "new_op", "broadcast", "all_reduce"),
    "pipeline-op-r3-fr": (3, "new_op", "broadcast", "all_reduce"),
}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "case_id",
    # PyTorch's own recorder's cases are the 2.15 run's (scripts/test.sh: not fr_recorder)
    [
        pytest.param(c, marks=[pytest.mark.fr_recorder] if c.endswith("-fr") else [])
        for c in sorted(CORPUS)
    ],
)
def test_step_diff_names_the_injected_change(case_id: str, corpus_runs) -> None:  # noqa: ANN001
    from tests.corpus.cases import BY_ID

    run = corpus_runs(BY_ID[case_id])
    diff = _document(Path(run.dumps))["step_diff"]
    rank, change, now, before = CORPUS[case_id]
    mine = [c for c in diff["changes"] if c["rank"] == rank]
    assert mine, f"{case_id}: {diff['lines']}"
    got = mine[0]
    was = got["skipped"][0]["op"] if got["skipped"] else got["before"]["op"]
    assert (got["change"], got["now"]["op"], was) == (change, now, before), diff["lines"]
    assert got["now"]["call_site"], diff["lines"]
    line = step_diff_lines_of(diff, rank)
    assert line.startswith(f"rank {rank} ") and "step" in line


def step_diff_lines_of(diff: dict, rank: int) -> str:
    return next(line for line in diff["lines"] if line.startswith(f"rank {rank} "))


def test_lines_render_every_change_kind() -> None:
    """Each change kind reads as a sentence naming the rank and both steps."""
    from frtools.analyze.steps import CHANGE_KINDS, StepChange, StepDiff, StepOp

    a = StepOp(pg_name="7", op="reduce_scatter", input_sizes="[[8]]", call_site="model.py:88")
    b = StepOp(pg_name="7", op="all_reduce", input_sizes="[[4]]", call_site="model.py:80")
    for kind in CHANGE_KINDS:
        change = StepChange(rank=5, change=kind, step=42, position=0, now=a, before=b, skipped=[b])
        [line] = step_diff_lines(StepDiff(ranks_examined=8, ranks_repeating=8, changes=[change]))
        assert line.startswith("rank 5 ") and "42" in line and "41" in line, line
    new = StepChange(rank=5, change="new_op", step=42, position=0, now=a, before=None)
    [line] = step_diff_lines(StepDiff(ranks_examined=8, ranks_repeating=8, changes=[new]))
    assert line == (
        "rank 5 issued reduce_scatter on group 7 from model.py:88 in step 42, which no rank "
        "issued in step 41"
    )
