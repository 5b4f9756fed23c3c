"""Time and memory of ``frtools analyze`` vs ``torchfrtrace`` on simulated dumps at scale.

For each world size (default 256, 1024, 4096 ranks, 2000 entries per rank, tp 8, one rank
missing from a tensor-parallel collective) the dumps are written once with
``frtools synth``; then each analyzer runs as a child process, ``--runs`` times, and the
median wall time, CPU time (user + system, children included: robust on a shared machine)
and peak memory are printed with the ratios. Peak memory is reported two
ways: the largest single process (``wait4`` rusage of the child and its waited-for
descendants) and the whole process tree (RSS summed over the tree, sampled every 50 ms),
since ``frtools analyze`` reads files in worker processes. torchfrtrace is stopped at
``--torch-limit`` seconds and shown as "> limit".

    python benchmarks/scale.py --ranks 256,1024,4096 --runs 3 --torch-limit 600
    python benchmarks/scale.py --profile 1024     # where frtools' time goes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user + system of the process and its waited-for descendants
    max_rss_mb: float  # largest single process
    tree_rss_mb: float  # peak of the summed RSS of the process tree
    returncode: int | None
    timed_out: bool


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def _tree_rss(pid: int) -> int:
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{p}/statm") as f:
            total += int(f.read().split()[1]) * PAGE
        stack += _children(p)
    return total


def measure(argv: list[str], limit: float, env: dict[str, str] | None = None) -> Run:
    """Run ``argv`` to completion or ``limit`` seconds; its wall time and peak memory."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timed_out = False
    rusage = None
    status = 0
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > limit:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _, status, rusage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # leave no worker behind
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Run(
        wall_s=wall,
        cpu_s=(rusage.ru_utime + rusage.ru_stime) if rusage else 0.0,
        max_rss_mb=(rusage.ru_maxrss / 1024) if rusage else 0.0,
        tree_rss_mb=peak[0] / 2**20,
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
    )


def make_dumps(
    root: Path, n: int, entries: int, fmt: str = "torch", tp: int = 8, pp: int = 1
) -> Path:
    out = root / f"{fmt}-{n}-{entries}-tp{tp}-pp{pp}"
    truth = out / "truth.json"
    if truth.exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    argv = [sys.executable, "-m", "frtools", "synth", "-o", str(out), "-n", str(n), "--tp", str(tp)]
    argv += ["--pp", str(pp), "--fault", "missing", "--seed", "1", "--buffer-size", str(entries)]
    if fmt != "torch":
        argv += ["--format", fmt]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"  synth {n} ranks x {entries} entries: {time.perf_counter() - t0:.1f} s, {size / 2**30:.2f} GB"
    )
    return out


def _verdict_right(verdict_path: Path, truth_path: Path) -> bool:
    """Fast and right: the verdict's kind and guilty ranks are the injected fault's."""
    try:
        verdict = json.loads(verdict_path.read_text())["verdict"]
        truth = json.loads(truth_path.read_text())
    except (OSError, ValueError, KeyError):
        return False
    guilty = sorted(g["rank"] for g in verdict["guilty"])
    return verdict["kind"] == truth["kind"] and guilty == sorted(truth["guilty"])


