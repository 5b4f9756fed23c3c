"""Property: whatever the layout, for one injected fault the verdict blames exactly the
injected rank, and a healthy job blames nobody.

Small simulated jobs (8-32 ranks, tp/cp/ep/pp/dp drawn, ring buffers that wrap) are
written by ``frtools.synth`` and diagnosed as a user would (``load_trace`` + ``diagnose``).
A failing example prints the ``frtools synth`` command that reproduces it.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.synth import FAULTS, ModelShape, synthesize


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    n = draw(st.sampled_from([8, 16, 32]))
    left = n
    dims = {}
    for axis, choices in (("tp", [1, 2, 4]), ("pp", [1, 2]), ("cp", [1, 2]), ("ep", [1, 2])):
        dims[axis] = draw(st.sampled_from([c for c in choices if left % c == 0]))
        left //= dims[axis]
    return {
        "world_size": n,
        "dp": left,
        **dims,
        "seed": draw(st.integers(0, 2**20)),
        "buffer_size": draw(st.sampled_from([60, 150])),
        "shape": ModelShape(layers=1, microbatches=draw(st.integers(1, 2))),
    }


def _command(fault: str, job: dict) -> str:
    return shlex.join(
        [
            "frtools", "synth", "-o", "/tmp/repro", "-n", str(job["world_size"]),
            "--tp", str(job["tp"]), "--cp", str(job["cp"]), "--ep", str(job["ep"]),
            "--dp", str(job["dp"]), "--pp", str(job["pp"]), "--fault", fault,
            "--seed", str(job["seed"]), "--buffer-size", str(job["buffer_size"]),
            "--layers", "1", "--microbatches", str(job["shape"].microbatches),
        ]
    )  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", FAULTS)
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the repro command is enough
    suppress_health_check=[HealthCheck.too_slow],
)
@given(job=jobs())
def test_verdict_blames_exactly_the_injected_rank(fault: str, job: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="frtools-prop-") as tmp:
        truth = synthesize(Path(tmp), fault=fault, workers=1, **job).truth
        verdict = diagnose(load_trace(tmp))
    found = sorted(g.rank for g in verdict.guilty)
    repro = _command(fault, job)
    assert found == truth["guilty"], f"blamed {found}, injected {truth['guilty']}: {repro}"
    if fault == "healthy":
        assert verdict.kind == "healthy", f"healthy job called {verdict.kind}: {repro}"
