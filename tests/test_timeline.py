"""``frtools timeline``: Chrome trace-event JSON for ui.perfetto.dev and chrome://tracing.

Perfetto's Python trace processor needs its native binary downloaded from the network
(``perfetto`` on PyPI ships none), so the file is checked here against the Trace Event
Format document itself: the JSON Object Format, the fields each phase requires, ``ts`` and
``dur`` in microseconds, integer ``pid``/``tid``, the reserved ``cname`` colours, and
slices of one track that nest (a viewer cannot draw partial overlaps on one track).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from trace_builder import STOP, megatron8, simulate, training

from frtools.analyze.align import align
from frtools.analyze.diagnose import diagnose
from frtools.analyze.reporters import trace_events

pytestmark = pytest.mark.timeout(300)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
JOB = megatron8()

# chrome://tracing's reserved colour names (catapult tracing/base/color_scheme.html)
RESERVED_CNAMES = {
    "thread_state_uninterruptible", "thread_state_iowait", "thread_state_running",
    "thread_state_runnable", "thread_state_sleeping", "thread_state_unknown",
    "background_memory_dump", "light_memory_dump", "detailed_memory_dump",
    "vsync_highlight_color", "generic_work", "good", "bad", "terrible", "black", "grey",
    "white", "yellow", "olive", "rail_response", "rail_animation", "rail_idle", "rail_load",
    "startup", "heap_dump_stack_frame", "heap_dump_object_type", "heap_dump_child_node_highlight",
    "cq_build_running", "cq_build_passed", "cq_build_failed", "cq_build_abandoned",
    "cq_build_attempt_runnig", "cq_build_attempt_passed", "cq_build_attempt_failed",
}  # fmt: skip
METADATA = {
    "process_name": "name",
    "process_labels": "labels",
    "process_sort_index": "sort_index",
    "thread_name": "name",
    "thread_sort_index": "sort_index",
}


def validate(doc: dict) -> dict[str, list[dict]]:
    """Check a document against the Trace Event Format; returns the events by phase."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    by_phase: dict[str, list[dict]] = defaultdict(list)
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["ph"], str), e
        assert type(e["pid"]) is int and type(e["tid"]) is int, e
        if "cname" in e:
            assert e["cname"] in RESERVED_CNAMES, e
        if "args" in e:
            assert isinstance(e["args"], dict), e
        ph = e["ph"]
        if ph == "M":
            assert e["name"] in METADATA and METADATA[e["name"]] in e["args"], e
        elif ph == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)), e
            assert e["dur"] >= 0, e
        elif ph in ("i", "I"):
            assert isinstance(e["ts"], (int, float)), e
            assert e.get("s", "t") in ("g", "p", "t"), e
        else:
            raise AssertionError(f"unexpected phase {ph!r}")
        by_phase[ph].append(e)
    # complete events of one track nest or follow each other, never partly overlap
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in by_phase["X"]:
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for key, spans in tracks.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1e-6:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, f"track {key}: partial overlap"
            stack.append(end)
    return by_phase


def _doc(trace, **kw) -> tuple[dict, object]:
    alignment = align(trace)
    verdict = diagnose(trace, alignment)
    buf = io.StringIO()
    trace_events.write(buf, verdict, trace, alignment, **kw)
    return json.loads(buf.getvalue()), verdict


def _stop5(r, s, ops):
    return [STOP] if (r, s) == (5, 1) else ops


def test_one_process_per_rank_one_track_per_group_named_and_sorted():
    doc, verdict = _doc(simulate(JOB, training(JOB, 2, _stop5)))
    ev = validate(doc)
    names = {e["pid"]: e["args"]["name"] for e in ev["M"] if e["name"] == "process_name"}
    assert sorted(names) == list(range(8))
    assert names[5] == "rank 5 · node1 · GUILTY" and names[0] == "rank 0 · node0 · waiting"
    order = {
        e["pid"]: e["args"]["sort_index"] for e in ev["M"] if e["name"] == "process_sort_index"
    }
    assert order == {r: r for r in range(8)}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in ev["M"] if e["name"] == "thread_name"
    }
    assert {name for (pid, _), name in threads.items() if pid == 5} == {
        "pg 0 (default_pg)",
        "pg tp2 (TENSOR_MODEL_PARALLEL_GROUP)",
        "pg dp1 (DATA_PARALLEL_GROUP)",
    }
    for e in ev["X"]:  # every slice sits on a named track of its process
        assert (e["pid"], e["tid"]) in threads


