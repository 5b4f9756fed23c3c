"""GPU check of the black box's CUDA-event watchdog (run by hand on a CUDA machine).

    python tests/gpu/check_blackbox_cuda.py

Real ``torch.cuda.Event`` handles around a matmul go to ``BlackBox.watch_cuda``; the native
watchdog (libcudart via dlopen, no GIL) must stamp scheduled -> started -> completed and the
GPU duration that ``cudaEventElapsedTime`` gives. ``check_cuda_events(directory)`` is the
reusable part: the NCCL check (recorder-capture) can call it; it raises AssertionError with
what went wrong and returns a one-line summary.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return predicate()


def check_cuda_events(directory: str | Path) -> str:
    """Events around a matmul, watched natively: states in order and the GPU duration."""
    import torch

    from frtools.formats.blackbox import read_snapshot
    from frtools.recorder.native import load_native

    assert torch.cuda.is_available(), "no CUDA device"
    native = load_native()
    device = torch.cuda.current_device()
    path = Path(directory) / "rank_0.frt"
    identity = {"rank": 0, "world_size": 1, "device": f"cuda:{device}", "backend": "nccl"}
    box = native.BlackBox(str(path), 64, 1 << 16, json.dumps(identity))
    box.start_watchdog(2, 0.0, 0)
    try:
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        op = box.intern("nccl:all_reduce")
        rid = box.record(-1, op, 1, 0, -1, False, 0, 0, 0, 0, 0)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(5e8))  # keep the stream busy: the start event stays pending
        start.record()
        for _ in range(50):
            a = a @ a
            a = a / a.norm()
        end.record()
        box.watch_cuda(rid, start.cuda_event, end.cuda_event)
        assert box.state(rid) == 1, f"state {box.state(rid)} before the GPU reached the op"

        seen: list[int] = []

        def completed() -> bool:
            state = box.state(rid)
            if not seen or seen[-1] != state:
                seen.append(state)
            return state == 3

        assert _wait(completed, timeout=30), f"never completed; states seen {seen}"
        assert 2 in seen or seen == [1, 3], f"states out of order: {seen}"
        end.synchronize()
        expected = start.elapsed_time(end)
        row = read_snapshot(path).slots[0]
        duration = float(row["duration_ms"])
        assert abs(duration - expected) < 1e-3 * max(1.0, expected), (duration, expected)
        assert row["flags"] & 1, "duration not marked as coming from CUDA events"
        assert row["time_started_ns"] <= row["time_completed_ns"]
        assert _wait(lambda: box.drain_cuda_done() == [rid], timeout=2)
        assert box.cuda_pending() == 0
        return f"CUDA events OK: states {seen}, GPU duration {duration:.3f} ms"
    finally:
        box.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        try:
            print(check_cuda_events(d))
        except AssertionError as e:
            print(f"FAILED: {e}")
            sys.exit(1)
