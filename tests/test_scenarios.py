"""End to end: real faulty 4-rank Gloo jobs, their PyTorch Flight Recorder dumps, and the
verdict ``frtools analyze`` gives them (run as a user would, as a subprocess of the CLI).

The dump sets are generated once per session (``examples/scenarios.py``, three jobs at a
time: most of a hang case is waiting); the committed ``sample_dumps/`` are checked against
the table in their README without running any job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DUMPS = REPO / "sample_dumps"
sys.path.insert(0, str(REPO / "examples"))

import scenarios as sc  # noqa: E402

from tests.corpus.cases import SAMPLES  # noqa: E402

# Generating every case takes about 95 s on 2 busy cores; the first test pays for it.
JOB_TEST_TIMEOUT = 420
ANALYZE_TIMEOUT = 120


def analyze(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(path), *args],
        capture_output=True,
        text=True,
        timeout=ANALYZE_TIMEOUT,
        cwd=REPO,
    )


def analyze_json(path: Path) -> tuple[int, dict]:
    proc = analyze(path, "--format", "json")
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"`frtools analyze {path} --format json` exited {proc.returncode} without a JSON "
            f"report\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
        )
    return proc.returncode, report


def assert_verdict(
    rc: int,
    report: dict,
    kinds: tuple[str, ...],
    guilty: tuple[int, ...],
    groups: tuple[tuple[int, ...], ...] | None,
) -> None:
    """The answer a user reads: exit code, verdict kind, who is guilty, on which group."""
    verdict = report["verdict"]
    said = f"analyzer said: {verdict.get('kind')}: {verdict.get('headline')}"
    expected_rc = 0 if kinds == ("healthy",) else 1
    assert rc == expected_rc, f"exit code {rc}, expected {expected_rc}; {said}"
    assert verdict["kind"] in kinds, f"expected {' or '.join(kinds)}; {said}"
    assert {g["rank"] for g in verdict["guilty"]} == set(guilty), said
    if groups is not None:
        pg = verdict.get("process_group")
        assert pg is not None, f"no process group named; {said}"
        assert tuple(pg["ranks"]) in groups, f"group {pg}; expected one of {groups}; {said}"


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario's dump set from a real job, plus the damaged copy."""
    root = tmp_path_factory.mktemp("scenario-dumps")
    results = sc.generate(root, parallel=3)
    for s in sc.SCENARIOS:
        got = sc.dumps_present(root / s.case)
        want = sc.expected_dumps(s)
        assert got == want, (
            f"{s.case}: job left dumps of ranks {sorted(got)}, expected {sorted(want)}\n"
            f"{results[s.case].output()[-4000:]}"
        )
        bad = sc.unexpected_exits(s, results[s.case])
        assert not bad, f"{s.case}: {'; '.join(bad)}\n{results[s.case].output()[-4000:]}"
    return root