def test_slices_run_from_enqueue_to_completion_or_to_the_dump():
    trace = simulate(JOB, training(JOB, 2, _stop5), completion="nccl")
    # a minute after the last op: older than the 5 s an op may be in flight at a dump
    end = max(t for t in trace.entries.column("time_created_ns").to_pylist()) + 60_000_000_000
    for info in trace.ranks.values():
        info.dump_time_ns = end
    doc, verdict = _doc(trace)
    ev = validate(doc)
    origin = doc["otherData"]["time_origin_ns"]
    created = {
        (r, rec): (t, done)
        for r, rec, t, done in zip(
            trace.entries.column("rank").to_pylist(),
            trace.entries.column("record_id").to_pylist(),
            trace.entries.column("time_created_ns").to_pylist(),
            trace.entries.column("time_completed_ns").to_pylist(),
            strict=True,
        )
    }
    assert len(ev["X"]) == trace.entries.num_rows
    for e in ev["X"]:
        t, done = created[(e["pid"], e["args"]["record_id"])]
        assert e["ts"] == pytest.approx((t - origin) / 1e3, abs=1e-3)
        stop = done if done is not None else end
        assert e["dur"] == pytest.approx((stop - t) / 1e3, abs=1e-3)
        assert e["cname"] in ("good", "bad", "terrible")
        assert e["cname"] != "good" or done is not None
        assert "collective_seq_id" in e["args"] and e["args"]["call_site"].startswith("train.py:")
    hung = [e for e in ev["X"] if e["cname"] == "terrible"]
    assert {e["pid"] for e in hung} == {4}  # rank 4 waits for 5 in tp2 all_reduce #3
    assert all(e["args"]["verdict"].startswith("missing") for e in hung)
    instants = {e["name"].split(":")[0]: e for e in ev["i"]}
    assert set(instants) == {"hang", "verdict"}
    assert all(e["s"] == "g" for e in ev["i"])
    assert instants["verdict"]["ts"] == pytest.approx((end - origin) / 1e3, abs=1e-3)
    assert instants["verdict"]["args"]["kind"] == "missing"
    assert instants["hang"]["ts"] <= min(e["ts"] for e in hung) + 1e-3


def test_async_ops_that_overlap_go_to_another_track():
    trace = simulate(JOB, training(JOB, 2), completion="nccl")
    # make rank 0's first tensor-parallel op complete after its second one started
    table = trace.entries
    done = table.column("time_completed_ns").to_pylist()
    created = table.column("time_created_ns").to_pylist()
    ranks = table.column("rank").to_pylist()
    pgs = table.column("pg_name").to_pylist()
    first, second = [
        i for i, (r, g) in enumerate(zip(ranks, pgs, strict=True)) if r == 0 and g == "tp0"
    ][:2]
    done[first] = (created[second] + done[second]) // 2
    import pyarrow as pa

    idx = table.schema.get_field_index("time_completed_ns")
    trace.entries = table.set_column(idx, table.schema.field(idx), pa.array(done, pa.int64()))
    doc, _ = _doc(trace)
    ev = validate(doc)
    lanes = {e["tid"] for e in ev["X"] if e["pid"] == 0 and e["args"]["process_group"] == "tp0"}
    assert len(lanes) == 2
    names = [e["args"]["name"] for e in ev["M"] if e["name"] == "thread_name" and e["pid"] == 0]
    assert "pg tp0 (TENSOR_MODEL_PARALLEL_GROUP) (overlapping ops, lane 2)" in names


def test_last_and_ranks_select_what_is_written():
    doc, _ = _doc(simulate(JOB, training(JOB, 3, _stop5)), last=2, ranks=[4, 5])
    ev = validate(doc)
    assert {e["pid"] for e in ev["X"]} == {4, 5}
    assert all(sum(1 for e in ev["X"] if e["pid"] == r) == 2 for r in (4, 5))
    assert trace_events.default_last(8) == 100 and trace_events.default_last(4096) == 48


def _frtools(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args], capture_output=True, text=True, timeout=250
    )


def test_timeline_command_on_a_real_gloo_hang(tmp_path):
    out = tmp_path / "trace.json"
    p = _frtools("timeline", str(SAMPLES / "missing-stacks"), "-o", str(out), "--ranks", "0-1")
    assert p.returncode == 1, p.stderr
    assert "MISSING" in p.stderr and str(out) in p.stderr
    doc = json.loads(out.read_text())
    ev = validate(doc)
    assert {e["pid"] for e in ev["X"]} == {0, 1}
    # Gloo records no completion time: completed ops are drawn to the rank's next op
    assert any(e["args"].get("end", "").startswith("completion time not recorded") for e in ev["X"])
    bad = _frtools("timeline", str(SAMPLES / "missing"), "--ranks", "x", "-o", str(out))
    assert bad.returncode == 2 and bad.stderr.startswith("frtools timeline: error: --ranks")
