"""Two checkouts of frtools side by side: ``frtools analyze`` of the same folders, run
alternately (before, after, before, after, ...), so that a machine whose speed drifts
between runs (a shared or virtual one: see docs/benchmarks.md) costs both the same.

Prints per folder the medians of wall time, CPU time (user + system, worker processes
included) and peak memory of the process tree, the ratio, and whether the two verdict
documents are the same (``inputs`` and ``tool`` aside: paths and versions).

    git worktree add /tmp/frtools-before <commit>        # the checkout to compare against
    python benchmarks/compare.py --before /tmp/frtools-before --runs 3 DIR [DIR ...]

A checkout's native modules must be built in place (``pip install -e .`` there, or copy
the ``.so`` files of the same sources); each run starts in a scratch directory so that
the current directory's ``frtools`` does not shadow ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    args = ap.parse_args(argv)
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, path in sides.items():
        if not (path / "frtools" / "__init__.py").is_file():
            ap.error(f"--{name} {path}: not a frtools checkout")
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    print(
        "| folder | before: wall (CPU), RSS | after: wall (CPU), RSS | wall ratio | same verdict |"
    )
    print("|---|---|---|---:|---|")
    failed = False
    with tempfile.TemporaryDirectory(prefix="frtools-compare-") as scratch:
        for folder in args.folders:
            runs: dict[str, list[Run]] = {name: [] for name in sides}
            outs = {name: Path(scratch) / f"{name}.json" for name in sides}
            for _ in range(args.runs):
                for name, checkout in sides.items():
                    where = str(Path(folder).resolve())  # runs start in the scratch dir
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
                cells.append(f"{wall:.1f} s ({cpu:.1f} s), {rss:.1f} GB")
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
