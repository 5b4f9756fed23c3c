"""The fleet path with merged host summaries: a tree of merges, then the central step.

``frtools synth --format summary`` writes the 8-rank host summaries of an N-rank job
(benchmarks/scale.py's ``make_dumps``, cached under ``--dir``); this merges them ``--fan-in``
at a time, level after level, as the Ray merge tasks or a per-rack ``frtools summarize
--merge`` do (each level's partials in their own folder: what one merge task costs is
printed, the tasks of a level run in parallel on the cluster), then times the central step,
``frtools analyze`` of each of the last levels' folders (a few partials, or one), against
the flat folder of host summaries: wall, CPU (user+sys), peak RSS, medians of ``--runs``,
and whether the verdict is the injected fault's and the flat folder's.

    python benchmarks/fleet_merge.py --ranks 131072 --fan-in 16 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import _fmt_time, _median, _same_verdict, _verdict_right, make_dumps, measure  # noqa: E402

from frtools.formats.summary_packed import (  # noqa: E402
    PACKED_SUFFIX,
    decode_packed_many,
    host_file_name,
    merge_packed,
)


def merge_level(files: list[Path], fan_in: int, out: Path) -> dict:
    """One level of the tree: every ``fan_in`` consecutive files into one partial."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"*{PACKED_SUFFIX}"):
        old.unlink()
    task_s = []
    t_cpu = time.process_time()
    t0 = time.perf_counter()
    for i in range(0, len(files), fan_in):
        group = files[i : i + fan_in]
        t = time.perf_counter()
        parts = decode_packed_many([f.read_bytes() for f in group])
        bad = [str(f) for f, p in zip(group, parts, strict=True) if isinstance(p, Exception)]
        if bad:
            raise SystemExit(f"refused: {bad[0]}")
        data = merge_packed(parts, [str(f) for f in group])  # type: ignore[arg-type]
        hosts = sorted(h for p in parts for h in p.hosts)  # type: ignore[union-attr]
        (out / host_file_name(f"{hosts[0]}..{hosts[-1]}")).write_bytes(data)
        task_s.append(time.perf_counter() - t)
    return {
        "files": len(list(out.glob(f"*{PACKED_SUFFIX}"))),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - t_cpu,
        "task_max_s": max(task_s),
        "task_median_s": statistics.median(task_s),
        "mb": sum(p.stat().st_size for p in out.glob(f"*{PACKED_SUFFIX}")) / 2**20,
    }


def central(folder: Path, verdict: Path, args: argparse.Namespace, runs: int) -> dict:
    argv = [sys.executable, "-m", "frtools", "analyze", str(folder), "--format", "json"]
    argv += ["-o", str(verdict)]
    env = dict(os.environ)
    if args.limits:
        env["FRTOOLS_LIMITS"] = args.limits
    done = [measure(argv, args.limit, env, args.max_gb) for _ in range(runs)]
    return {
        "time": _fmt_time(done, args.limit),
        "wall_s": _median(done, "wall_s"),
        "cpu_s": _median(done, "cpu_s"),
        "max_rss_mb": _median(done, "max_rss_mb"),
        "tree_rss_mb": _median(done, "tree_rss_mb"),
        "runs": runs,
        "failed": sum(r.returncode not in (0, 1) for r in done),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=131072)
    ap.add_argument("--fan-in", type=int, default=16)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3, help="central-step runs per folder (median)")
    ap.add_argument("--flat-runs", type=int, default=1, help="runs on the flat folder")
    ap.add_argument(
        "--central-levels", type=int, default=2, help="time the central step on the last N levels"
    )
    ap.add_argument("--limit", type=float, default=600)
    ap.add_argument(
        "--max-gb",
        type=float,
        help="kill a central step whose process tree passes this many GiB (a million ranks "
        "on a small machine); the table says so",
    )
    ap.add_argument(
        "--limits",
        default="dump_bytes=1G",
        help="FRTOOLS_LIMITS for the central step (a partial of the whole job is >128 MiB)",
    )
    ap.add_argument(
        "--stop-at",
        type=int,
        default=1,
        help="merge until at most this many partials are left (what --ray hands the driver)",
    )
    ap.add_argument("--dir", default="/dev/shm/frtools-merge")
    ap.add_argument("--reuse", action="store_true", help="reuse the partials of an earlier run")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load {load[0]:.2f}; under {root}", flush=True)
    hosts_dir = make_dumps(root, args.ranks, args.entries, "summary", args.tp, args.pp)
    truth = hosts_dir / "truth.json"
    files = sorted(hosts_dir.glob(f"*{PACKED_SUFFIX}"))
    levels = []
    level_dirs = []
    while len(files) > args.stop_at:
        out = root / f"partials-{args.ranks}-f{args.fan_in}-l{len(levels) + 1}"
        done = sorted(out.glob(f"*{PACKED_SUFFIX}"))
        if args.reuse and len(done) == -(-len(files) // args.fan_in):
            print(f"  merge level {len(levels) + 1}: reusing {out}", flush=True)
            levels.append({})
            level_dirs.append(out)
            files = done
            continue
        row = merge_level(files, args.fan_in, out)
        levels.append(row)
        level_dirs.append(out)
        print(
            f"  merge level {len(levels)}: {len(files):,} -> {row['files']:,} files "
            f"({row['mb']:.0f} MB); one task median {row['task_median_s']:.2f} s, max "
            f"{row['task_max_s']:.2f} s; the level in one process {row['wall_s']:.1f} s wall, "
            f"{row['cpu_s']:.1f} s CPU",
            flush=True,
        )
        files = sorted(out.glob(f"*{PACKED_SUFFIX}"))
    rows = []
    flat_verdict = root / f"verdict-flat-{args.ranks}.json"
    if args.flat_runs:
        row = central(hosts_dir, flat_verdict, args, args.flat_runs)
        rows.append({"folder": "flat", "files": len(list(hosts_dir.glob("*.summary"))), **row})
    for d in level_dirs[-args.central_levels :]:
        verdict = root / f"verdict-{d.name}.json"
        row = central(d, verdict, args, args.runs)
        row["right"] = _verdict_right(verdict, truth)
        row["same_as_flat"] = _same_verdict(verdict, flat_verdict) if args.flat_runs else None
        rows.append({"folder": d.name, "files": len(list(d.glob("*.summary"))), **row})
    if args.flat_runs:
        rows[0]["right"] = _verdict_right(flat_verdict, truth)
        rows[0]["same_as_flat"] = True
    load = os.getloadavg()
    print()
    print(
        f"central step, {args.ranks:,} ranks, fan-in {args.fan_in} "
        f"(load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end)"
    )
    # peak RSS: the sampled sum over the process tree (a forked child's ru_maxrss would
    # start from this process's own, large after merging)
    print("| input | files | wall | CPU (user+sys) | peak RSS (process tree) | verdict |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        verdict = "right" if r["right"] else "WRONG"
        if r["failed"] == r["runs"]:
            verdict = "none: no run finished"
        if r["same_as_flat"] is not None:
            verdict += ", = flat" if r["same_as_flat"] else ", DIFFERS from flat"
        print(
            f"| {r['folder']} | {r['files']:,} | {r['time']} (median of {r['runs']}) "
            f"| {r['cpu_s']:.1f} s | {r['tree_rss_mb']:.0f} MB "
            f"| {verdict}{'; FAILED runs' if r['failed'] else ''} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
