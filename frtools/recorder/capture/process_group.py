"""``RecordingProcessGroup``: a ProcessGroup that records each op and forwards it unchanged.

Its op methods are built from one table, ``OPS``: per ProcessGroup method, the op's name in
the record, the argument shape (where the tensors and the peer are, which are the input) and
the real backend's binding that issues it. ``hot_path.make_override`` turns each row into the
method.

Because the class goes through pybind11's trampoline (``PyProcessGroup``), C++ callers reach
these methods too: DDP's reducer all-reduces (``process_group_->allreduce``),
``allreduce_coalesced``, ``all_gather_single_coalesced``, ``reduce_scatter_single_coalesced``,
``all_to_all_single``, ``barrier``, ``broadcast``, ``allgather``, ``reduce_scatter``, ``send``,
``recv``. Python callers (``dist.*``, FSDP's ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, ``batch_isend_irecv``, coalescing managers) look the method up on
the object and reach every one, including ``all_gather_single``, ``reduce_scatter_single``,
``reduce``, ``gather``, ``scatter``, ``alltoall``, ``recv_anysource``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch._C._distributed_c10d import ProcessGroup

from frtools.recorder.capture import c10d_internals
from frtools.recorder.capture.hot_path import ArgShape, GroupState, make_override
from frtools.recorder.capture.recorder import Recorder


class Op(NamedTuple):
    method: str  # the ProcessGroup method overridden
    name: str  # the op in the record: PyTorch Flight Recorder's name (after "gloo:"/"nccl:")
    shape: ArgShape
    forward: str  # the real backend's binding that issues the op


OPS = (
    Op("allreduce", "all_reduce", ArgShape.TENSORS, "allreduce"),
    Op("allreduce_coalesced", "allreduce_coalesced", ArgShape.TENSORS, "allreduce_coalesced"),
    Op("broadcast", "broadcast", ArgShape.TENSORS, "broadcast"),
    Op("reduce", "reduce", ArgShape.TENSORS, "reduce"),
    Op("allgather", "all_gather", ArgShape.OUT_LISTS_IN, "allgather"),
    Op("all_gather_single", "_all_gather_base", ArgShape.OUT_IN, "_allgather_base"),
    Op("_allgather_base", "_all_gather_base", ArgShape.OUT_IN, "_allgather_base"),
    Op("allgather_coalesced", "all_gather_coalesced", ArgShape.OUT_LISTS_IN, "allgather_coalesced"),
    Op(
        "all_gather_single_coalesced",
        "all_gather_into_tensor_coalesced",
        ArgShape.OUT_IN,
        "allgather_into_tensor_coalesced",
    ),
    Op("gather", "gather", ArgShape.OUT_LISTS_IN, "gather"),
    Op("scatter", "scatter", ArgShape.OUT_IN_LISTS, "scatter"),
    Op("reduce_scatter", "reduce_scatter", ArgShape.OUT_IN_LISTS, "reduce_scatter"),
    Op("reduce_scatter_single", "_reduce_scatter_base", ArgShape.OUT_IN, "_reduce_scatter_base"),
    Op("_reduce_scatter_base", "_reduce_scatter_base", ArgShape.OUT_IN, "_reduce_scatter_base"),
    Op(
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor_coalesced",
        ArgShape.OUT_IN,
        "reduce_scatter_tensor_coalesced",
    ),
    Op("all_to_all_single", "all_to_all", ArgShape.SPLITS, "alltoall_base"),
    Op("alltoall", "all_to_all", ArgShape.SPLITS, "alltoall"),
    Op("barrier", "barrier", ArgShape.NO_TENSORS, "barrier"),
    Op("send", "send", ArgShape.PEER, "send"),
    Op("recv", "recv", ArgShape.PEER, "recv"),
    Op("recv_anysource", "recv", ArgShape.ANY_SOURCE, "recv_anysource"),
)

# ops no override issues: what a process-group hook may report that frtools does not know,
# and the one-sided window ops (recorded by wrapping Window's methods)
OTHER_OPS = ("unknown", "window_put", "window_signal", "window_wait_signal")

# op codes index this tuple (and each group's interned "<backend>:<name>" ids)
OP_NAMES = tuple(dict.fromkeys([*(op.name for op in OPS), *OTHER_OPS]))


class RecordingProcessGroup(ProcessGroup):
    """A ProcessGroup that records each op in the black box and forwards it unchanged.

    ``backends``: (device, backend type, real backend) of each device; ``global_ranks``: the
    members' global ranks (P2P peers are recorded as global ranks).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        recorder: Recorder,
        backends: list[tuple[str, Any, Any]],
        global_ranks: list[int],
        backend_name: str,
    ) -> None:
        super().__init__(rank, size)
        self._fr_backend_name = backend_name
        nccl = any(b[1] == ProcessGroup.BackendType.NCCL for b in backends)
        ops = recorder.op_ids("nccl" if nccl else "gloo", OP_NAMES)
        st = self._frs = GroupState(recorder, ops, global_ranks)
        c10d_internals.attach_backends(self, backends)
        real = {device: backend for device, _, backend in backends}
        st.cpu = real.get("cpu")
        st.cuda = real.get("cuda")
        if st.cpu is None or st.cuda is None or st.cpu is st.cuda:
            st.single = st.cpu or st.cuda
        st.barrier_backend = st.cuda if nccl else (st.cpu or st.cuda)
        # a single backend's bindings, looked up once instead of per op
        st.issue = [getattr(st.single, op.forward, None) for op in OPS]

    def getBackendName(self) -> str:  # noqa: N802 - C++ virtual name
        return self._fr_backend_name

    def name(self) -> str:
        return self._fr_backend_name

    def frtools_register(self, name: str, desc: str) -> None:
        """Add this group to the black box's process-group table (its name and description
        are only known once the group is built)."""
        st = self._frs
        st.bind(name, desc, st.ranks)

    # -- coalescing ------------------------------------------------------------------------

    def _start_coalescing(self, device: Any) -> None:
        """Ops issued until ``_end_coalescing`` share one collective_seq_id (as in NCCL's FR)."""
        st = self._frs
        if st.fr.enabled:
            st.coll_seq += 1
            st.coalescing = True
        super()._start_coalescing(device)

    def _end_coalescing(self, device: Any) -> Any:
        self._frs.coalescing = False
        return super()._end_coalescing(device)


def _build_overrides() -> None:
    for slot, op in enumerate(OPS):
        base = getattr(ProcessGroup, op.method)
        code = OP_NAMES.index(op.name)
        override = make_override(op.method, op.shape, code, slot, op.forward, base)
        setattr(RecordingProcessGroup, op.method, override)


_build_overrides()
