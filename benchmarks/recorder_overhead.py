"""What recording costs per c10d op: no recorder vs PyTorch's Flight Recorder vs frtools,
on every torch given, in one table.

    python benchmarks/recorder_overhead.py [--python /work/venv215/bin/python ...]
        [--rounds 30] [--ops 200] [--json out.json]

Each interpreter (this one, then every ``--python``; each with its own torch) is measured
twice:

* **the job**: two Gloo ranks on this machine. Each worker process creates identical groups
  over the same ranks: one before ``frtools.recorder.enable()`` (plain) and others after
  (recorded), and times them in alternating blocks, so machine noise hits all alike.
  PyTorch's recorder on Gloo is Gloo's own Flight Recorder, **on by default** (a buffer of
  2000 unless ``TORCH_FR_BUFFER_SIZE`` says otherwise), process-wide: "no recording" must
  switch it off. On 2.15 with the C++ hook body built, its ``_flight_recorder`` seam switches
  Gloo's recorder per block, so PyTorch's recorder is timed in the same job: off for the plain
  and the frtools groups, on (as PyTorch runs it) for its own. Otherwise the job runs twice:
  with ``TORCH_FR_BUFFER_SIZE=0`` (no recording, and frtools) and with Gloo's default (PyTorch's
  recorder), and PyTorch's Δ is between jobs. Workloads: a 1-element
  ``all_reduce`` (the whole op, network round trip included), the issuing call alone of
  1-element async all-reduces (50 in flight, waited for outside the timed part: exactly what
  a recorder adds to the caller, without the round trip's noise), and a small DDP step
  (forward + backward, the reducer's all-reduces). Medians over blocks. On 2.15 a group with
  PyTorch's hook recorder (``FlightRecorderHook``) is timed in the same job too, as it runs on
  Gloo: it leaves the ops of a backend with its own recorder to that recorder, so it is the
  hooks' dispatch plus Gloo's recorder, on for its blocks.
* **in-process, the recording path alone**: one process on torch's fake backend
  (``FakeProcessGroup``: an op costs only its dispatch), timing the issuing call of async
  all-reduces on a plain group, a group recorded by frtools (the path this torch takes by
  default: hooks on 2.15, wrapping before; on 2.15 the wrapping path too) and, on 2.15, a
  group with PyTorch's own hook recorder (``FlightRecorderHook``, what records nccl2).

On 2.15 the hooks' body is the C++ one when it is built (``python -m
frtools.recorder.native_hooks build``; ``--build-native`` does it first), and then a group with
the Python hook body is timed beside it, in the job and in-process.
  Minimum thread time per call over many blocks: what the recording path costs when the
  machine leaves it alone — the robust figure on a loaded box.

Reported: the difference to no recording in microseconds per op (Δ), and ratios. On a
loaded machine trust the 'caller CPU' clock, the issue row and the in-process rows; the
whole-op rows carry several microseconds of noise.
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
    gloo_fr = _gloo_fr_switch()
    if not frtools.recorder.enable(dir=out_dir, stall_seconds=0):
        raise SystemExit("frtools could not be enabled")
    from frtools.recorder import capture

    if capture.capture_mode() == "hooks":  # enable() hooked the groups that exist: not those
        _unhook(plain, dist.group.WORLD)
    recorded = dist.new_group([0, 1])
    nostack = dist.new_group([0, 1])
    groups = {"plain": plain, "recorded": recorded, "nostack": nostack}
    recorder = capture.current_recorder()
    if capture.capture_mode() == "hooks" and recorder.native_body() is not None:
        groups["recorded_py"] = _python_hooked(dist.new_group([0, 1]), recorder)
    fr_hook = None
    if capture.capture_mode() == "hooks":  # PyTorch's hook recorder, in this same job
        from torch._C._distributed_c10d import FlightRecorderHook

        groups["fr_hook"] = dist.new_group([0, 1])
        _unhook(groups["fr_hook"])
        fr_hook = FlightRecorderHook.attach(groups["fr_hook"], [0, 1])  # noqa: F841 - kept
    if gloo_fr is not None:  # PyTorch's Gloo recorder, on for this group's blocks only
        groups["torch_fr"] = dist.new_group([0, 1])
        _unhook(groups["torch_fr"])

    def stacks_for(name: str) -> None:
        # exactly what FRTOOLS_STACKS=0 does, switched per block
        recorder.set_stacks(name != "nostack")
        if gloo_fr is not None:  # Gloo's own recorder as PyTorch runs it, or off
            gloo_fr("gloo", name in ("torch_fr", "fr_hook"))

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


def _gloo_fr_switch() -> object | None:
    """The C++ hook body's ``_flight_recorder(backend, on)`` seam where it is built and Gloo's
    own recorder is on (its default), else None."""
    try:
        from frtools.recorder import native_hooks

        module = native_hooks.load(build_if_missing=False)
        switch = getattr(module, "_flight_recorder", None)
        if switch is None or not switch("gloo"):
            return None
        return switch
    except Exception:
        return None


def _unhook(*groups: object) -> None:
    from frtools.recorder.capture import hooks

    for g in groups:
        g.unregister_pre_hook(hooks.HOOK_ID)  # type: ignore[attr-defined]
        g.unregister_post_hook(hooks.HOOK_ID)  # type: ignore[attr-defined]


def _python_hooked(g: object, recorder: object) -> object:
    """``g`` recorded by the Python hook body (the C++ one is attached by default)."""
    from frtools.recorder.capture import hooks

    _unhook(g)
    hooks._hooked.pop(g, None)
    hooks.attach(g, recorder, "gloo", native=False)
    return g


def inprocess(blocks: int, calls: int, out_dir: str) -> None:
    """The recording path alone, on torch's fake backend (one process): min thread time."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import frtools.recorder
    from frtools.recorder import capture

    store = FakeStore()
    dist.init_process_group("fake", store=store, rank=0, world_size=2)
    groups = {"plain": dist.new_group([0, 1])}
    fr_hook = None
    if hasattr(ProcessGroup, "register_pre_hook"):
        from torch._C._distributed_c10d import FlightRecorderHook

        groups["torch_fr"] = dist.new_group([0, 1])
        fr_hook = FlightRecorderHook.attach(groups["torch_fr"], [0, 1])  # noqa: F841 - kept
    if not frtools.recorder.enable(dir=out_dir, job_id="inprocess", stall_seconds=0):
        raise SystemExit("frtools could not be enabled")
    mode = capture.capture_mode()
    recorder = capture.current_recorder()
    if mode == "hooks":
        _unhook(dist.group.WORLD, *groups.values())
        groups["frtools"] = dist.new_group([0, 1])
        if recorder.native_body() is not None:
            groups["frtools_py"] = _python_hooked(dist.new_group([0, 1]), recorder)
    # the wrapping path: a RecordingProcessGroup over the fake backend (it wraps only gloo and
    # nccl groups itself), the same overrides a wrapped group runs
    fake = dist.group.WORLD._get_backend(torch.device("cpu"))
    wrapped = capture.RecordingProcessGroup(
        store, 0, 2, recorder, [("cpu", ProcessGroup.BackendType.CUSTOM, fake)], [0, 1], "fake"
    )
    wrapped.frtools_register("wrapped", "wrapped")
    groups["frtools_wrap" if mode == "hooks" else "frtools"] = wrapped
    t = torch.ones(1)

    def block(g: object) -> float:
        start = time.thread_time_ns()
        for _ in range(calls):
            dist.all_reduce(t, group=g, async_op=True)
        return (time.thread_time_ns() - start) / calls / 1000.0

    samples: dict[str, list[float]] = {name: [] for name in groups}
    for g in groups.values():  # warm up
        block(g)
    for r in range(blocks):
        for name in groups if r % 2 == 0 else reversed(groups):
            samples[name].append(block(groups[name]))
    info = {"torch": torch.__version__, "mode": mode, "native": "frtools_py" in groups}
    print("RESULT " + json.dumps({"min": {k: min(v) for k, v in samples.items()}, **info}))


