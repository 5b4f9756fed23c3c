"""Regenerate ``sample_dumps/``: one PyTorch Flight Recorder dump set per fault scenario.

Each case is a real 4-rank Gloo job (``examples/faulty_job.py``) launched through
``tests/jobs.py``; ``sample_dumps/README.md`` is rewritten with the expected verdicts, which
``tests/test_scenarios.py`` checks against ``frtools analyze``.

    python scripts/make_sample_dumps.py [--out sample_dumps] [--case missing ...]
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import scenarios as sc  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.corpus.cases import BY_ID, SAMPLES  # noqa: E402

README_HEAD = """# Sample dumps

Real PyTorch {torch} Flight Recorder dumps (pickle, `_dump_fr_trace()`, format version
{version}) of a 4-rank Gloo job, `examples/faulty_job.py`, one directory per injected fault.
Process groups: `tensor_parallel` [0, 1], [2, 3]; `data_parallel` [0, 2], [1, 3]; the world
group `default_pg`. {steps} training steps; the fault hits at step {fault_step}. A hung rank's
dump is written by a watchdog thread while its main thread is still blocked.

Regenerate with `python scripts/make_sample_dumps.py` (about 90 s); `tests/test_scenarios.py`
checks `frtools analyze <dir> --format json` against the table below (exit code 0 for healthy,
1 otherwise). "guilty" is the exact guilty rank set; "process group" lists the acceptable
member sets of `verdict.process_group` ("any": not checked).

| case | fault | faulty rank | expected kind | guilty | process group | what happens |
|---|---|---|---|---|---|---|
"""

REAL_HEAD = """
## Real-job sets

Dumps of the real-job corpus (`tests/corpus/`, DDP / MoE / several process groups, 4 or 8
ranks) as users record them: PyTorch's Flight Recorder dumping in-process (`*.pkl`), or
`frtools run` then `frtools dump` (`*.frt`). The torch version each was recorded with
opens its description. Regenerate with `python scripts/make_sample_dumps.py --real` under
that torch (each set it names; about 30 s a set).

