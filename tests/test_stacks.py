"""Stacks: faulthandler text parsed, ranks grouped by where their main thread stands, and
the side files of a dump directory attached to the Trace."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from frtools.analyze.readers.side_files import (
    apply_manifest,
    attach_native_stacks,
    attach_stacks,
)
from frtools.analyze.reporters.stacks_text import stack_lines
from frtools.analyze.stacks import (
    MAX_NATIVE_FRAMES,
    NativeFrame,
    group_stacks,
    last_dump,
    main_thread_call_site,
    native_rank_stack,
    parse_dumps,
    stacks_summary,
    user_frames_first,
)
from frtools.model.trace import RankInfo, Trace, empty_entries

TORCH = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _dump(main_frames: list[tuple[str, int, str]], worker: bool = True) -> str:
    lines = []
    if worker:
        lines += [
            "Thread 0x00007f0000000002 (most recent call first):",
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait',
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap',
            "",
        ]
    lines.append("Thread 0x00007f0000000001 (most recent call first):")
    lines += [f'  File "{f}", line {n} in {name}' for f, n, name in main_frames]
    return "\n".join(lines) + "\n\n"


WAITING = [
    (TORCH, 3252, "all_reduce"),
    ("/job/train.py", 72, "train"),
    ("/job/train.py", 93, "main"),
]
STUCK = [
    ("/job/train.py", 46, "compute_forever"),
    ("/job/train.py", 65, "train"),
    ("/job/train.py", 93, "main"),
]


@pytest.mark.timeout(30)
def test_real_faulthandler_output_gives_the_main_thread_of_the_last_dump(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import faulthandler, sys, threading, time
            ev = threading.Event()
            t = threading.Thread(target=ev.wait, daemon=True); t.start()
            def stuck_here():
                faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
            faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
            stuck_here()
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    dumps = parse_dumps(out.stdout)
    assert len(dumps) == 2
    main = dumps[-1].main_thread
    assert main is not None and main.frames[0].name == "stuck_here"
    assert main.frames[-1].name == "<module>"
    assert len(dumps[-1].threads) == 2


@pytest.mark.timeout(10)
def test_fatal_error_dump_is_kept_with_its_reason():
    text = (
        _dump(WAITING) + "Fatal Python error: Segmentation fault\n\n" + _dump(STUCK, worker=False)
    )
    dump = last_dump(text)
    assert dump is not None and dump.fatal == "Segmentation fault"
    assert dump.main_thread.frames[0].name == "compute_forever"


@pytest.mark.timeout(10)
def test_outlier_rank_stands_alone_in_the_stack_groups():
    stacks = {r: _dump(WAITING) for r in (0, 1, 3, 4, 5, 6, 7)}
    stacks[2] = _dump(STUCK)
    groups = group_stacks(stacks)
    assert [g.ranks for g in groups] == [[0, 1, 3, 4, 5, 6, 7], [2]]
    assert [g.outlier for g in groups] == [False, True]
    assert groups[1].top == "/job/train.py:46 in compute_forever"
    assert groups[0].top == "/job/train.py:72 in train"  # the user's line, not torch's


@pytest.mark.timeout(10)
def test_even_split_marks_no_outlier():
    stacks = {0: _dump(WAITING), 1: _dump(WAITING), 2: _dump(STUCK), 3: _dump(STUCK)}
    assert not any(g.outlier for g in group_stacks(stacks))


@pytest.mark.timeout(10)
def test_call_site_comes_from_the_main_thread_not_a_helper_thread():
    assert main_thread_call_site(_dump(STUCK)) == "/job/train.py:46 in compute_forever"
    assert main_thread_call_site(_dump(WAITING)) == "/job/train.py:72 in train"
    assert main_thread_call_site("garbage") is None


@pytest.mark.timeout(10)
def test_user_frames_come_first_in_a_report():
    frames = last_dump(_dump(WAITING)).main_thread.frames
    ordered = user_frames_first(frames)
    assert [f.name for f in ordered] == ["train", "main", "all_reduce"]


def _trace(tmp_path, ranks=(0, 1, 2, 3)) -> Trace:
    return Trace(
        entries=empty_entries(),
        ranks={r: RankInfo(rank=r, source=str(tmp_path / f"rank_{r}.frt")) for r in ranks},
    )


@pytest.mark.timeout(10)
def test_side_files_attach_stacks_and_apply_the_manifest(tmp_path):
    for r in (0, 1, 3):
        (tmp_path / f"rank_{r}.stacks").write_text(_dump(WAITING))
    (tmp_path / "rank_2.stacks").write_text(_dump(WAITING) + _dump(STUCK))  # two dumps
    manifest = {
        "kind": "frtools-dump-manifest",
        "mode": "local",
        "host": "node7",
        "world_size": 4,
        "ranks_gone": [3],
        "ranks_no_answer": [],
        "ranks": {
            str(r): {"rank": r, "host": "node7", "alive": r != 3, "answered": r != 3}
            for r in range(4)
        },
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    trace = _trace(tmp_path)
    apply_manifest(trace, tmp_path)
    attach_stacks(trace, tmp_path)
    assert trace.ranks[3].alive is False and trace.ranks[0].alive is True
    assert trace.ranks[2].host == "node7" and trace.world_size == 4
    summary = stacks_summary(trace, [2])
    assert summary.guilty[0].user_frames[0].name == "compute_forever"
    assert [g.ranks for g in summary.groups] == [[0, 1, 3], [2]]
    text = "\n".join(stack_lines(summary))
    assert "rank 2 main thread:\n  /job/train.py:46 in compute_forever" in text
    assert "1 rank(s) 2            /job/train.py:46 in compute_forever  <- outlier" in text
    assert "3 rank(s) 0-1,3" in text
    reasons = {i.path.rsplit("/", 1)[-1]: i.reason for i in trace.inputs}
    assert "process gone: ranks 3" in reasons["manifest.json"]
    assert reasons["rank_2.stacks"] == "Python stacks of rank 2"


@pytest.mark.timeout(10)
def test_broken_manifest_is_one_input_error_not_a_crash(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    trace = _trace(tmp_path, ranks=(0,))
    apply_manifest(trace, tmp_path)
    (err,) = [i for i in trace.inputs if i.path.endswith("manifest.json")]
    assert err.status == "error" and "unreadable manifest" in err.reason


# -- native stacks (py-spy's ``dump --native --json``) ----------------------------------------


def _native_frame(name: str, module: str | None = None, line: int = 0) -> dict:
    if module is None:  # a Python frame
        return {"name": name, "filename": "/job/train.py", "short_filename": "train.py",
                "module": None, "line": line}  # fmt: skip
    return {"name": name, "filename": f"/lib/{module}", "short_filename": module,
            "module": f"/lib/{module}", "line": 0}  # fmt: skip


def _native(threads: list[tuple[str, bool, list[dict]]], pid: int = 100) -> str:
    return json.dumps(
        [
            {
                "pid": pid,
                "thread_id": 7 + i,
                "thread_name": name,
                "os_thread_id": pid + i,
                "active": active,
                "owns_gil": False,
                "frames": frames,
            }  # fmt: skip
            for i, (name, active, frames) in enumerate(threads)
        ]
    )


WAIT_IN_GLOO = [
    _native_frame("0x7f62a26a3f16", "libc.so.6"),
    _native_frame("pthread_cond_wait", "libc.so.6"),
    _native_frame("std::condition_variable::wait", "libstdc++.so.6"),
    _native_frame(
        "gloo::transport::tcp::UnboundBuffer::waitRecv(int*, std::chrono::milliseconds)",
        "libtorch_cpu.so",
    ),  # fmt: skip
    _native_frame("c10d::ProcessGroupGloo::AsyncWork::wait", "libtorch_cpu.so"),
    _native_frame("all_reduce", None, 72),
]
SLEEPING = [
    _native_frame("clock_nanosleep", "libc.so.6"),
    _native_frame("time_sleep", "libpython3.11.so.1.0"),
    _native_frame("train", None, 65),
]
SPINNING_IN_NCCL = [
    _native_frame("ncclLocalOpAppend", "libnccl.so.2"),
    _native_frame("ncclEnqueueCheck", "libnccl.so.2"),
    _native_frame("c10d::ProcessGroupNCCL::allreduce_impl", "libtorch_cuda.so"),
    _native_frame("backward", None, 12),
]


def _native_trace(tmp_path, texts: dict[int, str]) -> Trace:
    for rank, text in texts.items():
        (tmp_path / f"rank_{rank}.native").write_text(text)
    trace = _trace(tmp_path, ranks=tuple(texts))
    for rank in texts:
        trace.ranks[rank].pid = 100 + rank * 10
    attach_native_stacks(trace, tmp_path)
    return trace


@pytest.mark.timeout(10)
def test_rank_spinning_in_nccl_on_another_thread_is_the_native_outlier(tmp_path):
    texts = {r: _native([("MainThread", False, WAIT_IN_GLOO)], pid=100 + r * 10) for r in range(3)}
    # rank 3: the main thread sleeps in Python; an autograd thread spins inside NCCL's enqueue
    texts[3] = _native(
        [("MainThread", False, SLEEPING), ("autograd", True, SPINNING_IN_NCCL)], pid=130
    )
    summary = stacks_summary(_native_trace(tmp_path, texts), [3])
    assert summary.ranks_with_native == 4
    assert [(g.ranks, g.outlier) for g in summary.native_groups] == [
        ([0, 1, 2], False),
        ([3], True),
    ]
    text = "\n".join(stack_lines(summary))
    # innermost frame that matters first: gloo's wait, not libc's pthread_cond_wait
    assert (
        "3 rank(s) 0-2          gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"
        in text
    )
    assert "1 rank(s) 3            ncclLocalOpAppend (libnccl.so.2) [autograd]  <- outlier" in text
    assert (
        "rank 3 native stack (autograd, on CPU):\n  ncclLocalOpAppend (libnccl.so.2)\n"
        "  ncclEnqueueCheck (libnccl.so.2)\n  c10d::ProcessGroupNCCL::allreduce_impl" in text
    )
    native = summary.to_dict()["native"]
    assert native["groups"][1]["frames"][0]["matters"] is True
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[1] / "docs" / "verdict.schema.json").read_text())
    jsonschema.validate(summary.to_dict(), {"$defs": schema["$defs"], "$ref": "#/$defs/stacks"})
    assert {i.reason for i in _native_trace(tmp_path, texts).inputs} == {
        f"native stacks of rank {r} (py-spy)" for r in range(4)
    }


@pytest.mark.timeout(10)
def test_unresolved_addresses_differ_per_process_but_group_together(tmp_path):
    other = [_native_frame("0x7f0000001234", "libc.so.6"), *WAIT_IN_GLOO[1:]]
    texts = {
        0: _native([("MainThread", False, WAIT_IN_GLOO)]),
        1: _native([("MainThread", False, other)]),
    }
    summary = stacks_summary(_native_trace(tmp_path, texts))
    assert [g.ranks for g in summary.native_groups] == [[0, 1]]


@pytest.mark.timeout(10)
def test_python_stacks_alone_leave_the_report_as_it_was(tmp_path):
    (tmp_path / "rank_0.stacks").write_text(_dump(WAITING))
    trace = _trace(tmp_path, ranks=(0,))
    attach_stacks(trace, tmp_path)
    summary = stacks_summary(trace, [0])
    assert "native" not in summary.to_dict()
    assert not any("native" in line for line in stack_lines(summary))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text",
    [
        "not json at all",
        "{}",
        '{"frames": []}',
        "[" * 100_000,
        json.dumps([{"frames": [{"name": 3}, "x", None]}, 7, None]),
        json.dumps([{"thread_name": "MainThread", "frames": "no"}]),
    ],
)
def test_hostile_native_stacks_are_ignored_not_a_crash(tmp_path, text):
    summary = stacks_summary(_native_trace(tmp_path, {0: text}))
    assert summary.ranks_with_native == 0 and summary.native_groups == []


@pytest.mark.timeout(10)
def test_native_stacks_are_bounded_per_name_thread_and_file(tmp_path):
    huge = _native_frame("f" * 3000 + "<" + "T" * 100 + ">", "libtorch_cpu.so")
    many = [("t", False, [huge] * (MAX_NATIVE_FRAMES + 300))]
    stack = native_rank_stack(0, _native(many))
    assert stack is not None and len(stack.frames) == MAX_NATIVE_FRAMES
    assert len(str(stack.frames[0])) < 200
    (tmp_path / "rank_1.native").symlink_to("/dev/zero")
    trace = _trace(tmp_path, ranks=(1,))
    attach_native_stacks(trace, tmp_path)
    assert trace.ranks[1].native_stacks is None
    (err,) = [i for i in trace.inputs if i.path.endswith("rank_1.native")]
    assert err.status == "error"


def test_template_and_argument_lists_are_left_out_of_a_native_frame():
    frame = NativeFrame(
        name="pybind11::cpp_function::initialize<bool, c10d::Work>(pybind11::name)::"
        "{lambda(c10d::Work*)#1}::_FUN",
        module="libtorch_python.so",
    )
    assert str(frame) == "pybind11::cpp_function::initialize::{lambda#1}::_FUN (libtorch_python.so)"
