"""The hooks path's per-op logic and the one-sided window recording, on CPU, in-process.

Real torch 2.15 hooks on real Gloo jobs are exercised by test_recorder_capture.py (the hooks
path is the default there on 2.15) and test_native_hooks.py (the C++ body); here the same
code is driven with stand-ins — hook arguments as PyTorch passes them, and a fake ``Window``
class, so that the window recording (nccl2 only on real hardware) is proven without a GPU
and without caring which backend. The hook tests run on both bodies: the Python one
(``make_hooks``) and, where it builds (torch >= 2.15, a compiler), the C++ one
(``native_hooks``), whose works are real c10d Works over futures.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from frtools.analyze.readers import frtools_snapshot as reader
from frtools.recorder.capture import Recorder, hooks
from frtools.recorder.capture.hot_path import (
    GroupState,
    make_hooks,
    make_native_group,
    native_hook_callables,
)
from frtools.recorder.capture.process_group import OP_NAMES
from frtools.recorder.native import load_native

native = load_native()


class FakeFuture:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def value(self) -> list:
        if self.error:
            raise RuntimeError(self.error)
        return []


class FakeWork:
    """A Work: ``done`` says whether it finished, ``error`` how it failed."""

    def __init__(self, done: bool = True, error: str | None = None) -> None:
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> FakeFuture:
        return FakeFuture(self.error)


@pytest.fixture(params=["python", "native"])
def body(request) -> str:
    """Which hook body records: the Python pair or the C++ one (built once a session)."""
    if request.param == "native":
        request.getfixturevalue("native_hooks_module")
    return request.param


def real_work(module, fake: FakeWork):
    """A c10d Work over a C++ future in the state of ``fake`` (for the C++ body; a Python
    future's exception is a value to C++)."""
    return module._work(fake.done, fake.error)


def hook_pair(st: GroupState, bind, body: str):
    """(pre, post) hooks of ``body`` over one group's state, taking PyTorch-like arguments."""
    if body == "python":
        return make_hooks(st, SPECS, bind)
    from frtools.recorder import native_hooks

    fr = st.fr
    if not fr._native:
        module = native_hooks.load(build_if_missing=True)
        fr._native = (module, native_hooks.recorder_body(fr, module))
    module, native_body = fr._native
    group = make_native_group(st, SPECS, bind, module, native_body)
    pre_hook, post_native = native_hook_callables(group, fr)

    def post_hook(args) -> None:
        if isinstance(args.work, FakeWork):
            args.work = real_work(module, args.work)
        post_native(args)

    return pre_hook, post_hook


def _bound(tmp_path: Path, capacity: int = 64) -> types.SimpleNamespace:
    """A recorder on a real black box of ``capacity`` slots and one bound group: global
    ranks 4 and 6."""
    path = tmp_path / "rank_4.frt"
    identity = {"rank": 4, "world_size": 8, "backend": "nccl", "host": "elsewhere"}
    box = native.BlackBox(str(path), capacity, 1 << 16, json.dumps(identity))
    recorder = Recorder(box, cuda_events=False)
    st = GroupState(recorder, recorder.op_ids("nccl2", OP_NAMES), [])
    st.bind("3", "pairs", [4, 6])
    return types.SimpleNamespace(path=path, box=box, recorder=recorder, st=st)


@pytest.fixture
def recorded(tmp_path: Path):
    bound = _bound(tmp_path)
    recorder = bound.recorder
    yield bound
    recorder._stop_poller()
    if recorder._native:
        recorder._native[1].final_poll()


def entries(path: Path):
    return reader.read(path).entries.to_pandas().sort_values("record_id")


# --------------------------------------------------------------------------------------
# Hooks: what the pre/post hooks record from PyTorch's hook arguments
# --------------------------------------------------------------------------------------


# hook op names and values as torch 2.15's HookOpName has them
HOOK_OP_VALUES = dict(
    SEND=0, RECV=1, BROADCAST=2, ALLREDUCE=3, REDUCE=4, ALLGATHER=5, REDUCE_SCATTER=6,
    ALLTOALL=7, BARRIER=8, SCATTER=9, GATHER=10, SPLIT=11, NEW_WINDOW=12,
    ALLREDUCE_COALESCED=13, ALLGATHER_BASE=14, ALLGATHER_COALESCED=15,
    ALLGATHER_INTO_TENSOR_COALESCED=16, REDUCE_SCATTER_BASE=17,
    REDUCE_SCATTER_TENSOR_COALESCED=18, ALLTOALL_BASE=19, UNKNOWN=20,
)  # fmt: skip


def hook_name(name: str):
    return types.SimpleNamespace(name=name, value=HOOK_OP_VALUES[name])


def pre(name: str, op_id: int, ins=(), outs=(), root: int = -1):
    return types.SimpleNamespace(
        name=hook_name(name),
        op_id=op_id,
        input_tensors=list(ins),
        output_tensors=list(outs),
        root=root,
    )


def post(name: str, op_id: int, work):
    return types.SimpleNamespace(name=hook_name(name), op_id=op_id, work=work)


SPECS = [None] * (max(HOOK_OP_VALUES.values()) + 1)
for _name, (_op, _shape) in hooks.HOOK_OPS.items():
    SPECS[HOOK_OP_VALUES[_name]] = (OP_NAMES.index(_op), _shape)


def test_hooked_ops_get_their_own_seq_ids_names_and_global_peers(body: str, recorded) -> None:
    st, rec = recorded.st, recorded.recorder
    pre_hook, post_hook = hook_pair(st, lambda: True, body)
    x = torch.ones(4)
    calls = [
        ("ALLREDUCE", [x], []),
        ("SEND", [torch.ones(2)], []),  # op_id counts it; collective_seq_id does not
        ("ALLGATHER_BASE", [torch.ones(2)], [torch.ones(4)]),
        ("RECV", [], [torch.ones(2)]),
        ("BARRIER", [], []),
        ("SPLIT", [], []),  # not recorded
        ("ALLTOALL_BASE", [torch.ones(2)], [torch.ones(2)]),
    ]
    for op_id, (name, ins, outs) in enumerate(calls):
        pre_hook(pre(name, op_id, ins, outs, root=1 if name in ("SEND", "RECV") else -1))
        post_hook(post(name, op_id, FakeWork()))
    rec.poll()
    e = entries(recorded.path)
    assert e["op"].tolist() == [
        "all_reduce", "send", "_all_gather_base", "recv", "barrier", "all_to_all",
    ]  # fmt: skip
    assert e["profiling_name"].iloc[0] == "nccl2:all_reduce"
    assert e["collective_seq_id"].tolist() == [1, 0, 2, 0, 3, 4]
    assert e["p2p_seq_id"].tolist() == [0, 1, 0, 2, 0, 0]
    assert e["peer"].fillna(-1).astype(int).tolist() == [-1, 6, -1, 6, -1, -1]  # global
    assert e["input_sizes"].tolist()[:4] == ["[[4]]", "[[2]]", "[[2]]", "[[2]]"]
    assert e["output_sizes"].tolist()[2] == "[[4]]"
    assert set(e["state"]) == {"completed"} and e["pg_desc"].unique().tolist() == ["pairs"]
    assert e["call_site"].str.contains("test_recorder_hooks.py").all()  # not the hook frame


def test_a_failed_hooked_op_is_failed_not_completed(body: str, recorded) -> None:
    st, rec = recorded.st, recorded.recorder
    pre_hook, post_hook = hook_pair(st, lambda: True, body)
    error = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:4711"
    for op_id, work in enumerate([FakeWork(), FakeWork(error=error), FakeWork(done=False)]):
        pre_hook(pre("ALLREDUCE", op_id, [torch.ones(1)]))
        post_hook(post("ALLREDUCE", op_id, work))
    rec.poll()
    e = entries(recorded.path)
    assert e["state"].tolist() == ["completed", "scheduled", "scheduled"]
    assert e["error"].tolist()[1] == error and e["error"].isna().tolist() == [True, False, True]


def test_the_native_completion_queue_tracks_every_work_past_its_ring(
    tmp_path: Path, native_hooks_module
) -> None:
    # the C++ body queues Works in a 1024-cell ring, and past it (the poller starved) on an
    # overflow stack: with the poller stopped, 1100 ops fill both; one pass must still mark
    # each done one completed and each failed one failed, in either, and keep the rest
    bound = _bound(tmp_path, capacity=2048)
    path, rec = bound.path, bound.recorder
    pre_hook, post_hook = hook_pair(bound.st, lambda: True, "native")
    body = rec._native[1]
    body.stop()
    n, error = 1100, "Connection closed by peer"
    done = {17, 1050}  # P2P: no completion inferred for older ops
    failed = {500, 1090}
    for op_id in range(n):
        pre_hook(pre("SEND", op_id, [torch.ones(1)], root=1))
        work = FakeWork(done=op_id in done | failed, error=error if op_id in failed else None)
        post_hook(post("SEND", op_id, work))
    assert body.pending == n
    body.poll()
    assert body.pending == n - len(done) - len(failed)
    e = entries(path)
    assert len(e) == n
    states, errors = e["state"].tolist(), e["error"].tolist()
    assert {i for i, s in enumerate(states) if s == "completed"} == done
    assert {i for i, x in enumerate(errors) if isinstance(x, str)} == failed
    assert all(errors[i] == error for i in failed)
    body.final_poll()


def test_a_failing_hook_body_never_raises_into_the_job(body: str, recorded, recwarn) -> None:
    st = recorded.st
    pre_hook, post_hook = hook_pair(st, lambda: True, body)
    broken = types.SimpleNamespace(name="ALLREDUCE", op_id=0, root=-1)  # no tensors at all
    pre_hook(broken)  # must not raise
    post_hook(post("ALLREDUCE", 0, FakeWork()))
    assert not recorded.recorder.enabled  # recording off, said once
    pre_hook(pre("ALLREDUCE", 1, [torch.ones(1)]))
    assert recorded.box.records == 0


def test_a_group_is_recorded_once_its_members_are_known(body: str, recorded) -> None:
    st = GroupState(recorded.recorder, recorded.st.ops, [])
    known = []
    pre_hook, post_hook = hook_pair(st, lambda: bool(known), body)
    pre_hook(pre("ALLREDUCE", 0, [torch.ones(1)]))  # members unknown yet: not recorded
    post_hook(post("ALLREDUCE", 0, FakeWork()))
    known.append(1)
    st.bind("5", "late", [4, 6])
    pre_hook(pre("ALLREDUCE", 1, [torch.ones(1)]))
    assert recorded.box.records == 1


def test_ops_after_the_box_is_closed_are_not_recorded_and_do_no_harm(
    body: str, recorded, recwarn
) -> None:
    st, rec = recorded.st, recorded.recorder
    pre_hook, post_hook = hook_pair(st, lambda: True, body)
    pre_hook(pre("ALLREDUCE", 0, [torch.ones(1)]))
    post_hook(post("ALLREDUCE", 0, FakeWork()))
    recorded.box.close()  # the C++ body writes without the GIL: close() waits for it, then
    for op_id in (1, 2):  # every write is a no-op
        pre_hook(pre("ALLREDUCE", op_id, [torch.ones(1)]))
        post_hook(post("ALLREDUCE", op_id, FakeWork()))
    rec.poll()
    assert recorded.box.records == 0  # closed: nothing counted, nothing raised


@pytest.mark.skipif(not hooks.available(), reason="this torch has no process-group hooks")
def test_every_hook_op_name_of_this_torch_is_mapped_or_deliberately_not_recorded() -> None:
    from torch._C._distributed_c10d import HookOpName

    members = HookOpName.__members__
    assert set(members) == set(hooks.HOOK_OPS) | set(hooks.NOT_RECORDED)
    assert {n: int(m.value) for n, m in members.items()} == HOOK_OP_VALUES
    assert sum(spec is not None for spec in hooks.hook_specs()) == len(hooks.HOOK_OPS)


# --------------------------------------------------------------------------------------
# One-sided windows, with a fake Window class: the wrapper does not care which backend
# --------------------------------------------------------------------------------------


def fake_window_classes(silent: int = 0):
    """A window class with nccl2's methods, and a group class that creates windows; a wait
    for a signal from group rank ``silent`` never completes."""
    issued = []

    class Window:
        def put(self, tensor, dst_rank, target_offset_nelems, async_op, opts=None):
            issued.append(("put", dst_rank))
            return FakeWork()

        def signal(self, peer_rank, async_op, opts=None):
            issued.append(("signal", peer_rank))
            return FakeWork()

        def wait_signal(self, peer_rank, async_op, opts=None):
            issued.append(("wait_signal", peer_rank))
            return FakeWork(done=peer_rank != silent)

    class Group:
        def new_window(self, tensor=None):
            return Window()

    return Window, Group, issued


def test_window_ops_are_recorded_with_global_peers_and_per_pair_indexes(recorded) -> None:
    window_cls, group_cls, issued = fake_window_classes()
    group = group_cls()
    assert hooks.wrap_windows(window_cls, group_cls, lambda g: recorded.st if g is group else None)
    assert not hooks.wrap_windows(window_cls, group_cls, lambda g: None)  # once
    win = group.new_window(torch.zeros(8))
    other = group.new_window()
    win.put(torch.ones(3), 1, 0, True)
    win.signal(1, True)
    win.put(torch.ones(3), dst_rank=1, target_offset_nelems=3, async_op=True)
    win.signal(peer_rank=1, async_op=True)
    other.signal(1, True)  # another window: its own indexes
    win.wait_signal(1, True)
    win.wait_signal(0, True)  # the hang: never completes
    assert issued == [("put", 1), ("signal", 1), ("put", 1), ("signal", 1), ("signal", 1)] + [
        ("wait_signal", 1),
        ("wait_signal", 0),
    ]  # every call went through, unchanged
    recorded.recorder.poll()
    dump = reader.read(recorded.path)
    e = dump.entries.to_pandas().sort_values("record_id")
    assert (
        e["op"].tolist()
        == ["window_put", "window_signal"] * 2 + ["window_signal"] + ["window_wait_signal"] * 2
    )
    assert e["pg_name"].tolist() == ["3/window1"] * 4 + ["3/window2"] + ["3/window1"] * 2
    assert e["peer"].tolist() == [6] * 6 + [4]
    assert e["p2p_seq_id"].tolist() == [1, 1, 2, 2, 1, 1, 1]
    assert e["is_p2p"].all() and (e["collective_seq_id"] == 0).all()
    assert e["input_sizes"].tolist()[0] == "[[3]]" and e["input_sizes"].tolist()[1] == ""
    assert e["state"].tolist() == ["completed"] * 6 + ["scheduled"]
    windows = {name: pg for name, pg in dump.process_groups.items() if "window" in name}
    assert windows["3/window1"].ranks == (4, 6) and windows["3/window1"].desc == "pairs window 1"


def test_windows_of_unrecorded_groups_are_left_alone(recorded) -> None:
    window_cls, group_cls, issued = fake_window_classes()
    hooks.wrap_windows(window_cls, group_cls, lambda g: None)
    win = group_cls().new_window()
    assert isinstance(win.put(torch.ones(1), 1, 0, True), FakeWork)
    win.signal(1, True)
    assert issued == [("put", 1), ("signal", 1)] and recorded.box.records == 0


def test_a_window_call_that_recording_cannot_parse_still_goes_through(recorded, recwarn) -> None:
    window_cls, group_cls, issued = fake_window_classes()
    group = group_cls()
    hooks.wrap_windows(window_cls, group_cls, lambda g: recorded.st)
    win = group.new_window()
    assert isinstance(win.signal("not a rank", True), FakeWork)  # recording fails, call goes on
    assert issued == [("signal", "not a rank")]
    assert not recorded.recorder.enabled


# --------------------------------------------------------------------------------------
# tests/gpu/check_windows_nccl2.py's judgement, on records made with fake windows
# --------------------------------------------------------------------------------------


def gpu_check():
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import check_windows_nccl2

    return check_windows_nccl2


def window_job(directory: Path, hang: bool, rank1_signals: bool = False) -> None:
    """Both ranks of check_windows_nccl2's job, each with its own box and fake windows."""
    SIGNALS = gpu_check().SIGNALS  # noqa: N806

    window_cls, group_cls, _ = fake_window_classes(silent=1)
    states = {}
    hooks.wrap_windows(window_cls, group_cls, lambda g: states[g])
    recorders = []
    for rank in range(2):
        box = native.BlackBox(
            str(directory / f"rank_{rank}.frt"), 64, 1 << 16, json.dumps({"rank": rank})
        )
        recorder = Recorder(box, cuda_events=False)
        recorders.append(recorder)
        st = GroupState(recorder, recorder.op_ids("nccl2", OP_NAMES), [])
        st.bind("0", "default_pg", [0, 1])
        group = group_cls()
        states[group] = st
        win = group.new_window(torch.zeros(4))
        for i in range(SIGNALS):
            if rank == 0:
                win.put(torch.ones(2), 1, i * 2, False)
                win.signal(1, False)
            else:
                win.wait_signal(0, False)
        if hang and rank == 0:
            win.wait_signal(1, True)
        if rank1_signals and rank == 1:
            win.signal(0, True)
        recorder.poll()
    for recorder in recorders:
        recorder._stop_poller()


@pytest.mark.parametrize("hang", [False, True])
def test_gpu_window_check_accepts_what_the_recorder_writes(tmp_path: Path, hang: bool) -> None:
    window_job(tmp_path, hang)
    assert gpu_check().check_window_records(tmp_path, hang) == []


def test_gpu_window_check_sees_a_signal_that_should_not_be_there(tmp_path: Path) -> None:
    window_job(tmp_path, hang=True, rank1_signals=True)
    problems = gpu_check().check_window_records(tmp_path, hang=True)
    assert problems == ["rank 1: 1 window_signal to/from 0, expected 0"]