| case | fault | faulty rank | expected kind | guilty | process group | what happens |
|---|---|---|---|---|---|---|
"""

README_TAIL = """
See `docs/gloo-fr-facts.md` for what PyTorch's Flight Recorder records on Gloo.
"""


def _groups_text(groups: tuple[tuple[int, ...], ...] | None) -> str:
    if groups is None:
        return "any"
    return " or ".join("[" + ", ".join(map(str, g)) + "]" for g in groups)


def readme_text(torch_version: str, dump_version: str) -> str:
    rows = []
    for s in (*sc.SCENARIOS, sc.DAMAGED):
        rows.append(
            f"| {s.case} | {s.fault} | {'-' if s.rank is None else s.rank} | "
            f"{' or '.join(s.kinds)} | "
            f"{'[' + ', '.join(map(str, s.guilty)) + ']'} | {_groups_text(s.groups)} | "
            f"{s.what} |"
        )
    head = README_HEAD.format(
        torch=torch_version, version=dump_version, steps=sc.STEPS, fault_step=sc.FAULT_STEP
    )
    real = []
    for name, (case_id, series) in SAMPLES.items():
        c = BY_ID[case_id]
        recorder = "PyTorch FR" if c.recorder == "fr" else "frtools"
        real.append(
            f"| {name} | {c.fault} | {'-' if c.fault_rank is None else c.fault_rank} | "
            f"{c.kind} | {'[' + ', '.join(map(str, c.guilty)) + ']'} | "
            f"{_groups_text(c.groups)} | torch {series}, {recorder}, {c.ranks} ranks "
            f"(corpus case `{case_id}`): {c.why} |"
        )
    return head + "\n".join(rows) + "\n" + REAL_HEAD + "\n".join(real) + "\n" + README_TAIL


def _dump_version(path: Path) -> str:
    """The ``version`` field of a dump, found in the bytes without unpickling (a dump is
    data): PyTorch writes a protocol-2 pickle, ``X<len>version`` then ``X<len><value>``."""
    pattern = rb"\x07\x00\x00\x00version(?:q.)?X.\x00\x00\x00([0-9]+\.[0-9]+)"
    match = re.search(pattern, path.read_bytes(), re.DOTALL)
    return match.group(1).decode() if match else "?"


def _write_readme(out: Path, torch_version: str) -> None:
    """The README names the torch of the scenario sets: the running one, unless only real
    sets were made, then the one the README already states."""
    version = _dump_version(out / "healthy" / "rank_0.pkl") if (out / "healthy").exists() else "?"
    readme = out / "README.md"
    if readme.exists():
        stated = re.search(r"Real PyTorch (\S+) Flight", readme.read_text(encoding="utf-8"))
        if stated and not torch_version.startswith(stated.group(1)[:4]):
            torch_version = stated.group(1)
    readme.write_text(readme_text(torch_version, version), encoding="utf-8")


def make_real(out: Path, names: tuple[str, ...]) -> list[str]:
    """Run the corpus jobs of the real-job sets recorded with this torch into OUT/<name>/;
    a set is kept only when its verdict is the one the corpus expects."""
    import torch

    from tests.corpus.harness import run_case
    from tests.corpus.report import evaluate

    series = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    chosen = [n for n, (_, s) in SAMPLES.items() if s == series and (not names or n in names)]
    if not chosen:
        raise click.ClickException(f"no real-job set is recorded with torch {series}")
    with tempfile.TemporaryDirectory(prefix="frtools-samples-") as tmp:
        for name in chosen:
            case = BY_ID[SAMPLES[name][0]]
            outcome = evaluate(case, run_case(case, Path(tmp) / name))
            click.echo(f"{name:24} {outcome.run.summary()}  -> {outcome.got}")
            if not outcome.right:
                raise click.ClickException(f"{name}: {'; '.join(outcome.problems)}")
            if (out / name).exists():
                shutil.rmtree(out / name)
            shutil.copytree(outcome.run.dumps, out / name)
    return chosen


@click.command()
@click.option(
    "--out", type=click.Path(path_type=Path), default=REPO / "sample_dumps", show_default=True
)
@click.option("--case", "cases", multiple=True, help="only these cases (default: all)")
@click.option("--parallel", default=3, show_default=True, help="jobs run at the same time")
@click.option(
    "--real", is_flag=True, help="the real-job sets recorded with this torch, not the scenarios"
)
def main(out: Path, cases: tuple[str, ...], parallel: int, real: bool) -> None:
    """Run every fault scenario and write its dumps to OUT/<case>/."""
    import torch  # only to name the version in the README

    if real:
        produced = make_real(out, cases)
        _write_readme(out, torch.__version__)
        click.echo(f"wrote {len(produced)} real-job sets and README.md to {out}")
        return

    chosen = [s for s in sc.SCENARIOS if not cases or s.case in cases]
    if cases and "damaged" in cases and not any(s.case == sc.DAMAGED_FROM for s in chosen):
        chosen.append(sc.BY_CASE[sc.DAMAGED_FROM])
    with tempfile.TemporaryDirectory(prefix="frtools-samples-") as tmp:
        results = sc.generate(Path(tmp), chosen, parallel=parallel)
        failed = False
        for s in chosen:
            got = sc.dumps_present(Path(tmp) / s.case)
            want = sc.expected_dumps(s)
            bad = sc.unexpected_exits(s, results[s.case])
            status = "ok" if got == want else f"UNEXPECTED dumps {sorted(got)}"
            if bad:
                status += "; " + "; ".join(bad)
            failed |= got != want or bool(bad)
            click.echo(f"{s.case:14} ranks dumped {sorted(got)}  {status}")
        if failed:
            raise click.ClickException("some cases did not produce the expected dumps")
        out.mkdir(parents=True, exist_ok=True)
        produced = [s.case for s in chosen] + (
            [sc.DAMAGED.case] if sc.DAMAGED_FROM in results else []
        )
        for case in produced:
            if (out / case).exists():
                shutil.rmtree(out / case)
            shutil.copytree(Path(tmp) / case, out / case)
    _write_readme(out, torch.__version__)
    click.echo(f"wrote {len(produced)} cases and README.md to {out}")


if __name__ == "__main__":
    main()
