"""Two checkouts of frtools side by side: ``frtools analyze`` of the same folders, run
alternately (before, after, before, after, ...), so that a machine whose speed drifts
between runs (a shared or virtual one: see docs/benchmarks.md) costs both the same.

Prints per folder the medians of wall time, CPU time (user + system, worker processes
included) and peak memory of the process tree, the ratio, and whether the two verdict
documents are the same (``inputs`` and ``tool`` aside: paths and versions). Memory is the process tree's
peak RSS and, in brackets, the machine's peak rise of memory in use (``scale.measure``: the
readers' spool in /dev/shm included, which RSS misses).

    git worktree add /tmp/frtools-before <commit>        # the checkout to compare against
    python benchmarks/compare.py --before /tmp/frtools-before --runs 3 DIR [DIR ...]
    python benchmarks/compare.py --before /tmp/frtools-before --runs 3 --stages DIR
    python benchmarks/compare.py --before /tmp/frtools-before --before-folders OLD -- NEW

``--before-folders`` gives the before checkout its own folders, one per folder, where a
change of file format means the same job is written as each checkout writes it.

``--stages`` times the analysis's stages instead (reading, align, diagnose, all three), as
``frtools analyze`` runs them (``commands._common.load_and_diagnose``, in a fresh process a
run): a change of a second in one stage is lost in the drift of a whole run on this VM.

A checkout's native modules must be built in place (``pip install -e .`` there, or copy
the ``.so`` files of the same sources); each run starts in a scratch directory so that
the current directory's ``frtools`` does not shadow ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import Run, measure  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def _run(checkout: Path, folder: str, out: Path, limit: float, scratch: str) -> Run:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.setdefault("FRTOOLS_LIMITS", "dump_bytes=1G")  # a merged partial is > 128 MiB
    argv = [sys.executable, "-m", "frtools", "analyze", folder, "--format", "json"]
    argv += ["-o", str(out)]
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        return measure(argv, limit, env)
    finally:
        os.chdir(cwd)


# One run of ``--stages``: the stages ``frtools analyze`` runs, each timed where the command
# calls it (the names it imports at call time), as one JSON line on stdout.
_STAGES = """
import json, sys, time
from pathlib import Path
import frtools.analyze.align as A
import frtools.analyze.diagnose as D
import frtools.analyze.diagnosis as G
import frtools.analyze.readers as R
from frtools.commands import _common

took = {}
# align and diagnose where the command calls them (G: through align_and_diagnose)
for module, name, label in ((R, "load_trace", "read"), (A, "align", "align"),
                            (G, "align", "align"), (D, "diagnose", "diagnose"),
                            (G, "diagnose", "diagnose")):
    def timed(*a, _f=getattr(module, name), _label=label, **k):
        t = time.perf_counter()
        try:
            return _f(*a, **k)
        finally:
            took[_label] = time.perf_counter() - t
    setattr(module, name, timed)
