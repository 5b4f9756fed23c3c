"""How long from a hang's onset to training resumed on the survivors (``frtools.recovery``).

Runs ``examples/recover_hang.py`` (torch >= 2.15) ``--runs`` times: ``--nproc`` Gloo ranks,
one hangs at step 5, ``FRTOOLS_STALL_SECONDS`` as given; under torchrun (its agent hosts the
store) or with the example's own launcher (``--launcher example``; also runs ``--fault
kill``). Per run: the survivors' "RECOVERED <s>" (onset -> first step finished on the
survivors) and, from the incident records, onset -> detected -> decided -> group rebuilt.

    python benchmarks/recovery_time.py --runs 3 --nproc 8 --stall-seconds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "recover_hang.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(args: argparse.Namespace, work: Path) -> dict:
    env = dict(os.environ, FRTOOLS_DIR=str(work), FRTOOLS_STALL_SECONDS=str(args.stall_seconds),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    fault = ["--fault", args.fault, "--fault-rank", str(args.fault_rank), "--fault-step", "5"]
    if args.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(_port()),
               str(EXAMPLE), *fault]  # fmt: skip
    else:
        cmd = [sys.executable, str(EXAMPLE), "--nproc", str(args.nproc), *fault]
    t = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t
    recovered = [float(line.split("RECOVERED")[1].split()[0])
                 for line in res.stdout.splitlines() if "RECOVERED" in line]  # fmt: skip
    records = [json.loads(p.read_text())
               for p in work.glob("*/dumps/recovery/*/rank_*.incident.json")]  # fmt: skip
    survivors = [r for r in records if r.get("new_rank") is not None]

    def med(key: str) -> float | None:
        values = [r["seconds"][key] for r in survivors if r["seconds"][key] is not None]
        return statistics.median(values) if values else None

    return {
        "exit_code": res.returncode,
        "wall_s": round(wall, 1),
        "survivors_recovered": len(recovered),
        "onset_to_resumed_s": max(recovered) if recovered else None,  # the last survivor
        "onset_to_detected_s": med("onset_to_detected"),
        "detected_to_decided_s": med("detected_to_decided"),
        "decided_to_rebuilt_s": med("decided_to_resumed"),
        "kind": sorted({r["kind"] for r in records}),
        "dropped": sorted({d for r in records for d in r["dropped"]}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--stall-seconds", type=float, default=5.0)
    p.add_argument("--fault", choices=["hang", "kill"], default="hang")
    p.add_argument("--fault-rank", type=int, default=3)
    p.add_argument("--launcher", choices=["torchrun", "example"], default="torchrun")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args()
    if args.fault == "kill" and args.launcher == "torchrun":
        p.error("under torchrun a killed worker stops the job: use --launcher example")
    runs = []
    for i in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="frtools-recovery-bench-"))
        try:
            run = one_run(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        runs.append(run)
        print(f"run {i + 1}: {json.dumps(run)}", flush=True)
    times = [r["onset_to_resumed_s"] for r in runs if r["onset_to_resumed_s"] is not None]
    ok = all(r["exit_code"] == 0 and r["survivors_recovered"] == args.nproc - 1 for r in runs)
    summary = {
        "nproc": args.nproc, "fault": args.fault, "stall_seconds": args.stall_seconds,
        "launcher": args.launcher, "runs": runs, "all_finished": ok,
        "median_onset_to_resumed_s": statistics.median(times) if times else None,
    }  # fmt: skip
    print(f"median onset -> resumed: {summary['median_onset_to_resumed_s']} s; "
          f"every run finished on the survivors: {ok}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