def check_case(generated: Path, case: str) -> dict:
    s = sc.BY_CASE[case]
    rc, report = analyze_json(generated / case)
    assert_verdict(rc, report, s.kinds, s.guilty, s.groups)
    return report


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_healthy_job_is_reported_healthy(generated: Path) -> None:
    report = check_case(generated, "healthy")
    assert report["ranks"]["found"] == 4 and report["ranks"]["missing"] == []


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_stuck_in_compute_is_blamed(generated: Path) -> None:
    report = check_case(generated, "missing")
    assert set(report["verdict"]["waiting"]) == {0, 2, 3}


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_stuck_in_compute_is_blamed_not_the_victims_it_blocks(generated: Path) -> None:
    report = check_case(generated, "missing-chain")
    assert {0, 3} <= set(report["verdict"]["waiting"])


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_stuck_rank_is_blamed_when_the_ring_buffer_dropped_its_group_entries(
    generated: Path,
) -> None:
    check_case(generated, "missing-wrapped")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_stuck_rank_is_located_in_user_code_by_its_stack(generated: Path) -> None:
    report = check_case(generated, "missing-stacks")
    (guilty,) = report["verdict"]["guilty"]
    site = guilty["call_site"] or ""
    assert "faulty_job.py" in site and "stall" in site, f"call site of rank 1: {site!r}"


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_that_skipped_a_collective_is_blamed(generated: Path) -> None:
    check_case(generated, "skipped")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_that_exited_is_blamed_as_dead(generated: Path) -> None:
    report = check_case(generated, "dead")
    assert report["ranks"]["missing"] == [2]
    # Its sockets stay open (as a dead NCCL rank's peers are not told): every survivor is
    # recorded blocked in the collective, none had it failed and retired by Gloo.
    assert report["verdict"]["waiting"] == [0, 1, 3]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_dead_rank_is_named_when_its_partner_waits_in_a_group_no_dump_lists(
    generated: Path,
) -> None:
    report = check_case(generated, "dead-partner")
    verdict = report["verdict"]
    # Rank 3 waits for it on tensor-parallel [2, 3]; when rank 0 gets through its TP ops
    # before rank 2's exit is felt, it also waits for it on data-parallel [0, 2]. Either is
    # a group in which a survivor waits for the dead rank, and neither dump lists members.
    pg = verdict["process_group"]
    assert (pg["desc"], pg["ranks"]) in (("tensor_parallel", [2, 3]), ("data_parallel", [0, 2]))
    assert pg["inferred"] is True
    assert 3 in verdict["waiting"]
    assert report["ranks"]["missing"] == [2]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_issuing_groups_in_another_order_is_blamed_for_the_deadlock(
    generated: Path,
) -> None:
    check_case(generated, "order")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_with_another_tensor_size_is_blamed(generated: Path) -> None:
    check_case(generated, "size-mismatch")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_rank_calling_another_op_is_blamed(generated: Path) -> None:
    check_case(generated, "op-mismatch")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_late_rank_is_named_straggler(generated: Path) -> None:
    check_case(generated, "straggler")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_damaged_inputs_still_give_the_verdict_and_are_listed(generated: Path) -> None:
    report = check_case(generated, "damaged")
    inputs = {Path(i["path"]).name: i for i in report["inputs"]}
    truncated = inputs[f"rank_{sc.DAMAGED_TRUNCATED}.pkl"]
    assert truncated["status"] == "error" and truncated["reason"], truncated
    assert inputs["README.txt"]["status"] in ("skipped", "error")
    assert sc.DAMAGED_REMOVED in report["ranks"]["missing"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT)
def test_terminal_report_names_the_guilty_rank_first(generated: Path) -> None:
    proc = analyze(generated / "missing")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    head = "\n".join(proc.stdout.splitlines()[:3])
    assert re.search(r"\b[Rr]ank 1\b", head), f"guilty rank 1 not in the first lines:\n{head}"
    assert "Traceback" not in proc.stdout + proc.stderr


# -- committed sample_dumps/: the verdicts their README promises (no job run) ---------------


def readme_cases() -> list[tuple[str, tuple[str, ...], tuple[int, ...], object]]:
    """Rows of the table in sample_dumps/README.md: case, kinds, guilty, groups."""
    rows = []
    text = (SAMPLE_DUMPS / "README.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or cells[0] in ("case", "") or set(cells[0]) <= {"-"}:
            continue
        kinds = tuple(k.strip() for k in cells[3].split(" or "))
        guilty = tuple(json.loads(cells[4]))
        groups = (
            None
            if cells[5] == "any"
            else tuple(tuple(json.loads(g)) for g in cells[5].split(" or "))
        )
        rows.append((cells[0], kinds, guilty, groups))
    return rows


README_CASES = readme_cases() if (SAMPLE_DUMPS / "README.md").exists() else []


def test_sample_dumps_readme_lists_every_committed_case() -> None:
    listed = {case for case, *_ in README_CASES}
    on_disk = {p.name for p in SAMPLE_DUMPS.iterdir() if p.is_dir()}
    assert listed == on_disk == set(sc.BY_CASE) | set(SAMPLES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "kinds", "guilty", "groups"), README_CASES, ids=[c[0] for c in README_CASES]
)
def test_committed_sample_dump_gives_the_verdict_its_readme_promises(
    case: str, kinds: tuple[str, ...], guilty: tuple[int, ...], groups: object
) -> None:
    rc, report = analyze_json(SAMPLE_DUMPS / case)
    assert_verdict(rc, report, kinds, guilty, groups)  # type: ignore[arg-type]