def run_job(python: str, gloo_fr: bool, rounds: int, ops: int, steps: int, out_dir: str) -> dict:
    """One 2-rank job; ``gloo_fr``: Gloo's own recorder as PyTorch sets it (on, and switched
    per block where the seam is), else off for the whole job (``TORCH_FR_BUFFER_SIZE=0``)."""
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
            FRTOOLS_JOB_ID=f"bench-{'fr' if gloo_fr else 'nofr'}-{port}",
        )
        env.pop("FRTOOLS_RECORD", None)
        for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
            env.pop(name, None)
        if not gloo_fr:
            env["TORCH_FR_BUFFER_SIZE"] = "0"
        procs.append(
            subprocess.Popen(
                [python, __file__, "--worker", "--rounds", str(rounds), "--ops", str(ops)]
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


def run_inprocess(python: str, blocks: int, calls: int, out_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRTOOLS_", "TORCH_FR"))}
    env.update(OMP_NUM_THREADS="1", FRTOOLS_JOBWIDE="0")
    proc = subprocess.run(
        [python, __file__, "--inprocess", "--rounds", str(blocks), "--ops", str(calls)]
        + ["--out-dir", out_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"in-process benchmark failed:\n{proc.stderr[-3000:]}")


def torch_version(python: str) -> str:
    code = "import torch; print(torch.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def job_rows(python: str, rounds: int, ops: int, steps: int, out_dir: str) -> list[dict]:
    first = run_job(python, True, rounds, ops, steps, out_dir)
    med = {k: statistics.median(v) for k, v in first.items()}
    if any(k.endswith("/torch_fr") for k in first):  # PyTorch's recorder in the same job
        med_fr, fr_key, same_job = med, "torch_fr", True
    else:  # the first job recorded with Gloo's recorder throughout: a second one without
        med_fr, fr_key, same_job = med, "plain", False
        no_fr = run_job(python, False, rounds, ops, steps, out_dir)
        med = {k: statistics.median(v) for k, v in no_fr.items()}
    rows = []
    for kind, label in (
        ("allreduce", "all_reduce, 1 float [µs/op]"),
        ("issue", "issuing async all_reduce [µs/op]"),
        ("ddp", "DDP step fwd+bwd [µs/step]"),
    ):
        for clock in ("wall", "cpu"):
            base = med[f"{kind}/{clock}/plain"]
            torch_fr = med_fr[f"{kind}/{clock}/{fr_key}"]
            ours = med[f"{kind}/{clock}/recorded"]
            rows.append(
                {
                    "workload": label,
                    "clock": clock,
                    "none": base,
                    "torch_fr": torch_fr,
                    "frtools": ours,
                    "torch_fr_same_job": same_job,
                    "frtools_no_stacks": med[f"{kind}/{clock}/nostack"],
                    "frtools_py_overhead": (
                        med[f"{kind}/{clock}/recorded_py"] - base
                        if f"{kind}/{clock}/recorded_py" in med
                        else None
                    ),
                    "torch_fr_hook_overhead": (  # with Gloo's recorder on, as PyTorch runs it
                        med_fr[f"{kind}/{clock}/fr_hook"] - base
                        if f"{kind}/{clock}/fr_hook" in med_fr
                        else None
                    ),
                    "torch_fr_overhead": torch_fr - base,
                    "frtools_overhead": ours - base,
                    "torch_fr_ratio": torch_fr / base,
                    "frtools_ratio": ours / base,
                }
            )
    return rows


def inprocess_rows(result: dict) -> list[dict]:
    mins = result["min"]
    base = mins["plain"]
    row = {
        "workload": "recording path alone, fake backend [µs/op]",
        "clock": "min thread",
        "none": base,
        "torch_fr": mins.get("torch_fr"),
        "frtools": mins["frtools"],
        "frtools_no_stacks": None,
        "torch_fr_overhead": mins["torch_fr"] - base if "torch_fr" in mins else None,
        "frtools_overhead": mins["frtools"] - base,
        "frtools_ratio": mins["frtools"] / base,
        "capture": result["mode"] + (" (C++ body)" if result.get("native") else ""),
        "frtools_py_overhead": mins["frtools_py"] - base if "frtools_py" in mins else None,
        "torch_fr_hook_overhead": mins["torch_fr"] - base if "torch_fr" in mins else None,
    }
    rows = [row]
    if "frtools_wrap" in mins:
        rows.append(
            {
                **row,
                "workload": "  the same, FRTOOLS_CAPTURE=wrap [µs/op]",
                "frtools": mins["frtools_wrap"],
                "frtools_overhead": mins["frtools_wrap"] - base,
                "frtools_ratio": mins["frtools_wrap"] / base,
                "capture": "wrap",
                "frtools_py_overhead": None,
            }
        )
    return rows


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.1f}" if sign else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ops", type=int, default=200, help="all-reduces per timed block")
    parser.add_argument("--steps", type=int, default=20, help="DDP steps per timed block")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="PATH",
        help="another interpreter (another torch) to measure as well; repeatable",
    )
    parser.add_argument("--blocks", type=int, default=200, help="in-process timed blocks")
    parser.add_argument("--calls", type=int, default=500, help="in-process calls per block")
    parser.add_argument("--json", default=None, help="also write the medians here")
    parser.add_argument(
        "--build-native",
        action="store_true",
        help="build the C++ hook body for every torch >= 2.15 given first (~1 min each, once)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inprocess", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.ops, args.steps, args.out_dir)
        return
    if args.inprocess:
        inprocess(args.rounds, args.ops, args.out_dir)
        return

    rows = []
    if args.build_native:
        for python in [sys.executable, *args.python]:
            subprocess.run([python, "-m", "frtools.recorder.native_hooks", "build"])
    with tempfile.TemporaryDirectory(prefix="frtools-bench-") as out_dir:
        for python in [sys.executable, *args.python]:
            version = torch_version(python)
            measured = job_rows(python, args.rounds, args.ops, args.steps, out_dir)
            measured += inprocess_rows(run_inprocess(python, args.blocks, args.calls, out_dir))
            for r in measured:
                r["torch"] = version
                r.setdefault("capture", None)
            rows += measured
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Recorder overhead (medians over blocks; in-process: minimum)")
        cols = ("torch", "workload", "clock", "none", "PyTorch FR Δ", "FR hook Δ", "frtools Δ")
        for col in (*cols, "Python hooks Δ", "no-stacks Δ", "frtools/none"):
            left = col in ("torch", "workload", "clock")
            table.add_column(col, justify="left" if left else "right")
        for r in rows:
            clock = {"cpu": "caller CPU", "wall": "wall"}.get(r["clock"], r["clock"])
            no_stacks = r["frtools_no_stacks"]
            table.add_row(
                r["torch"],
                r["workload"],
                clock,
                _fmt(r["none"]),
                _fmt(r["torch_fr_overhead"], sign=True),
                _fmt(r.get("torch_fr_hook_overhead"), sign=True),
                _fmt(r["frtools_overhead"], sign=True),
                _fmt(r.get("frtools_py_overhead"), sign=True),
                _fmt(None if no_stacks is None else no_stacks - r["none"], sign=True),
                f"{r['frtools_ratio']:.2f}x",
            )
        Console(width=140).print(table)
    except ImportError:
        for r in rows:
            print(r)
    print(
        f"rounds={args.rounds} ops/block={args.ops} DDP steps/block={args.steps}; in-process "
        f"{args.blocks} blocks x {args.calls} calls. Δ = difference to no recording. 'caller "
        "CPU' = CPU time of the calling thread (robust to a loaded machine); 'wall' includes "
        "the network round trip. In the job, no recording (Gloo's own recorder off) and "
        "frtools share each job (alternating blocks); PyTorch FR is Gloo's own recorder (on by "
        "default), switched on for its blocks of the same job where the C++ hook body is "
        "built, else a second job. In-process, PyTorch FR is its hook recorder "
        "(FlightRecorderHook, as for nccl2; torch 2.15 only). FR hook: PyTorch's hook "
        "recorder on a group of the job (2.15), with Gloo's recorder it defers to. no-stacks: "
        "frtools with FRTOOLS_STACKS=0. Python hooks: on 2.15 with the C++ hook body built, "
        "a group recorded by the Python hook body, timed beside it."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
