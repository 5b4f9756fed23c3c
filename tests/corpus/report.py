"""Run the real-job corpus and print what frtools says against what it should say.

    python -m tests.corpus.report                       # every case, one job at a time
    python -m tests.corpus.report --only ddp-healthy-fr moe8-healthy-fr
    python -m tests.corpus.report --keep /tmp/corpus --markdown table.md

Each case's job runs once (``tests/corpus/harness.py``), ``frtools analyze DIR --format json``
runs as a subprocess, and the row says right or wrong: the kind, the exact guilty set, the
group where the case names one, and the exit code (0 healthy, 1 otherwise). Run it from the
repository root. Exit status: 0 when every case is right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.corpus.cases import CASES, Case
from tests.corpus.harness import CaseRun, analyze, run_case


@dataclass
class Outcome:
    case: Case
    run: CaseRun
    rc: int
    kind: str  # what frtools said ("error" when it gave no report)
    guilty: tuple[int, ...]
    group: tuple[int, ...] | None
    headline: str
    problems: list[str]
    analyze_s: float
    action: dict | None = None  # the verdict's next action (docs/actions.md), as the JSON has it

    @property
    def right(self) -> bool:
        return not self.problems

    @property
    def got(self) -> str:
        ranks = ",".join(map(str, self.guilty))
        return f"{self.kind} [{ranks}]" if self.guilty else self.kind


def judge(case: Case, rc: int, report: dict | None) -> list[str]:
    """What is wrong with frtools' answer to ``case`` (empty: right)."""
    if report is None:
        return [f"no JSON report (exit code {rc})"]
    verdict = report["verdict"]
    problems = []
    if verdict["kind"] != case.kind:
        problems.append(f"kind {verdict['kind']}, expected {case.kind}")
    guilty = tuple(sorted(g["rank"] for g in verdict.get("guilty", [])))
    if guilty != tuple(sorted(case.guilty)):
        problems.append(f"guilty {list(guilty)}, expected {list(case.guilty)}")
    if case.groups is not None:
        pg = verdict.get("process_group") or {}
        if tuple(pg.get("ranks") or ()) not in case.groups:
            want = " or ".join(str(list(g)) for g in case.groups)
            problems.append(f"group {pg.get('ranks')}, expected {want}")
    if rc != case.exit_code:
        problems.append(f"exit code {rc}, expected {case.exit_code}")
    return problems


def evaluate(case: Case, run: CaseRun) -> Outcome:
    t = time.monotonic()
    rc, report, err = analyze(run.dumps, *case.analyze_args)
    elapsed = time.monotonic() - t
    verdict = (report or {}).get("verdict") or {}
    pg = verdict.get("process_group") or None
    return Outcome(
        case=case,
        run=run,
        rc=rc,
        kind=verdict.get("kind", "error"),
        guilty=tuple(sorted(g["rank"] for g in verdict.get("guilty", []))),
        group=tuple(pg["ranks"]) if pg and pg.get("ranks") is not None else None,
        headline=verdict.get("headline", err.strip()[-300:]),
        problems=judge(case, rc, report),
        analyze_s=elapsed,
        action=verdict.get("action"),
    )


def table(outcomes: list[Outcome]) -> str:
    """The markdown table: case, recorder, expected, got, right/wrong, wall time."""
    lines = [
        "| case | recorder | expected | got | | job + analyze |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        mark = "right" if o.right else "**wrong**"
        wall = f"{o.run.wall_s:.1f} + {o.analyze_s:.1f} s"
        if o.case.run_of:
            wall = f"(same job) + {o.analyze_s:.1f} s"
        lines.append(
            f"| {o.case.id} | {o.case.recorder} | {o.case.expected} | {o.got} | {mark} | {wall} |"
        )
    right = sum(o.right for o in outcomes)
    lines.append("")
    lines.append(f"{right}/{len(outcomes)} right")
    return "\n".join(lines)


def run_corpus(cases: list[Case], root: Path, log=print) -> list[Outcome]:  # noqa: ANN001
    """Run each needed job once, one at a time, and judge every case."""
    runs: dict[str, CaseRun] = {}
    by_id = {c.id: c for c in CASES}
    outcomes = []
    for case in cases:
        if case.job not in runs:
            job = by_id[case.job]
            work = root / job.id
            if work.exists():
                shutil.rmtree(work)
            runs[case.job] = run_case(job, work)
            log(runs[case.job].summary())
        outcome = evaluate(case, runs[case.job])
        outcomes.append(outcome)
        mark = "right" if outcome.right else "WRONG: " + "; ".join(outcome.problems)
        log(f"  {case.id}: expected {case.expected}, got {outcome.got} ({outcome.headline}) {mark}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="case ids (default: all)")
    parser.add_argument("--keep", type=Path, default=None, help="keep every job's files here")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    parser.add_argument("--json", type=Path, default=None, help="also write the outcomes here")
    args = parser.parse_args(argv)
    cases = list(CASES)
    if args.only:
        unknown = set(args.only) - {c.id for c in CASES}
        if unknown:
            parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
        cases = [c for c in CASES if c.id in args.only]
    tmp = None
    if args.keep:
        root = args.keep
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="frtools-corpus-")
        root = Path(tmp.name)
    t0 = time.monotonic()
    try:
        outcomes = run_corpus(cases, root, log=lambda s: print(s, flush=True))
    finally:
        if tmp is not None:
            tmp.cleanup()
    text = table(outcomes)
    print()
    print(text)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "case": o.case.id,
                        "expected": o.case.expected,
                        "got": o.got,
                        "right": o.right,
                        "problems": o.problems,
                        "headline": o.headline,
                        "rc": o.rc,
                        "group": o.group,
                        "ending": o.run.ending,
                        "returncodes": o.run.returncodes,
                        "dumped_ranks": o.run.dumped_ranks,
                        "job_s": round(o.run.wall_s, 1),
                        "analyze_s": round(o.analyze_s, 1),
                    }
                    for o in outcomes
                ],
                indent=1,
            ),
            encoding="utf-8",
        )
    return 0 if all(o.right for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
