"""Reporters render a Verdict: terminal (answer first, 100 columns), JSON (schema), markdown."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from trace_builder import STOP, Op, megatron8, simulate, training

from frtools.analyze.diagnose import diagnose
from frtools.analyze.reporters import json_report, markdown, terminal
from frtools.analyze.verdict import Verdict
from frtools.model.ranks import format_ranks
from frtools.model.trace import InputFile

pytestmark = pytest.mark.timeout(60)

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "verdict.schema.json").read_text())
JOB = megatron8()


def _stop(rank, step):
    def fault(r, s, ops):
        return [STOP] if (r, s) == (rank, step) else ops

    return fault


def _bigger(rank):
    def fault(r, s, ops):
        return [Op(ops[0].pg, ops[0].op, "[[99]]")] + ops[1:] if (r, s) == (rank, 1) else ops

    return fault


def _world_first(rank):
    def fault(r, s, ops):
        return [ops[3], *ops[:3]] if (r, s) == (rank, 1) else ops

    return fault


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Verdict]:
    out = {
        "healthy": diagnose(simulate(JOB, training(JOB, 2))),
        "missing": diagnose(simulate(JOB, training(JOB, 2, _stop(5, 1)))),
        "dead": diagnose(simulate(JOB, training(JOB, 2, _stop(3, 1)), absent=(3,))),
        "straggler": diagnose(simulate(JOB, training(JOB, 4), delay_ms={6: 40})),
        "mismatch": diagnose(simulate(JOB, training(JOB, 2, _bigger(3)))),
        "order": diagnose(simulate(JOB, training(JOB, 2, _world_first(0)))),
        "stuck": diagnose(
            simulate(JOB, training(JOB, 2), completion="nccl", wedge=("tp1", 3), unstarted=(3,))
        ),
    }
    bad = out["missing"]
    bad.inputs = [
        InputFile("d/rank_0.pkl", "ok", rank=0, format="torch-pickle"),
        InputFile("d/rank_1.pkl", "error", "truncated pickle (EOF at byte 812)", 1),
        InputFile("d/README.txt", "skipped", "not a dump"),
    ]
    return out


def test_collapsed_rank_ranges():
    assert format_ranks([0, 1, 2, 3, 5]) == "0-3,5"
    assert format_ranks([7]) == "7"
    assert format_ranks([]) == "-"


@pytest.mark.parametrize(
    "kind", ["healthy", "missing", "dead", "straggler", "mismatch", "order", "stuck"]
)
def test_json_report_follows_the_schema(verdicts, kind):
    doc = json.loads(json_report.render(verdicts[kind]))
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert doc["schema_version"] == "1.5"
    assert doc["verdict"]["kind"] == kind


def test_json_report_names_guilty_waiting_and_group(verdicts):
    doc = json.loads(json_report.render(verdicts["missing"]))
    v = doc["verdict"]
    assert [g["rank"] for g in v["guilty"]] == [5]
    assert v["guilty"][0]["host"] == "node1"
    assert v["waiting"] == [0, 1, 2, 3, 4, 6, 7]
    assert v["process_group"]["ranks"] == [4, 5]
    assert [i["status"] for i in doc["inputs"]] == ["ok", "error", "skipped"]
    assert doc["ranks"] == {"expected": 8, "found": 8, "missing": []}


def test_terminal_report_puts_the_answer_first_within_100_columns(verdicts):
    text = terminal.render(verdicts["missing"], width=100)
    lines = text.splitlines()
    assert "MISSING" in lines[0] and "Rank 5" in lines[0]
    assert all(len(line) <= 100 for line in lines)
    assert "node1" in text and "cuda:1" in text  # where the guilty rank lives
    assert "waiting: 0-4,6-7" in text
    assert "train.py:" in text  # the call site
    assert len(lines) <= 30


def test_terminal_report_always_lists_bad_inputs(verdicts):
    text = terminal.render(verdicts["missing"])
    assert "Inputs" in text
    assert "d/rank_1.pkl: truncated pickle (EOF at byte 812)" in text
    assert "d/README.txt: not a dump" in text


def test_terminal_colours_mean_guilty_waiting_healthy(verdicts):
    sick = terminal.render(verdicts["missing"], color=True)
    assert "\x1b[" in sick and "\x1b[1;31m" in sick  # bold red headline
    assert "\x1b[33m" in sick  # yellow waiting ranks
    ok = terminal.render(verdicts["healthy"], color=True)
    assert "\x1b[1;32m" in ok  # green


def test_terminal_verbose_adds_evidence(verdicts):
    quiet = terminal.render(verdicts["missing"])
    loud = terminal.render(verdicts["missing"], verbose=True)
    assert "Evidence" not in quiet and "Evidence" in loud
    assert "blocked in" in loud


def test_dead_rank_report_says_it_left_no_dump(verdicts):
    text = terminal.render(verdicts["dead"])
    assert text.splitlines()[0].lstrip().startswith("DEAD")
    assert "no usable record for rank(s) 3" in text


def test_markdown_summary_has_headline_table_and_inputs(verdicts):
    md = markdown.render(verdicts["missing"])
    assert md.startswith("## ❌ frtools: `missing`")
    assert "| guilty rank | host |" in md and "| 5 | node1 |" in md
    assert "| ranks | op |" in md and "| 4 | all_reduce |" in md
    assert "### Inputs not used" in md and "`d/rank_1.pkl`" in md
    assert markdown.render(verdicts["healthy"]).startswith("## ✅ frtools: `healthy`")


def test_long_rank_lists_are_cut_to_fit():
    ranks = list(range(0, 2000, 3))
    text = format_ranks(ranks, 40)
    assert len(text) <= 40 + 20
    assert text.endswith(f"… ({len(ranks)} ranks)")