t = time.perf_counter()
_common.load_and_diagnose("frtools analyze", Path(sys.argv[1]))
took["all three"] = time.perf_counter() - t
print(json.dumps(took))
"""
STAGES = ("read", "align", "diagnose", "all three")


def _stages(checkout: Path, folder: str, limit: float, scratch: str) -> dict[str, float]:
    """Each stage's wall seconds in one run of ``checkout`` on ``folder``."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.setdefault("FRTOOLS_LIMITS", "dump_bytes=1G")
    done = subprocess.run(
        [sys.executable, "-c", _STAGES, folder],
        env=env,
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=limit,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{checkout} on {folder}: exit {done.returncode}: {tail}")
    return json.loads(lines[-1])


def _where(name: str, folder: str, theirs: dict[str, str]) -> str:
    """The folder ``name``'s checkout reads for ``folder``, as an absolute path (runs start
    in the scratch dir)."""
    return str(Path(theirs.get(folder, folder) if name == "before" else folder).resolve())


def compare_stages(
    sides: dict[str, Path], folders: list[str], runs: int, limit: float, theirs: dict[str, str]
) -> None:
    """Per folder and stage: the medians of both checkouts' runs (alternating) and ratio."""
    print("| folder | stage | before (s) | after (s) | ratio |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="frtools-compare-") as scratch:
        for folder in folders:
            took: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
            for _ in range(runs):
                for name, checkout in sides.items():
                    where = _where(name, folder, theirs)
                    took[name].append(_stages(checkout, where, limit, scratch))
            for stage in STAGES:
                before, after = (statistics.median(t[stage] for t in took[name]) for name in sides)
                print(
                    f"| {folder} | {stage} | {before:.2f} | {after:.2f} | {before / after:.2f}x |",
                    flush=True,
                )


def _document(path: Path) -> dict:
    doc = json.loads(path.read_text())
    for key in ("inputs", "tool"):
        doc.pop(key, None)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="dump folders to analyze")
    ap.add_argument("--before", required=True, help="the checkout to compare against")
    ap.add_argument("--after", default=str(HERE), help="default: this checkout")
    ap.add_argument("--runs", type=int, default=3, help="runs of each checkout per folder")
    ap.add_argument("--limit", type=float, default=600, help="seconds per run")
    ap.add_argument(
        "--stages", action="store_true", help="time reading, align and diagnose instead"
    )
    ap.add_argument(
        "--before-folders",
        nargs="*",
        default=[],
        help="what the before checkout reads instead, one per folder (a format change)",
    )
    args = ap.parse_args(argv)
    if args.before_folders and len(args.before_folders) != len(args.folders):
        ap.error("--before-folders: one per folder")
    theirs = dict(zip(args.folders, args.before_folders, strict=False))
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, path in sides.items():
        if not (path / "frtools" / "__init__.py").is_file():
            ap.error(f"--{name} {path}: not a frtools checkout")
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    if args.stages:
        compare_stages(sides, args.folders, args.runs, args.limit, theirs)
        print(
            f"(medians of {args.runs}, run alternately; load {os.getloadavg()[0]:.2f} at the end)"
        )
        return 0
    print(
        "| folder | before: wall (CPU), RSS (machine) | after: wall (CPU), RSS (machine) "
        "| wall ratio | same verdict |"
    )
    print("|---|---|---|---:|---|")
    failed = False
    with tempfile.TemporaryDirectory(prefix="frtools-compare-") as scratch:
        for folder in args.folders:
            runs: dict[str, list[Run]] = {name: [] for name in sides}
            outs = {name: Path(scratch) / f"{name}.json" for name in sides}
            for _ in range(args.runs):
                for name, checkout in sides.items():
                    where = _where(name, folder, theirs)
                    runs[name].append(_run(checkout, where, outs[name], args.limit, scratch))
            cells = []
            for name in sides:
                rs = runs[name]
                if any(r.timed_out or r.returncode not in (0, 1) for r in rs):
                    failed = True
                    cells.append("failed or timed out")
                    continue
                wall = statistics.median(r.wall_s for r in rs)
                cpu = statistics.median(r.cpu_s for r in rs)
                rss = statistics.median(r.tree_rss_mb for r in rs) / 1024
                used = statistics.median(r.used_mb for r in rs) / 1024
                cells.append(f"{wall:.1f} s ({cpu:.1f} s), {rss:.1f} GB ({used:.1f} GB)")
            if any(c == "failed or timed out" for c in cells):
                print(f"| {folder} | {cells[0]} | {cells[1]} | - | - |", flush=True)
                continue
            before = statistics.median(r.wall_s for r in runs["before"])
            after = statistics.median(r.wall_s for r in runs["after"])
            same = _document(outs["before"]) == _document(outs["after"])
            failed |= not same
            print(
                f"| {folder} | {cells[0]} | {cells[1]} | {before / after:.2f}x "
                f"| {'yes' if same else 'NO'} |",
                flush=True,
            )
    print(f"(medians of {args.runs}, run alternately; load {os.getloadavg()[0]:.2f} at the end)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
