"""Accuracy of ``frtools analyze`` on simulated jobs with a known injected fault.

Each case draws a layout (8-256 ranks, tp/cp/ep/pp/dp), a fault kind, one or two faulty
ranks, a ring-buffer size small enough to wrap, writes the dumps with ``frtools.synth``,
runs the analyzer (``load_trace`` + ``diagnose``) and compares its verdict with
``truth.json``. Prints, per fault kind, how often the verdict kind and the exact guilty set
were right, the overall exact-guilty-set rate, any blame on a healthy job, and one
``frtools synth`` command line per miss that reproduces it.

    python benchmarks/accuracy.py --cases 1000 --workers 2 --markdown acc.md

``--real`` also runs the real-job corpus (``tests/corpus/``: real multi-process Gloo jobs
with real faults, recorded by PyTorch's Flight Recorder and by ``frtools run``; about 15
minutes on 2 cores) and prints its table after the simulated one:

    python benchmarks/accuracy.py --cases 300 --real --markdown acc.md

``--summaries`` writes each case as frtools black boxes instead, summarizes them per host
(8 ranks a host, ``summarize_path`` as ``frtools summarize`` does) and judges the verdict
from the host summaries alone; it also counts how often that verdict equals the one from
the full boxes (docs/fleet.md: they must be equal):

    python benchmarks/accuracy.py --cases 300 --summaries

``--analyzer DIR`` judges this simulator's cases with the frtools found at DIR (another
checkout, e.g. before a change), run as ``python -m frtools analyze`` with ``PYTHONPATH=DIR``:
the way to check that the simulator catches an old analyzer's mistakes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from frtools.synth import FAULTS, ModelShape, synthesize

SIZES = (8, 16, 32, 64, 128, 256)
SIZE_WEIGHTS = (0.2, 0.2, 0.2, 0.15, 0.15, 0.1)


@dataclass
class Case:
    index: int
    world_size: int
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    fault: str
    faulty: int
    seed: int
    buffer_size: int
    layers: int
    microbatches: int
    dp_coalesced: bool
    timing: bool

    def argv(self, out: str = "/tmp/frtools-case") -> list[str]:
        args = [
            "frtools", "synth", "-o", f"{out}-{self.index}", "-n", str(self.world_size),
            "--tp", str(self.tp), "--cp", str(self.cp), "--ep", str(self.ep),
            "--dp", str(self.dp), "--pp", str(self.pp), "--fault", self.fault,
            "--faulty", str(self.faulty), "--seed", str(self.seed),
            "--buffer-size", str(self.buffer_size), "--layers", str(self.layers),
            "--microbatches", str(self.microbatches),
        ]  # fmt: skip
        if self.dp_coalesced:
            args.append("--dp-coalesced")
        if not self.timing:
            args.append("--no-timing")
        return args


@dataclass
class Outcome:
    case: Case
    expected_kind: str
    expected_guilty: list[int]
    expected_pg: str | None
    found_kind: str = ""
    found_guilty: list[int] = field(default_factory=list)
    found_pg: str | None = None
    error: str = ""
    seconds: float = 0.0
    same_as_full: bool | None = None  # --summaries: the full boxes' verdict is the same

    @property
    def kind_ok(self) -> bool:
        return self.found_kind == self.expected_kind

    @property
    def guilty_ok(self) -> bool:
        return not self.error and sorted(self.found_guilty) == sorted(self.expected_guilty)

    @property
    def exact(self) -> bool:
        return self.kind_ok and self.guilty_ok


def draw_case(index: int, seed: int) -> Case:
    """A random layout and fault; the same (index, seed) always gives the same case."""
    rng = np.random.default_rng((seed, index))
    n = int(rng.choice(SIZES, p=SIZE_WEIGHTS))
    dims = {"tp": 1, "cp": 1, "ep": 1, "pp": 1}
    left = n
    for axis, choices in (
        ("tp", (1, 2, 4, 8)),
        ("pp", (1, 2, 4)),
        ("cp", (1, 2)),
        ("ep", (1, 2, 4)),
    ):
        options = [c for c in choices if left % c == 0 and left // c >= 1]
        if axis in ("cp", "ep") and rng.random() < 0.6:
            options = [1]
        dims[axis] = int(rng.choice(options))
        left //= dims[axis]
    fault = str(rng.choice(FAULTS))
    faulty = 2 if fault != "healthy" and rng.random() < 0.25 else 1
    return Case(
        index=index,
        world_size=n,
        dp=left,
        fault=fault,
        faulty=faulty,
        seed=int(rng.integers(0, 1_000_000)),
        buffer_size=int(rng.choice((100, 250, 600))),
        layers=int(rng.integers(1, 3)),
        microbatches=int(rng.integers(1, 5)),
        dp_coalesced=bool(rng.random() < 0.3),
        timing=bool(rng.random() < 0.8),
        **dims,
    )


def _judge_elsewhere(analyzer: str, dumps: Path) -> tuple[str, list[int], str | None]:
    """The verdict of the frtools at ``analyzer`` (kind, guilty ranks, group name)."""
    env = {**os.environ, "PYTHONPATH": analyzer}
    proc = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(dumps), "--format", "json",
         "--workers", "1"],
        capture_output=True, text=True, env=env, cwd=analyzer, timeout=600,
    )  # fmt: skip
    v = json.loads(proc.stdout)["verdict"]
    pg = v.get("process_group")
    return v["kind"], sorted(g["rank"] for g in v["guilty"]), pg["name"] if pg else None


def _verdict_key(verdict) -> tuple[str, list[int], str | None]:  # noqa: ANN001
    pg = verdict.process_group
    return verdict.kind, sorted(g.rank for g in verdict.guilty), pg.name if pg else None


def _host_summaries(boxes: Path, out: Path, per_host: int = 8) -> Path:
    """What ``frtools dump`` leaves on each host of a fleet: one summary per 8-rank host
    folder of ``boxes`` (hard links, so the boxes are not copied)."""
    from frtools.analyze.summarize import summarize_path

    out.mkdir(parents=True)
    hosts: dict[int, list[Path]] = defaultdict(list)
    for box in boxes.glob("rank_*.frt"):
        hosts[int(box.stem.split("_")[1]) // per_host].append(box)
    for host, files in sorted(hosts.items()):
        folder = boxes.parent / f"host-{host}"
        folder.mkdir()
        for f in files:
            os.link(f, folder / f.name)
        result = summarize_path(folder, workers=1)
        (out / f"{result.host}.summary").write_bytes(result.encode())
    return out


def run_case(
    case: Case,
    tmp_root: str | None = None,
    analyzer: str | None = None,
    summaries: bool = False,
) -> Outcome:
    from frtools.analyze.diagnose import diagnose
    from frtools.analyze.readers import load_trace

    with tempfile.TemporaryDirectory(prefix="frtools-acc-", dir=tmp_root) as tmp:
        out = Path(tmp) / "dumps"
        try:
            result = synthesize(
                out,
                case.world_size,
                tp=case.tp,
                pp=case.pp,
                dp=case.dp,
                ep=case.ep,
                cp=case.cp,
                fault=case.fault,
                n_faulty=case.faulty,
                seed=case.seed,
                buffer_size=case.buffer_size,
                shape=ModelShape(
                    layers=case.layers,
                    microbatches=case.microbatches,
                    dp_coalesced=case.dp_coalesced,
                ),
                timing=case.timing,
                workers=1,
                **({"format": "frtools"} if summaries else {}),
            )
        except Exception as e:  # a case synth cannot build is reported, not hidden
            return Outcome(case, "?", [], None, error=f"synth: {type(e).__name__}: {e}")
        truth = result.truth
        pg = truth["process_group"]
        outcome = Outcome(case, truth["kind"], truth["guilty"], pg["name"] if pg else None)
        t0 = time.perf_counter()
        try:
            if analyzer:
                found = _judge_elsewhere(analyzer, out)
                outcome.found_kind, outcome.found_guilty, outcome.found_pg = found
                outcome.seconds = time.perf_counter() - t0
                return outcome
            if summaries:
                full = _verdict_key(diagnose(load_trace(out, workers=1)))
                out = _host_summaries(out, Path(tmp) / "summaries")
                t0 = time.perf_counter()
            found = _verdict_key(diagnose(load_trace(out, workers=1)))
            outcome.found_kind, outcome.found_guilty, outcome.found_pg = found
            if summaries:
                outcome.same_as_full = found == full
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)[-1]
            outcome.error = f"{type(e).__name__}: {e} ({Path(tb.filename).name}:{tb.lineno})"
            outcome.found_kind = "error"
        outcome.seconds = time.perf_counter() - t0
        return outcome


def _fmt_ranks(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks[:6])) + (",…" if len(ranks) > 6 else "") + "]"


def report(outcomes: list[Outcome]) -> str:
    """The accuracy tables as markdown (also readable in a terminal)."""
    by_fault: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_fault[o.case.fault].append(o)
    lines = [
        "| fault | cases | kind right | exact guilty set | kind + guilty | most common wrong answer |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for fault in FAULTS:
        os_ = by_fault.get(fault, [])
        if not os_:
            continue
        wrong = [o for o in os_ if not o.exact]
        common = ""
        if wrong:
            counts: dict[str, int] = defaultdict(int)
            for o in wrong:
                counts[o.found_kind + (" (crash)" if o.error else "")] += 1
            k, c = max(counts.items(), key=lambda kv: kv[1])
            common = f"{k} ×{c}"
        lines.append(
            f"| {fault} | {len(os_)} | {sum(o.kind_ok for o in os_) / len(os_):.1%} "
            f"| {sum(o.guilty_ok for o in os_) / len(os_):.1%} "
            f"| {sum(o.exact for o in os_) / len(os_):.1%} | {common} |"
        )
    n = len(outcomes)
    exact_guilty = sum(o.guilty_ok for o in outcomes)
    exact = sum(o.exact for o in outcomes)
    healthy = by_fault.get("healthy", [])
    blamed = [o for o in healthy if o.found_guilty or o.found_kind != "healthy"]
    times = sorted(o.seconds for o in outcomes if o.seconds)
    lines += [
        "",
        f"- cases: {n}; exact guilty set: {exact_guilty}/{n} = {exact_guilty / max(1, n):.1%}; "
        f"kind and guilty set both right: {exact}/{n} = {exact / max(1, n):.1%}",
        f"- healthy jobs blamed (any guilty rank or a non-healthy verdict): {len(blamed)}/{len(healthy)}",
        f"- analysis time per case: median {times[len(times) // 2] if times else 0:.2f} s, "
        f"max {times[-1] if times else 0:.2f} s",
    ]
    through = [o for o in outcomes if o.same_as_full is not None]
    if through:
        same = sum(o.same_as_full for o in through)
        lines.append(
            f"- verdict from the host summaries = verdict from the full boxes (kind, guilty "
            f"set, group): {same}/{len(through)}"
        )
    misses = [o for o in outcomes if not o.exact]
    if misses:
        lines += ["", f"Misses ({len(misses)}), each reproducible with its command:", ""]
        for o in misses:
            c = o.case
            lines.append(
                f"- case {c.index}: {c.fault} on {c.world_size} ranks "
                f"(tp{c.tp} cp{c.cp} ep{c.ep} dp{c.dp} pp{c.pp}): expected {o.expected_kind} "
                f"{_fmt_ranks(o.expected_guilty)}, found {o.found_kind} {_fmt_ranks(o.found_guilty)}"
                + (f" — {o.error}" if o.error else "")
            )
            argv = c.argv() + (["--format", "frtools"] if o.same_as_full is not None else [])
            lines.append(f"  `{shlex.join(argv)}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--fault", choices=FAULTS, help="only cases of this fault")
    ap.add_argument("--markdown", help="also write the report to this file")
    ap.add_argument("--json", help="write every case's outcome to this file")
    ap.add_argument("--tmp", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument(
        "--analyzer",
        help="judge with the frtools in this directory (PYTHONPATH), e.g. an older checkout",
    )
    ap.add_argument(
        "--real", action="store_true", help="also run the real-job corpus (tests/corpus/)"
    )
    ap.add_argument(
        "--summaries",
        action="store_true",
        help="write frtools black boxes, summarize them per 8-rank host, judge the summaries",
    )
    args = ap.parse_args(argv)
    analyzer = str(Path(args.analyzer).resolve()) if args.analyzer else None

    cases = [draw_case(i, args.seed) for i in range(args.cases)]
    if args.fault:
        cases = [c for c in cases if c.fault == args.fault]
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    if args.workers <= 1:
        for c in cases:
            outcomes.append(run_case(c, args.tmp, analyzer, args.summaries))
    else:
        with ProcessPoolExecutor(args.workers) as pool:
            futures = [pool.submit(run_case, c, args.tmp, analyzer, args.summaries) for c in cases]
            for i, f in enumerate(futures, 1):
                outcomes.append(f.result())
                if i % 50 == 0:
                    print(f"  {i}/{len(cases)} cases", file=sys.stderr)
    what = "Simulated jobs through host summaries" if args.summaries else "Simulated jobs"
    text = f"### {what} ({len(cases)} cases, seed {args.seed})\n\n" + report(outcomes)
    print(text)
    print(f"\n({len(cases)} cases in {time.perf_counter() - t0:.0f} s)")
    real_right = True
    if args.real:
        real_text, real_right = _real_corpus()
        print("\n" + real_text)
        text += "\n\n" + real_text
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{**asdict(o), "exact": o.exact} for o in outcomes],
                indent=1,
            )
        )
    exact_guilty = sum(o.guilty_ok for o in outcomes) / max(1, len(outcomes))
    blamed = any(
        o.case.fault == "healthy" and (o.found_guilty or o.found_kind != "healthy")
        for o in outcomes
    )
    differ = any(o.same_as_full is False for o in outcomes)
    return 0 if exact_guilty >= 0.99 and not blamed and real_right and not differ else 1


def _real_corpus() -> tuple[str, bool]:
    """Every corpus case, each job run once: the markdown table and whether all were right."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from tests.corpus.cases import CASES
    from tests.corpus.report import run_corpus, table

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="frtools-corpus-") as tmp:
        outcomes = run_corpus(list(CASES), Path(tmp), log=lambda m: print(m, file=sys.stderr))
    head = (
        f"### Real jobs ({len(outcomes)} corpus cases, torch {torch.__version__}, "
        f"{time.perf_counter() - t0:.0f} s)\n\n"
    )
    return head + table(outcomes), all(o.right for o in outcomes)


if __name__ == "__main__":
    sys.exit(main())