def _median(runs: list[Run], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def _fmt_time(runs: list[Run], limit: float) -> str:
    if any(r.timed_out for r in runs):
        return f"> {limit:.0f} s"
    return f"{_median(runs, 'wall_s'):.1f} s"


def bench(args: argparse.Namespace) -> list[dict]:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    sizes = [(n, "torch") for n in args.ranks] + [(n, "frtools") for n in args.snapshot_ranks]
    for n, fmt in sizes:
        where = Path(args.snapshot_dir) if fmt == "frtools" else root
        d = make_dumps(where, n, args.entries, fmt, args.tp, args.pp)
        verdict_path = root / f"verdict-{fmt}-{n}.json"
        verdict_path.unlink(missing_ok=True)
        fr_argv = [sys.executable, "-m", "frtools", "analyze", str(d), "--format", "json"]
        fr_argv += ["-o", str(verdict_path)]
        fr = [measure(fr_argv, args.limit) for _ in range(args.runs)]
        bad = [r for r in fr if r.returncode not in (0, 1)]
        right = _verdict_right(verdict_path, d / "truth.json")
        torch_runs: list[Run] = []
        if not args.no_torch and fmt == "torch":
            tt_argv = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d)]
            for _ in range(args.torch_runs):
                r = measure(tt_argv, args.torch_limit)
                torch_runs.append(r)
                if r.timed_out or r.wall_s > 120:
                    break  # one over-long run is enough
        row = {
            "ranks": n,
            "format": "PyTorch pickles" if fmt == "torch" else "frtools snapshots",
            "entries_per_rank": args.entries,
            "frtools_s": _median(fr, "wall_s"),
            "frtools_cpu_s": _median(fr, "cpu_s"),
            "frtools_runs": len(fr),
            "frtools_max_rss_mb": _median(fr, "max_rss_mb"),
            "frtools_tree_rss_mb": _median(fr, "tree_rss_mb"),
            "frtools_failed": len(bad),
            "verdict_right": right,
            "torch_s": _median(torch_runs, "wall_s") if torch_runs else None,
            "torch_cpu_s": _median(torch_runs, "cpu_s") if torch_runs else None,
            "torch_rc": [r.returncode for r in torch_runs],
            "torch_runs": len(torch_runs),
            "torch_timed_out": any(r.timed_out for r in torch_runs),
            "torch_max_rss_mb": _median(torch_runs, "max_rss_mb") if torch_runs else None,
            "torch_limit_s": args.torch_limit,
            "frtools_time": _fmt_time(fr, args.limit),
            "torch_time": _fmt_time(torch_runs, args.torch_limit) if torch_runs else "-",
        }
        row["speedup"] = row["cpu_speedup"] = "-"
        if torch_runs:
            more = "> " if row["torch_timed_out"] else ""
            for key, a, b in (
                ("speedup", "torch_s", "frtools_s"),
                ("cpu_speedup", "torch_cpu_s", "frtools_cpu_s"),
            ):
                ratio = row[a] / max(row[b], 1e-9)
                row[key] = f"{more}{ratio:.1f}x" if ratio < 10 else f"{more}{ratio:.0f}x"
        rows.append(row)
        print(
            f"  {n} ranks ({row['format']}): frtools {row['frtools_time']} "
            f"(CPU {row['frtools_cpu_s']:.1f} s, median of {len(fr)}), "
            f"{row['frtools_max_rss_mb']:.0f} MB max process / {row['frtools_tree_rss_mb']:.0f} MB tree; "
            f"torchfrtrace {row['torch_time']} (CPU {row['torch_cpu_s'] or 0:.1f} s, "
            f"rc {row['torch_rc']}); speedup {row['speedup']} wall, {row['cpu_speedup']} CPU"
            + (f"; {len(bad)} frtools runs FAILED" if bad else "")
            + ("" if right else "; frtools' verdict is WRONG (see truth.json)"),
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| ranks | dumps | entries/rank | frtools analyze: wall (CPU) | verdict | frtools peak RSS: largest process / tree | torchfrtrace: wall (CPU) | torchfrtrace peak RSS | speedup: wall (CPU) |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        trss = f"{r['torch_max_rss_mb']:.0f} MB" if r["torch_max_rss_mb"] else "-"
        lines.append(
            f"| {r['ranks']:,} | {r['format']} | {r['entries_per_rank']:,} "
            f"| {r['frtools_time']} ({r['frtools_cpu_s']:.0f} s), {r['frtools_runs']} runs "
            f"| {'right' if r['verdict_right'] else 'WRONG'} "
            f"| {r['frtools_max_rss_mb']:.0f} MB / {r['frtools_tree_rss_mb']:.0f} MB "
            f"| {r['torch_time']} ({r['torch_cpu_s'] or 0:.0f} s), {r['torch_runs']} runs | {trss} "
            f"| {r['speedup']} ({r['cpu_speedup']}) |"
        )
    return "\n".join(lines)


def profile(args: argparse.Namespace) -> None:
    """Where ``frtools analyze``'s time goes: reading vs diagnosis, and the hottest calls."""
    import cProfile
    import pstats

    from frtools.analyze.diagnose import diagnose
    from frtools.analyze.readers import load_trace

    d = make_dumps(Path(args.dir), args.profile, args.entries, "torch", args.tp, args.pp)
    t0 = time.perf_counter()
    trace = load_trace(d)
    t1 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    verdict = diagnose(trace)
    prof.disable()
    t2 = time.perf_counter()
    print(
        f"load_trace: {t1 - t0:.1f} s ({trace.entries.num_rows:,} entries); diagnose: {t2 - t1:.1f} s -> {verdict.kind}"
    )
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    t3 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    load_trace(d, workers=1)
    prof.disable()
    print(f"load_trace in one process: {time.perf_counter() - t3:.1f} s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ranks", default="256,1024,4096", type=lambda s: [int(x) for x in s.split(",") if x]
    )
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument(
        "--snapshot-ranks",
        default=[],
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="also time frtools on frtools snapshots of these sizes (e.g. 16384)",
    )
    ap.add_argument("--snapshot-dir", default="/tmp/frtools-scale", help="where snapshots go")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the simulated job")
    ap.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel size (torchfrtrace gives "
        "up after 10 mismatches on a pipeline group, so 1 makes it do the full work)",
    )
    ap.add_argument("--runs", type=int, default=3, help="frtools runs per size (median)")
    ap.add_argument("--torch-runs", type=int, default=3)
    ap.add_argument("--limit", type=float, default=600, help="frtools time limit per run (s)")
    ap.add_argument("--torch-limit", type=float, default=600, help="torchfrtrace time limit (s)")
    ap.add_argument("--no-torch", action="store_true", help="skip torchfrtrace")
    ap.add_argument(
        "--dir",
        default="/dev/shm/frtools-scale" if os.path.isdir("/dev/shm") else "/tmp/frtools-scale",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated dumps")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument(
        "--profile", type=int, metavar="RANKS", help="profile frtools at this size instead"
    )
    args = ap.parse_args(argv)
    if args.profile:
        profile(args)
        return 0
    print(f"machine: {os.cpu_count()} CPUs; dumps under {args.dir}", flush=True)
    rows = bench(args)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
