"""The C++ process-group hook body records what the Python body records, on real Gloo jobs.

One 2-rank job runs twice, once per body (``FRTOOLS_NATIVE_HOOKS=0`` / ``1``): collectives of
every argument shape, send/recv, batched P2P, a coalesced block, an async op, then rank 1
leaves and rank 0's next all-reduce fails. Every record of every rank must be the same but
for times and thread ids: op names, sequence ids, peers, shapes, dtypes, states, call sites,
the failed op's error. The body is built once per session (``native_hooks_module``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from frtools.analyze.readers.loader import load_trace

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed.ProcessGroup, "register_pre_hook"),
    reason="this torch has no process-group hooks (torch < 2.15)",
)

JOB = """
import os, sys, time, datetime, torch, torch.distributed as dist, frtools.recorder as fr
out = sys.argv[1]
assert fr.enable(dir=out, job_id="j", stall_seconds=0)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
pair = dist.new_group([0, 1], group_desc="pair")
from frtools.recorder import capture
print("native" if capture.current_recorder()._native else "python", flush=True)


def collectives():
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2, dtype=torch.float64), 0, group=pair)
    dist.all_gather([torch.zeros(3) for _ in range(2)], torch.ones(3))
    dist.all_gather_into_tensor(torch.zeros(4), torch.ones(2))
    dist.reduce(torch.ones(2, 2, dtype=torch.int32), 0, group=pair)
    dist.all_to_all_single(torch.zeros(2), torch.ones(2))
    dist.gather(torch.ones(1), [torch.zeros(1), torch.zeros(1)] if rank == 0 else None, 0)
    dist.scatter(torch.zeros(2), [torch.ones(2), torch.ones(2)] if rank == 0 else None, 0)
    dist.all_reduce(torch.ones(1), async_op=True).wait()
    dist.barrier()


def p2p():
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(5), 1)
        dist.recv(torch.zeros(6), 1)
    else:
        dist.recv(torch.zeros(5), 0)
        dist.send(torch.ones(6), 0)
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer, group=pair),
           dist.P2POp(dist.irecv, torch.zeros(2), peer, group=pair)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def coalesced():
    with dist._coalescing_manager(group=pair, async_ops=True) as cm:
        dist.all_reduce(torch.ones(2), group=pair)
        dist.all_reduce(torch.ones(3), group=pair)
    cm.wait()


collectives()
p2p()
coalesced()
dist.barrier()
if rank == 1:
    time.sleep(0.5)
    os._exit(0)  # leaves: rank 0's next op fails
time.sleep(1.0)
try:
    dist.all_reduce(torch.ones(7), async_op=True).wait()
except Exception as exc:
    print("failed:", type(exc).__name__, flush=True)
time.sleep(0.5)  # the poller sees the failure
capture.current_recorder().poll()
os._exit(0)
"""

SAME = [
    "rank", "op", "profiling_name", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id",
    "peer", "is_p2p", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "state",
    "call_site", "error",
]  # fmt: skip


def comparable(entries):
    """The columns both bodies must agree on, as text; an error's peer port (each job has
    its own) masked."""
    out = entries[SAME].astype(object).where(entries[SAME].notna(), None).astype(str)
    out["error"] = out["error"].str.replace(r"\]:\d+", "]:PORT", regex=True)
    return out


def run(tmp_path: Path, native: bool) -> tuple[object, list[str]]:
    from jobs import run_job

    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / ("native" if native else "python")
    env = {"FRTOOLS_NATIVE_HOOKS": "1" if native else "0", "FRTOOLS_POLL_MS": "10"}
    result = run_job(script, world_size=2, args=[str(out)], env=env, timeout=150)
    assert result.ranks[0].returncode == 0 and result.ranks[1].returncode == 0, result.output()
    entries = load_trace(out / "j").entries.to_pandas()
    entries = entries.sort_values(["rank", "record_id"]).reset_index(drop=True)
    return entries, [r.stdout.split() for r in result.ranks]


@pytest.mark.timeout(400)
def test_the_native_body_records_what_the_python_body_records_on_a_gloo_job(
    tmp_path: Path, native_hooks_module
) -> None:
    python, said_py = run(tmp_path, native=False)
    native, said_native = run(tmp_path, native=True)
    assert [s[0] for s in said_py] == ["python", "python"]
    assert [s[0] for s in said_native] == ["native", "native"]
    assert said_native[0][1:] == said_py[0][1:] and said_py[0][1] == "failed:"
    a, b = comparable(python), comparable(native)
    assert len(a) == len(b) and len(a) > 30
    assert a.to_dict("records") == b.to_dict("records")
    ops = set(native["op"])
    for op in ("all_reduce", "broadcast", "all_gather", "_all_gather_base", "reduce", "gather"):
        assert op in ops
    assert {"send", "recv", "scatter", "barrier", "all_to_all"} <= ops
    last = native[native["rank"] == 0].iloc[-1]
    assert last["input_sizes"] == "[[7]]" and last["state"] != "completed"
    assert isinstance(last["error"], str) and last["error"]
    coalesced = native["op"] == "allreduce_coalesced"  # issued from contextlib's __exit__
    assert native["call_site"].str.contains("job.py")[~coalesced].all() and coalesced.any()


@pytest.mark.timeout(120)
def test_build_cache_is_private_and_keyed_by_torch_and_source(native_hooks_module) -> None:
    from frtools.recorder import native_hooks

    folder = native_hooks.cache_dir()
    assert folder.name == native_hooks.module_name() == native_hooks_module.__name__
    assert folder.stat().st_mode & 0o777 == 0o700
    assert folder.stat().st_uid == os.geteuid()
    assert native_hooks.status().startswith("built: ")


def test_an_unusable_build_falls_back_to_the_python_hooks_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from frtools.recorder import native_hooks

    monkeypatch.setattr(native_hooks, "_module", None)
    monkeypatch.setattr(native_hooks, "_failure", None)
    monkeypatch.setattr(native_hooks, "_warned", False)
    monkeypatch.setenv("FRTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FRTOOLS_NATIVE_HOOKS", "1")

    def no_compiler(verbose: bool = False) -> Path:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(native_hooks, "build", no_compiler)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert native_hooks.load() is None
    assert native_hooks.load() is None  # said once, not tried again
    monkeypatch.setenv("FRTOOLS_NATIVE_HOOKS", "auto")
    monkeypatch.setattr(native_hooks, "_failure", None)
    assert native_hooks.load() is None  # auto: not built, not built now, nothing said
