"""The analysis process's allocator settings (``frtools.analyze.memory``), each checked in
a fresh interpreter: they are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import pyarrow as pa
from frtools.analyze.memory import arrow_from_the_heap, keep_freed_memory
kept = keep_freed_memory()
arrow_from_the_heap()
table = pa.table({"x": pa.chunked_array([[1, 2], [3]])}).combine_chunks()
print(kept, pa.default_memory_pool().backend_name, table.column("x").to_pylist())
"""


def _probe(pool: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if pool is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split(maxsplit=2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_arrow_buffers_come_from_the_kept_heap() -> None:
    """Arrow's default pool maps fresh memory for each large buffer: the alignment takes
    them from glibc, whose freed memory it keeps."""
    kept, backend, values = _probe(None)
    assert kept == "True"
    assert backend == "system"
    assert values.strip() == "[1, 2, 3]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_pool_the_user_chose_is_kept() -> None:
    import pyarrow as pa

    try:
        pa.mimalloc_memory_pool()
    except NotImplementedError:
        pytest.skip("this pyarrow is built without mimalloc")
    kept, backend, _ = _probe("mimalloc")
    assert kept == "True"
    assert backend == "mimalloc"
