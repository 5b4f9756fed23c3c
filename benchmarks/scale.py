"""Time and memory of ``frtools analyze`` vs ``torchfrtrace`` on simulated dumps at scale.

For each world size (default 256, 1024, 4096 ranks, 2000 entries per rank, tp 8, one rank
missing from a tensor-parallel collective) the dumps are written once with
``frtools synth``; then each analyzer runs as a child process, ``--runs`` times, and the
median wall time, CPU time (user + system, children included: robust on a shared machine)
and peak memory are printed with the ratios. Peak memory is reported two
ways: the largest single process (``wait4`` rusage of the child and its waited-for
descendants) and the whole process tree (RSS summed over the tree, sampled every 50 ms),
since ``frtools analyze`` reads files in worker processes. Neither counts the readers' spool
files in /dev/shm that no process has touched (an analysis holds them until it exits), so a
third figure is the machine's: the peak rise of memory in use (MemTotal - MemAvailable,
sampled with the RSS; page cache is not counted, shared memory is): meaningful on an idle
machine only. torchfrtrace is stopped at
``--torch-limit`` seconds and shown as "> limit".

    python benchmarks/scale.py --ranks 256,1024,4096 --runs 3 --torch-limit 600
    python benchmarks/scale.py --profile 1024     # where frtools' time goes
    python benchmarks/scale.py --profile-folder DIR  # the same on any folder

Fleet scale (issue #14; docs/fleet.md): ``--fleet-ranks`` times the central step through
per-host summaries (``frtools synth --format summary`` writes the 8-rank host summaries
``frtools summarize`` would make, without ~600 GB of black boxes; then ``frtools analyze``
of that folder), with the summary sizes; ``--summarize-hosts`` times the per-host step on
real black boxes (``frtools summarize`` of each 8-rank host folder, as a command and in
process) and checks that the summaries give the boxes' verdict:

    python benchmarks/scale.py --ranks "" --fleet-ranks 131072 --summarize-hosts 16 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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
    used_mb: float = 0.0  # peak rise of the machine's memory in use (spool files included)
    over_memory: bool = False  # killed when its process tree passed ``max_gb``


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


def _in_use() -> int:
    """Bytes of memory in use on the machine (MemTotal - MemAvailable)."""
    info = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    return info.get("MemTotal", 0) - info.get("MemAvailable", 0)


def measure(
    argv: list[str], limit: float, env: dict[str, str] | None = None, max_gb: float | None = None
) -> Run:
    """Run ``argv`` to completion or ``limit`` seconds; its wall time and peak memory.
    ``max_gb``: the process tree is killed when its summed RSS passes that many GiB (a run
    that would take the machine's memory, and the benchmark with it, stops there)."""
    base = _in_use()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    peak = [0, 0]
    stop = threading.Event()

    over = threading.Event()
    cap = None if max_gb is None else max_gb * 2**30

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            peak[1] = max(peak[1], _in_use() - base)
            if cap is not None and peak[0] > cap and not over.is_set():
                over.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
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
        used_mb=peak[1] / 2**20,
        returncode=None if timed_out or over.is_set() else proc.returncode,
        timed_out=timed_out,
        over_memory=over.is_set(),
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
    if any(r.over_memory for r in runs):
        killed = max(r.wall_s for r in runs if r.over_memory)
        return f"killed at its memory cap after {killed:.1f} s"
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
            "frtools_used_mb": _median(fr, "used_mb"),
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
            f"{row['frtools_max_rss_mb']:.0f} MB max process / {row['frtools_tree_rss_mb']:.0f} MB tree"
            f" / {row['frtools_used_mb']:.0f} MB machine; "
            f"torchfrtrace {row['torch_time']} (CPU {row['torch_cpu_s'] or 0:.1f} s, "
            f"rc {row['torch_rc']}); speedup {row['speedup']} wall, {row['cpu_speedup']} CPU"
            + (f"; {len(bad)} frtools runs FAILED" if bad else "")
            + ("" if right else "; frtools' verdict is WRONG (see truth.json)"),
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def _same_verdict(a: Path, b: Path) -> bool:
    """Two JSON verdicts name the same fault: kind, guilty ranks, group, op and seq."""
    try:
        va, vb = (json.loads(p.read_text())["verdict"] for p in (a, b))
    except (OSError, ValueError, KeyError):
        return False

    def key(v: dict) -> tuple:
        pg = v.get("process_group") or {}
        guilty = sorted(g["rank"] for g in v["guilty"])
        return (v["kind"], guilty, pg.get("name"), v["op"], v["collective_seq_id"])

    return key(va) == key(vb)


def fleet(args: argparse.Namespace) -> list[dict]:
    """The central step of a fleet analysis: ``frtools analyze`` of one folder of host
    summaries (16,384 files at 131,072 ranks), per size."""
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.fleet_ranks:
        d = make_dumps(root, n, args.entries, "summary", args.tp, args.pp)
        sizes = sorted(p.stat().st_size for p in d.glob("*.summary"))
        verdict_path = root / f"verdict-summary-{n}.json"
        verdict_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "frtools", "analyze", str(d), "--format", "json"]
        argv += ["-o", str(verdict_path)]
        if args.workers:
            argv += ["--workers", str(args.workers)]
        runs = [measure(argv, args.limit) for _ in range(args.runs)]
        row = {
            "ranks": n,
            "hosts": len(sizes),
            "entries_per_rank": args.entries,
            "summary_kb_median": statistics.median(sizes) / 1024 if sizes else 0.0,
            "summary_kb_max": max(sizes, default=0) / 1024,
            "summaries_mb": sum(sizes) / 2**20,
            "central_time": _fmt_time(runs, args.limit),
            "central_s": _median(runs, "wall_s"),
            "central_cpu_s": _median(runs, "cpu_s"),
            "central_max_rss_mb": _median(runs, "max_rss_mb"),
            "central_tree_rss_mb": _median(runs, "tree_rss_mb"),
            "runs": len(runs),
            "failed": sum(r.returncode not in (0, 1) for r in runs),
            "verdict_right": _verdict_right(verdict_path, d / "truth.json"),
        }
        rows.append(row)
        print(
            f"  {n:,} ranks through {row['hosts']:,} host summaries "
            f"(median {row['summary_kb_median']:.1f} KB, max {row['summary_kb_max']:.1f} KB, "
            f"{row['summaries_mb']:.0f} MB in all): central step {row['central_time']} "
            f"(CPU {row['central_cpu_s']:.1f} s, median of {len(runs)}), "
            f"{row['central_max_rss_mb']:.0f} MB max process / "
            f"{row['central_tree_rss_mb']:.0f} MB tree; verdict "
            + ("right" if row["verdict_right"] else "WRONG (see truth.json)")
            + (f"; {row['failed']} runs FAILED" if row["failed"] else ""),
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def summarize_hosts(args: argparse.Namespace) -> dict:
    """The per-host step on real black boxes: a job of ``--summarize-hosts`` hosts x 8
    ranks written as frtools snapshots, one folder per host; ``frtools summarize`` of each
    (a command: what srun/pdsh or a Ray task runs; and ``summarize_path`` in this process,
    without the interpreter's start), then the verdict of the summaries against the
    boxes'."""
    from frtools.analyze.summarize import summarize_path

    hosts = args.summarize_hosts
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    boxes = make_dumps(root, hosts * 8, args.entries, "frtools", args.tp, args.pp)
    work = root / f"per-host-{hosts}"
    shutil.rmtree(work, ignore_errors=True)
    out = work / "summaries"
    out.mkdir(parents=True)
    folders = []
    for h in range(hosts):
        folder = work / f"host{h:05d}"
        folder.mkdir()
        for r in range(8 * h, 8 * h + 8):
            src = boxes / f"rank_{r}.frt"
            if src.exists():
                os.link(src, folder / src.name)
        folders.append(folder)
    command, in_process = [], []
    for folder in folders:
        argv = [sys.executable, "-m", "frtools", "summarize", str(folder), "-o", str(out)]
        run = measure(argv + ["--workers", "1"], args.limit)
        if run.returncode != 0:
            print(f"  frtools summarize {folder} FAILED (rc {run.returncode})")
        command.append(run)
        t0 = time.perf_counter()
        summarize_path(folder, workers=1)
        in_process.append(time.perf_counter() - t0)
    sizes = [p.stat().st_size for p in out.glob("*.summary")]
    box_bytes = sum(p.stat().st_size for p in boxes.glob("*.frt"))
    verdicts = {}
    for name, d in (("boxes", boxes), ("summaries", out)):
        verdicts[name] = work / f"verdict-{name}.json"
        argv = [sys.executable, "-m", "frtools", "analyze", str(d), "--format", "json"]
        subprocess.run(argv + ["-o", str(verdicts[name])], stdout=subprocess.DEVNULL)
    row = {
        "hosts": hosts,
        "ranks": hosts * 8,
        "entries_per_rank": args.entries,
        "command_s": _median(command, "wall_s"),
        "command_max_s": max(r.wall_s for r in command),
        "command_max_rss_mb": _median(command, "max_rss_mb"),
        "in_process_s": statistics.median(in_process),
        "in_process_max_s": max(in_process),
        "boxes_mb_per_host": box_bytes / hosts / 2**20,
        "summary_kb_median": statistics.median(sizes) / 1024 if sizes else 0.0,
        "summary_kb_max": max(sizes, default=0) / 1024,
        "same_verdict": _same_verdict(verdicts["boxes"], verdicts["summaries"]),
        "verdict_right": _verdict_right(verdicts["summaries"], boxes / "truth.json"),
    }
    print(
        f"  summarize per host ({hosts} hosts x 8 ranks x {args.entries:,} entries, "
        f"{row['boxes_mb_per_host']:.1f} MB of boxes a host): command {row['command_s']:.2f} s "
        f"median (max {row['command_max_s']:.2f} s, {row['command_max_rss_mb']:.0f} MB), "
        f"in process {row['in_process_s']:.2f} s (max {row['in_process_max_s']:.2f} s); "
        f"summary {row['summary_kb_median']:.1f} KB median, {row['summary_kb_max']:.1f} KB max; "
        f"summaries' verdict {'= boxes' if row['same_verdict'] else 'DIFFERS from the boxes'}",
        flush=True,
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(boxes, ignore_errors=True)
    return row


def fleet_table(rows: list[dict], per_host: dict | None) -> str:
    lines = []
    if rows:
        lines += [
            "| ranks (hosts x 8) | entries/rank | host summary: median / max | all summaries "
            "| central step: wall (CPU) | central peak RSS: largest process / tree | verdict |",
            "|---:|---:|---:|---:|---:|---:|---|",
        ]
    for r in rows:
        lines.append(
            f"| {r['ranks']:,} ({r['hosts']:,}) | {r['entries_per_rank']:,} "
            f"| {r['summary_kb_median']:.1f} KB / {r['summary_kb_max']:.1f} KB "
            f"| {r['summaries_mb']:.0f} MB "
            f"| {r['central_time']} ({r['central_cpu_s']:.0f} s), {r['runs']} runs "
            f"| {r['central_max_rss_mb'] / 1024:.2f} GB / {r['central_tree_rss_mb'] / 1024:.2f} GB "
            f"| {'right' if r['verdict_right'] else 'WRONG'} |"
        )
    if per_host:
        p = per_host
        lines += [
            *([""] if rows else []),
            "| per-host step | hosts x 8 ranks | boxes a host | `frtools summarize` (command) "
            "| in process | summary: median / max | summaries' verdict |",
            "|---|---:|---:|---:|---:|---:|---|",
            f"| {p['entries_per_rank']:,} entries/rank | {p['hosts']} x 8 "
            f"| {p['boxes_mb_per_host']:.1f} MB "
            f"| {p['command_s']:.2f} s median, {p['command_max_s']:.2f} s max "
            f"| {p['in_process_s']:.2f} s median, {p['in_process_max_s']:.2f} s max "
            f"| {p['summary_kb_median']:.1f} KB / {p['summary_kb_max']:.1f} KB "
            f"| {'same as the boxes' if p['same_verdict'] else 'DIFFERS'}"
            f"{'' if p['verdict_right'] else ' (WRONG)'} |",
        ]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| ranks | dumps | entries/rank | frtools analyze: wall (CPU) | verdict | frtools peak RSS: largest process / tree; machine's memory in use | torchfrtrace: wall (CPU) | torchfrtrace peak RSS | speedup: wall (CPU) |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        trss = f"{r['torch_max_rss_mb']:.0f} MB" if r["torch_max_rss_mb"] else "-"
        lines.append(
            f"| {r['ranks']:,} | {r['format']} | {r['entries_per_rank']:,} "
            f"| {r['frtools_time']} ({r['frtools_cpu_s']:.0f} s), {r['frtools_runs']} runs "
            f"| {'right' if r['verdict_right'] else 'WRONG'} "
            f"| {r['frtools_max_rss_mb']:.0f} MB / {r['frtools_tree_rss_mb']:.0f} MB; "
            f"{r['frtools_used_mb']:.0f} MB "
            f"| {r['torch_time']} ({r['torch_cpu_s'] or 0:.0f} s), {r['torch_runs']} runs | {trss} "
            f"| {r['speedup']} ({r['cpu_speedup']}) |"
        )
    return "\n".join(lines)


def _cpu() -> tuple[float, float, float, float]:
    """CPU seconds (user + system) of this process and of its reaped children (workers),
    then the system seconds of each: on a VM, system time is mostly memory touched for the
    first time (docs/benchmarks.md), not work."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, me.ru_stime, kids.ru_stime


def profile(args: argparse.Namespace) -> None:
    """Where ``frtools analyze``'s time goes: each stage's wall and CPU time (reading: the
    workers' and this process's), then the hottest calls of the diagnosis and of reading."""
    import cProfile
    import pstats

    from frtools.analyze.memory import keep_freed_memory, spare_the_collector
    from frtools.analyze.readers import load_trace

    d = (
        Path(args.profile_folder)
        if args.profile_folder
        else make_dumps(Path(args.dir), args.profile, args.entries, "torch", args.tp, args.pp)
    )
    keep_freed_memory()  # as frtools analyze does
    marks = [("start", time.perf_counter(), _cpu())]
    trace = load_trace(d)
    marks.append(("load_trace", time.perf_counter(), _cpu()))
    spare_the_collector()
    from frtools.analyze.align import align
    from frtools.analyze.diagnose import diagnose

    al = align(trace)
    marks.append(("align", time.perf_counter(), _cpu()))
    prof = cProfile.Profile()
    prof.enable()
    verdict = diagnose(trace, al)
    prof.disable()
    marks.append(("diagnose", time.perf_counter(), _cpu()))
    print(
        f"{trace.entries.num_rows:,} entries -> {verdict.kind}; load average {os.getloadavg()[0]:.1f}"
    )
    for (_, w0, c0), (name, w1, c1) in zip(marks[:-1], marks[1:], strict=True):
        me, kids, me_sys, kids_sys = (b - a for a, b in zip(c0, c1, strict=True))
        print(
            f"  {name:10s} wall {w1 - w0:6.2f} s  CPU {me:6.2f} s here (system {me_sys:5.2f}), "
            f"{kids:6.2f} s in worker processes (system {kids_sys:5.2f})"
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
    ap.add_argument(
        "--fleet-ranks",
        default=[],
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="time the central step through host summaries at these sizes (e.g. 131072)",
    )
    ap.add_argument(
        "--summarize-hosts",
        type=int,
        default=0,
        metavar="HOSTS",
        help="time frtools summarize per host on black boxes of this many 8-rank hosts",
    )
    ap.add_argument("--workers", type=int, help="--workers of the central frtools analyze")
    ap.add_argument("--keep", action="store_true", help="keep the generated dumps")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument(
        "--profile", type=int, metavar="RANKS", help="profile frtools at this size instead"
    )
    ap.add_argument(
        "--profile-folder",
        metavar="DIR",
        help="profile frtools on this folder instead (snapshots, partials, real dumps)",
    )
    args = ap.parse_args(argv)
    if args.profile or args.profile_folder:
        profile(args)
        return 0
    print(f"machine: {os.cpu_count()} CPUs; dumps under {args.dir}", flush=True)
    rows = bench(args) if args.ranks or args.snapshot_ranks else []
    fleet_rows = fleet(args) if args.fleet_ranks else []
    per_host = summarize_hosts(args) if args.summarize_hosts else None
    if rows:
        print()
        print(table(rows))
    if fleet_rows or per_host:
        print()
        print(fleet_table(fleet_rows, per_host))
    if args.json:
        doc = {"analyze": rows, "fleet": fleet_rows, "per_host": per_host}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
