"""What recording costs per c10d op: no recorder vs PyTorch's Flight Recorder vs frtools.

    python benchmarks/recorder_overhead.py [--rounds 30] [--ops 200] [--json out.json]

Two Gloo ranks on this machine. Each worker process creates two identical groups over the
same ranks: one before ``frtools.recorder.enable()`` (plain) and one after (recorded), and
times them in alternating blocks, so machine noise hits both alike. PyTorch's recorder is
process-wide (``TORCH_FR_BUFFER_SIZE`` is read once), so the job runs twice: without and with
``TORCH_FR_BUFFER_SIZE=2000``. Workloads: a 1-element ``all_reduce`` (the whole op, network
round trip included), the issuing call alone of 1-element async all-reduces (50 in flight,
waited for outside the timed part: exactly what a recorder adds to the caller, without the
round trip's noise), and a small DDP step (forward + backward, the reducer's all-reduces).
Reported: medians over blocks, the difference to no recording in microseconds per op, and
ratios. On a loaded machine trust the 'caller CPU' clock and the issue row; the whole-op
rows carry several microseconds of noise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rounds: int, ops: int, steps: int, out_dir: str, burst: int = 50) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import frtools.recorder

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = dist.new_group([0, 1])
    if not frtools.recorder.enable(dir=out_dir, stall_seconds=0):
        raise SystemExit("frtools could not be enabled")
    recorded = dist.new_group([0, 1])
    nostack = dist.new_group([0, 1])
    groups = {"plain": plain, "recorded": recorded, "nostack": nostack}
    from frtools.recorder import capture

    recorder = capture.current_recorder()

    def stacks_for(name: str) -> None:
        # exactly what FRTOOLS_STACKS=0 does, switched per block
        recorder.set_stacks(name != "nostack")

    torch.manual_seed(0)

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

    ddps = {
        name: nn.parallel.DistributedDataParallel(model(), process_group=g)
        for name, g in groups.items()
    }
    x = torch.randn(8, 64)
    t = torch.zeros(1)

    def allreduce_block(g: object) -> tuple[float, float]:
        dist.barrier(group=g)
        start, cpu = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(ops):
            dist.all_reduce(t, group=g)
        wall, cpu = time.perf_counter_ns() - start, time.thread_time_ns() - cpu
        return wall / ops / 1000.0, cpu / ops / 1000.0

    def issue_block(g: object) -> tuple[float, float]:
        # only the issuing call of async all-reduces (what a recorder adds to the caller):
        # bursts of `burst` in flight, waited for outside the timed part
        dist.barrier(group=g)
        wall = cpu = 0
        works = []
        for _ in range(ops // burst):
            start, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(burst):
                works.append(dist.all_reduce(t, group=g, async_op=True))
            wall += time.perf_counter_ns() - start
            cpu += time.thread_time_ns() - cpu0
            for w in works:
                w.wait()
            works.clear()
        n = (ops // burst) * burst
        return wall / n / 1000.0, cpu / n / 1000.0

    def ddp_block(ddp: nn.Module, g: object) -> tuple[float, float]:
        dist.barrier(group=g)
        start, cpu = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(steps):
            ddp(x).sum().backward()
        wall, cpu = time.perf_counter_ns() - start, time.thread_time_ns() - cpu
        return wall / steps / 1000.0, cpu / steps / 1000.0

    for name, g in groups.items():  # warm up every path
        stacks_for(name)
        allreduce_block(g)
        issue_block(g)
        ddp_block(ddps[name], g)
    samples: dict[str, list[float]] = {
        f"{kind}/{clock}/{name}": []
        for kind in ("allreduce", "issue", "ddp")
        for clock in ("wall", "cpu")
        for name in groups
    }

    def add(kind: str, name: str, values: tuple[float, float]) -> None:
        samples[f"{kind}/wall/{name}"].append(values[0])
        samples[f"{kind}/cpu/{name}"].append(values[1])

    for r in range(rounds):
        order = list(groups) if r % 2 == 0 else list(reversed(groups))
        for name in order:
            stacks_for(name)
            add("allreduce", name, allreduce_block(groups[name]))
        for name in order:
            stacks_for(name)
            add("issue", name, issue_block(groups[name]))
        for name in order:
            stacks_for(name)
            add("ddp", name, ddp_block(ddps[name], groups[name]))
    if rank == 0:
        print("RESULT " + json.dumps(samples), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_job(torch_fr: bool, rounds: int, ops: int, steps: int, out_dir: str) -> dict:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            FRTOOLS_JOB_ID=f"bench-{'fr' if torch_fr else 'nofr'}-{port}",
        )
        env.pop("FRTOOLS_RECORD", None)
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        if torch_fr:
            env["TORCH_FR_BUFFER_SIZE"] = "2000"
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--rounds", str(rounds), "--ops", str(ops)]
                + ["--steps", str(steps), "--out-dir", out_dir],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=900))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for line in outputs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"benchmark worker failed:\n{outputs[0][1][-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ops", type=int, default=200, help="all-reduces per timed block")
    parser.add_argument("--steps", type=int, default=20, help="DDP steps per timed block")
    parser.add_argument("--json", default=None, help="also write the medians here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.ops, args.steps, args.out_dir)
        return

    with tempfile.TemporaryDirectory(prefix="frtools-bench-") as out_dir:
        no_fr = run_job(False, args.rounds, args.ops, args.steps, out_dir)
        with_fr = run_job(True, args.rounds, args.ops, args.steps, out_dir)

    med = {k: statistics.median(v) for k, v in no_fr.items()}
    med_fr = {k: statistics.median(v) for k, v in with_fr.items()}
    rows = []
    for kind, label in (
        ("allreduce", "all_reduce, 1 float [µs/op]"),
        ("issue", "issuing async all_reduce [µs/op]"),
        ("ddp", "DDP step fwd+bwd [µs/step]"),
    ):
        for clock in ("wall", "cpu"):
            base = med[f"{kind}/{clock}/plain"]
            torch_fr = med_fr[f"{kind}/{clock}/plain"]
            ours = med[f"{kind}/{clock}/recorded"]
            rows.append(
                {
                    "workload": label,
                    "clock": clock,
                    "none": base,
                    "torch_fr": torch_fr,
                    "frtools": ours,
                    "torch_fr_plus_frtools": med_fr[f"{kind}/{clock}/recorded"],
                    "frtools_no_stacks": med[f"{kind}/{clock}/nostack"],
                    "torch_fr_overhead": torch_fr - base,
                    "frtools_overhead": ours - base,
                    "torch_fr_ratio": torch_fr / base,
                    "frtools_ratio": ours / base,
                }
            )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Recorder overhead (Gloo, 2 ranks, medians over blocks)")
        cols = ("workload", "clock", "none", "PyTorch FR", "frtools", "FR Δ", "frtools Δ")
        for col in (*cols, "no-stacks Δ"):
            table.add_column(col, justify="left" if col in ("workload", "clock") else "right")
        table.add_column("frtools/none", justify="right")
        for r in rows:
            table.add_row(
                r["workload"],
                "caller CPU" if r["clock"] == "cpu" else "wall",
                f"{r['none']:.1f}",
                f"{r['torch_fr']:.1f}",
                f"{r['frtools']:.1f}",
                f"{r['torch_fr_overhead']:+.1f}",
                f"{r['frtools_overhead']:+.1f}",
                f"{r['frtools_no_stacks'] - r['none']:+.1f}",
                f"{r['frtools_ratio']:.2f}x",
            )
        Console(width=110).print(table)
    except ImportError:
        for r in rows:
            print(r)
    print(
        f"rounds={args.rounds} ops/block={args.ops} DDP steps/block={args.steps}. "
        "Δ = difference to no recording. 'caller CPU' = CPU time of the calling thread "
        "(robust to a loaded machine); 'wall' includes the network round trip. "
        "No recording and frtools share each job (alternating blocks); PyTorch FR is a "
        "second job. no-stacks: frtools with FRTOOLS_STACKS=0."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
