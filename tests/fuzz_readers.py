"""Fuzz the readers: mutated real dumps must be read or refused, never crash, hang or blow up.

Seeds are real material: PyTorch's own pickles from ``sample_dumps/`` (torch 2.13, Gloo) and
of ``../shared/real-gpu`` (NCCL on H100s) where present,
the same dumps as JSON and gzip'd, and frtools black boxes (plain and gzip'd). Hypothesis
mutates them — byte flips, overwritten integers at boundary values, inserted, deleted and
duplicated ranges (a duplicated range repeats memo references and structure), truncation;
gzip'd seeds are mutated inside and recompressed, so mutations get past the CRC — and each
mutant goes through ``read_file`` (sniffing, every reader, the native parser first). It must

* come back as ``ok`` or as a documented refusal: an ``error``/``skipped`` reason that is
  neither a reader bug ("<format> reader failed: …") nor running out of memory;
* for a pickle the native parser reads, give exactly what the Python unpickler gives;
* take at most a few seconds; the whole run is capped at 1 GiB of address space.

CI runs it for ~40 s (tests/test_fuzz_readers.py); the long run, on demand::

    python tests/fuzz_readers.py --seconds 3600            # an hour, 1 GiB cap
    python tests/fuzz_readers.py --seconds 600 --save /tmp/fuzz-failures

A failing input is written to ``--save`` (default: a temporary folder, printed) with the
assertion, and the run exits 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import resource
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REAL_GPU = REPO.parent / "shared" / "real-gpu" / "nvrx"
PER_INPUT_SECONDS = 5.0
MEMORY_CAP = 1 << 30


@dataclass(frozen=True)
class Seed:
    name: str  # the file name it is read under (the suffix picks nothing: content does)
    data: bytes  # the content, before gzip when ``gzipped``
    gzipped: bool = False


def seeds() -> list[Seed]:
    from hostile import snapshot  # tests/hostile.py

    out: list[Seed] = []
    pickles = sorted((REPO / "sample_dumps").glob("*/rank_*.pkl"))
    for path in pickles[::3]:
        out.append(Seed(f"{path.parent.name}_rank_{path.stem[5:]}.pkl", path.read_bytes()))
    # real NCCL dumps (H100 Megatron MoE, pickle format 2.9: pg_config, pg_status, frames,
    # CUDA timings) where this checkout sits beside them
    for path in sorted(REAL_GPU.glob("*/_dump_1[24]")):
        out.append(Seed(f"{path.parent.name}{path.name}.pkl", path.read_bytes()))
    with open(REPO / "sample_dumps" / "missing" / "rank_2.pkl", "rb") as f:
        dump = pickle.load(f)
    text = json.dumps(dump).encode()
    out.append(Seed("rank_2.json", text))
    out.append(Seed("rank_2.json.gz", text, gzipped=True))
    out.append(Seed("rank_2.pkl.gz", pickle.dumps(dump, protocol=2), gzipped=True))
    out.append(Seed("rank_2.p4.pkl", pickle.dumps(dump, protocol=4)))  # FRAME, MEMOIZE
    box = snapshot(
        identity={"rank": 1, "world_size": 4, "backend": "gloo", "host": "node0"},
        groups=[("0", "default_pg", "0-3"), ("1", "tp", "0-1"), ("2", "dp", "1,3")],
        entries=[
            {"op": "gloo:all_reduce", "input_sizes": "[[4,2]]", "input_dtypes": "Float",
             "stack": "/job/train.py:7 in step\n/job/train.py:70 in main", "pg": i % 3}
            for i in range(6)
        ] + [{"op": "gloo:broadcast", "state": 1, "stack": "/job/train.py:9 in step"}],
        capacity=16,
    )  # fmt: skip
    out.append(Seed("rank_1.frt", box))
    out.append(Seed("rank_1.frt.gz", box, gzipped=True))
    return out


BOUNDARY = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1]


@st.composite
def mutants(draw: st.DrawFn, pool: list[Seed]) -> tuple[Seed, bytes]:
    seed = draw(st.sampled_from(pool))
    data = bytearray(seed.data)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "int", "insert", "delete", "dup", "cut"]))
        n = len(data)
        if n == 0:
            break
        at = draw(st.integers(0, n - 1))
        if kind == "flip":
            data[at] = draw(st.integers(0, 255))
        elif kind == "int":
            width = draw(st.sampled_from([1, 2, 4, 8]))
            value = draw(st.sampled_from(BOUNDARY)) % (1 << (8 * width))
            data[at : at + width] = value.to_bytes(width, "little")
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "dup":
            size = draw(st.integers(1, 256))
            data[at:at] = data[at : at + size] * draw(st.integers(1, 64))
        else:
            del data[at:]
    out = bytes(data)
    return seed, gzip.compress(out, 1) if seed.gzipped else out


def check(seed: Seed, data: bytes, workdir: Path) -> None:
    # imported here, once the address-space cap is set (their libraries reserve memory)
    from frtools.analyze.readers import torch_pickle
    from frtools.analyze.readers.base import DumpError
    from frtools.analyze.readers.loader import read_file

    path = workdir / seed.name
    path.write_bytes(data)
    start = time.monotonic()
    result = read_file(path)
    took = time.monotonic() - start
    reason = result.input.reason
    assert took < PER_INPUT_SECONDS, f"{took:.1f} s to read"
    assert " reader failed: " not in reason, reason  # a reader bug, caught by the loader
    assert "out of memory" not in reason, reason
    assert result.input.status in ("ok", "error", "skipped"), result.input
    if result.input.status != "ok":
        assert reason, result.input
    if torch_pickle.native_available() and seed.name.endswith((".pkl", ".pkl.gz")):
        try:
            raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        except (OSError, EOFError, ValueError):
            return
        try:
            native = torch_pickle.read_native(raw, path) if raw else None
        except DumpError as e:
            native = f"DumpError: {e}"
        if native is None:
            return
        try:
            python = torch_pickle.read_python(raw, path)
        except DumpError as e:
            python = f"DumpError: {e}"
        if isinstance(native, str) or isinstance(python, str):
            assert native == python, (native, python)
            return
        assert native.entries.to_pylist() == python.entries.to_pylist()
        assert native.rank_info == python.rank_info
        assert native.notes == python.notes


def run(seconds: float, save: Path, batch: int = 40) -> int:
    with tempfile.TemporaryDirectory(prefix="frtools-fuzz-") as tmp:
        return _run(seconds, save, batch, Path(tmp))


def _run(seconds: float, save: Path, batch: int, workdir: Path) -> int:
    pool = seeds()
    failures: list[str] = []

    @settings(
        max_examples=batch,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutants(pool))
    def one(case: tuple[Seed, bytes]) -> None:
        seed, data = case
        try:
            check(seed, data, workdir)
        except AssertionError:
            failures.append(seed.name)
            save.mkdir(parents=True, exist_ok=True)
            stem = f"{len(failures):03d}-{seed.name}"
            (save / stem).write_bytes(data)
            (save / f"{stem}.txt").write_text(traceback.format_exc())
            raise

    end = time.monotonic() + seconds
    runs = 0
    while time.monotonic() < end:
        try:
            one()
        except AssertionError:
            print(f"fuzz: failure saved under {save}", file=sys.stderr)
            traceback.print_exc()
            return 1
        runs += batch
    print(f"fuzz: {runs} mutants of {len(pool)} seeds read or refused in {seconds:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long to fuzz")
    ap.add_argument("--save", type=Path, default=None, help="where failing inputs go")
    ap.add_argument("--memory", type=int, default=MEMORY_CAP, help="address-space cap (bytes)")
    args = ap.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (args.memory, args.memory))
    save = args.save or Path(tempfile.gettempdir()) / f"frtools-fuzz-failures-{os.getpid()}"
    return run(args.seconds, save)


if __name__ == "__main__":
    sys.exit(main())
