"""How long ``frtools analyze`` of a small folder takes, and which imports the time goes to.

    python benchmarks/bench_startup.py [--path sample_dumps/healthy] [--runs 10] [--json out.json]

Wall time of the whole command (a fresh interpreter each run, as a user runs it), median of
``--runs``, beside the floors no change to frtools can go under: the interpreter alone and
importing numpy, pyarrow and pandas alone (the diagnosis is written on pandas DataFrames,
the Trace on pyarrow tables). Then ``python -X importtime`` of the same command (median of
3 runs): the self time per top-level package, and frtools' own modules by cumulative time.
Prints markdown tables (docs/benchmarks.md "Start-up"), and the load average: on a machine
that others load, every figure grows with it.

Bytecode: where ``PYTHONDONTWRITEBYTECODE`` is set (this project's shells set it) an editable
install compiles every frtools module on every run (~0.2 s); a pip install has its bytecode
compiled. The figures are taken both ways: "cached" runs with a bytecode cache of their own
(``PYTHONPYCACHEPREFIX``, a temporary folder, warmed once), so the tree is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 0.25
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def wall(argv: list[str], runs: int, env: dict[str, str] | None = None) -> float:
    """Median wall seconds of running ``argv`` ``runs`` times (output discarded)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def importtime(argv: list[str], env: dict[str, str]) -> list[tuple[int, int, int, str]]:
    """``-X importtime`` rows of one run: (self µs, cumulative µs, depth, module)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    rows = []
    for line in out.stderr.splitlines():
        if m := _LINE.match(line):
            depth = len(m.group(3)) // 2
            rows.append((int(m.group(1)), int(m.group(2)), depth, m.group(4)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=str(ROOT / "sample_dumps" / "healthy"))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    py = sys.executable
    cmd = ["-m", "frtools", "analyze", args.path]
    cache = tempfile.TemporaryDirectory(prefix="frtools-pycache-")
    cached = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cached["PYTHONPYCACHEPREFIX"] = cache.name
    as_is = "cached" if "PYTHONDONTWRITEBYTECODE" not in os.environ else "compiled every run"
    for warm in ([py, *cmd], [py, "-c", "import pandas, pyarrow.compute"]):
        subprocess.run(warm, env=cached, capture_output=True, check=False)
    name = Path(args.path).name
    load0 = os.getloadavg()[0]
    rows = {
        "python -c pass (the interpreter)": wall([py, "-c", "pass"], args.runs, cached),
        "python -c 'import numpy'": wall([py, "-c", "import numpy"], args.runs, cached),
        "python -c 'import pyarrow'": wall([py, "-c", "import pyarrow"], args.runs, cached),
        "python -c 'import pandas'": wall([py, "-c", "import pandas"], args.runs, cached),
        "python -c 'import pandas, pyarrow.compute'": wall(
            [py, "-c", "import pandas, pyarrow.compute"], args.runs, cached
        ),
        f"frtools analyze {name} (terminal, bytecode cached)": wall([py, *cmd], args.runs, cached),
        f"frtools analyze {name} --format json (bytecode cached)": wall(
            [py, *cmd, "--format", "json"], args.runs, cached
        ),
        f"frtools analyze {name} (terminal, this shell: {as_is})": wall([py, *cmd], args.runs),
    }
    runs = [importtime(cmd, cached) for _ in range(3)]
    packages: list[Counter[str]] = []
    for run in runs:
        c: Counter[str] = Counter()
        for self_us, _, _, name in run:
            c[name.split(".")[0]] += self_us
        packages.append(c)
    names = set().union(*packages)
    per_package = {n: statistics.median(c[n] for c in packages) / 1000 for n in names}
    ours: dict[str, list[float]] = {}
    for run in runs:
        for _, cum, depth, name in run:
            if name.startswith("frtools") and depth <= 1:
                ours.setdefault(name, []).append(cum / 1000)
    frtools_cum = {n: statistics.median(v) for n, v in ours.items()}
    load1 = os.getloadavg()[0]

    print(f"load average (1 min): {load0:.1f} before, {load1:.1f} after; {os.cpu_count()} CPUs")
    print(f"\n| command | median of {args.runs} (s) |\n|---|---:|")
    for k, v in rows.items():
        print(f"| `{k}` | {v:.3f} |")
    print(f"\ntarget for frtools analyze of a small folder: {TARGET_S} s")
    print("\n| package | import self time (ms, -X importtime, cached, median of 3) |\n|---|---:|")
    total = sum(per_package.values())
    for n, v in sorted(per_package.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {n} | {v:.1f} |")
    print(f"| (all {len(per_package)} packages) | {total:.1f} |")
    print("\n| frtools module (top two levels) | cumulative import (ms) |\n|---|---:|")
    for n, v in sorted(frtools_cum.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {n} | {v:.1f} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "load": [load0, load1],
                    "wall_s": rows,
                    "import_ms_by_package": per_package,
                    "frtools_import_ms": frtools_cum,
                },
                indent=1,
            )
        )
    cache.cleanup()


if __name__ == "__main__":
    main()
