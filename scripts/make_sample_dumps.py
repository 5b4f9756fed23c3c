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
    return head + "\n".join(rows) + "\n" + README_TAIL


def _dump_version(path: Path) -> str:
    """The ``version`` field of a dump, found in the bytes without unpickling (a dump is
    data): PyTorch writes a protocol-2 pickle, ``X<len>version`` then ``X<len><value>``."""
    pattern = rb"\x07\x00\x00\x00version(?:q.)?X.\x00\x00\x00([0-9]+\.[0-9]+)"
    match = re.search(pattern, path.read_bytes(), re.DOTALL)
    return match.group(1).decode() if match else "?"


@click.command()
@click.option(
    "--out", type=click.Path(path_type=Path), default=REPO / "sample_dumps", show_default=True
)
@click.option("--case", "cases", multiple=True, help="only these cases (default: all)")
@click.option("--parallel", default=3, show_default=True, help="jobs run at the same time")
def main(out: Path, cases: tuple[str, ...], parallel: int) -> None:
    """Run every fault scenario and write its dumps to OUT/<case>/."""
    import torch  # only to name the version in the README

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
    version = _dump_version(out / "healthy" / "rank_0.pkl") if (out / "healthy").exists() else "?"
    (out / "README.md").write_text(readme_text(torch.__version__, version), encoding="utf-8")
    click.echo(f"wrote {len(produced)} cases and README.md to {out}")


if __name__ == "__main__":
    main()
