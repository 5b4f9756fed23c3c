"""Recording through process-group hooks (torch >= 2.15), and one-sided windows.

torch 2.15 calls ``ProcessGroup.register_pre_hook`` / ``register_post_hook`` callbacks around
every op of a group on any backend — DDP's reducer, functional collectives, coalesced blocks,
send/recv included — the way PyTorch's own ``FlightRecorderHook`` records nccl2. There is no
global hook: ``install`` attaches a pair to every group the job creates, from a wrapper of
the function through which every group is published (``c10d_internals.group_registration``:
``init_process_group``, ``new_group``, ``new_subgroups``, ``split_group``), and the hooks
stay on a group reconfigured in place (``dist._reconfigure``). The backend is not replaced:
the group is the user's own. ``monitored_barrier`` fires no hook (it is not recorded).

Per op: the pre hook records it (``hot_path.make_hooks``) under the names the op overrides
use (``HOOK_OPS``), with frtools' own ``collective_seq_id`` / ``p2p_seq_id`` per group (the
hooks' ``op_id`` counts P2P ops too); the post hook, called right after the op is issued,
hands its Work to the completion tracking (the poller, or CUDA events), which also marks
failures. The Work's ``_get_sequence_number()`` is not used (Gloo's list reduce_scatter
raises there).

The pair's body is C++ where it is built for this torch (``native_hooks``: the same records,
no GIL per op, its own completion poller), else Python (``make_hooks``); the choice is made
once per process (``Recorder.native_body``).

One-sided windows (``pg.new_window()``: nccl2; Gloo's raises): ``Window.put``, ``signal`` and
``wait_signal`` fire no hook and PyTorch's FR never sees them. ``wrap_windows`` wraps those
methods and ``new_window`` (which registers each window as a row of the process-group table,
``<group>/window<n>``, with the group's members) so they are recorded as ``window_put``,
``window_signal``, ``window_wait_signal``: P2P-like, the peer as a global rank, and
``p2p_seq_id`` the index of that op for that peer on that window.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from frtools.recorder.capture import c10d_internals
from frtools.recorder.capture.hot_path import (
    WINDOWS,
    GroupState,
    HookShape,
    WindowState,
    make_hooks,
    make_native_group,
    splits_call,
    window_call,
)
from frtools.recorder.capture.process_group import OP_NAMES
from frtools.recorder.shutdown import before_finalization

# "frt1": our hook id on every group (registering an id again replaces that hook)
HOOK_ID = 0x66727431

# torch's HookOpName -> (the op in the record, where its tensors are). The names are the ones
# the op overrides record (process_group.OPS) and PyTorch's FlightRecorderHook writes, except
# ALLTOALL_BASE, recorded as ``all_to_all`` like NCCL's own recorder (the hook: all_to_all_single).
HOOK_OPS: dict[str, tuple[str, HookShape]] = {
    "ALLREDUCE": ("all_reduce", HookShape.IN_PLACE),
    "ALLREDUCE_COALESCED": ("allreduce_coalesced", HookShape.IN_PLACE),
    "BROADCAST": ("broadcast", HookShape.IN_PLACE),
    "REDUCE": ("reduce", HookShape.IN_PLACE),
    "ALLGATHER": ("all_gather", HookShape.OUT_IN),
    "ALLGATHER_BASE": ("_all_gather_base", HookShape.OUT_IN),
    "ALLGATHER_COALESCED": ("all_gather_coalesced", HookShape.OUT_IN),
    "ALLGATHER_INTO_TENSOR_COALESCED": ("all_gather_into_tensor_coalesced", HookShape.OUT_IN),
    "GATHER": ("gather", HookShape.OUT_IN),
    "SCATTER": ("scatter", HookShape.OUT_IN),
    "REDUCE_SCATTER": ("reduce_scatter", HookShape.OUT_IN),
    "REDUCE_SCATTER_BASE": ("_reduce_scatter_base", HookShape.OUT_IN),
    "REDUCE_SCATTER_TENSOR_COALESCED": ("reduce_scatter_tensor_coalesced", HookShape.OUT_IN),
    "ALLTOALL": ("all_to_all", HookShape.OUT_IN),
    "ALLTOALL_BASE": ("all_to_all", HookShape.OUT_IN),
    "BARRIER": ("barrier", HookShape.NO_TENSORS),
    "SEND": ("send", HookShape.PEER),
    "RECV": ("recv", HookShape.PEER),
    "UNKNOWN": ("unknown", HookShape.OUT_IN),
}
# hook names not recorded: no payload, not counted by collective_seq_id (a window's creation
# is recorded by new_window's wrapper, as a row of the process-group table)
NOT_RECORDED = ("SPLIT", "NEW_WINDOW")

# Window method -> (op, position of the peer after self, its keyword, first argument a tensor)
WINDOW_OPS = {
    "put": ("window_put", 1, "dst_rank", True),
    "signal": ("window_signal", 0, "peer_rank", False),
    "wait_signal": ("window_wait_signal", 0, "peer_rank", False),
}


def available() -> bool:
    """This torch calls process-group hooks (2.15 and later)."""
    return c10d_internals.has_process_group_hooks()


def hook_specs() -> list[tuple[int, HookShape] | None]:
    """By the value of each ``HookOpName`` of this torch: (op code in ``OP_NAMES``, shape),
    None for a name not recorded."""
    members = c10d_internals.hook_op_names().__members__
    specs: list[tuple[int, HookShape] | None] = [None] * (
        max(int(m.value) for m in members.values()) + 1
    )
    for name, member in members.items():
        if name in HOOK_OPS:
            op, shape = HOOK_OPS[name]
            specs[int(member.value)] = (OP_NAMES.index(op), shape)
    return specs


# process group -> its GroupState, for the groups with our hooks (weakly held)
_hooked: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()


def hooked(pg: Any) -> GroupState | None:
    return _hooked.get(pg)


def attach(pg: Any, recorder: Any, backend: str, native: bool = True) -> GroupState:
    """Record every op of ``pg`` through a pre/post hook pair (once per group): the C++ body
    where it is built (``native_hooks``), else the Python one (``native=False``: always)."""
    st = _hooked.get(pg)
    if st is not None:
        return st
    st = GroupState(recorder, recorder.op_ids(backend, OP_NAMES), [])
    group = weakref.ref(pg)

    def bind() -> bool:
        """Register the group in the black box once torch has published its members."""
        pg_now = group()
        ranks = c10d_internals.group_members(pg_now) if pg_now is not None else None
        if ranks is None:
            return False
        st.bind(str(pg_now.group_name), str(pg_now.group_desc), ranks)
        return True

    if not _hooked:
        before_finalization(detach_all)
        wrap_all_to_all()
    body_of = recorder.native_body() if native else None
    if body_of is not None:
        module, body = body_of
        make_native_group(st, _specs(), bind, module, body).attach(pg, HOOK_ID)
    else:
        pre, post = make_hooks(st, _specs(), bind)
        pg.register_pre_hook(HOOK_ID, pre)
        pg.register_post_hook(HOOK_ID, post)
    _hooked[pg] = st
    return st


def wrap_all_to_all() -> None:
    """Keep the split sizes of ``all_to_all_single`` and list ``all_to_all`` (which the hooks'
    arguments lack): wrap the ProcessGroup methods ``torch.distributed`` calls them through
    (once; a group without our hooks goes straight to the original). Ops issued from C++
    (functional collectives) are recorded without splits."""
    import torch.distributed as dist

    for method, lists in (("all_to_all_single", False), ("alltoall", True)):
        original = getattr(dist.ProcessGroup, method, None)
        if original is None or getattr(original, "_frtools_splits", False):
            continue
        setattr(dist.ProcessGroup, method, splits_call(method, original, hooked, lists))


def detach_all() -> None:
    """Take our hooks off every group before the interpreter finalizes.

    A group still alive then (no ``destroy_process_group``) is destroyed by torch's static
    group registry after Python has finalized, and destroying a Python hook takes the GIL:
    the process segfaults at exit (seen on torch 2.15 with any Python hook). Ops issued
    after this point (from ``atexit`` handlers) are not recorded.
    """
    for pg in list(_hooked):
        with contextlib.suppress(Exception):
            pg.unregister_pre_hook(HOOK_ID)
            pg.unregister_post_hook(HOOK_ID)
    _hooked.clear()


_spec_cache: list[tuple[int, HookShape] | None] = []


def _specs() -> list[tuple[int, HookShape] | None]:
    if not _spec_cache:
        _spec_cache.extend(hook_specs())
    return _spec_cache


def backend_prefix(pg: Any, backend: Any) -> str:
    """The profiling-name prefix of a group's ops: its backend's own name (``gloo``,
    ``nccl``, ``nccl2``), as PyTorch's recorders prefix theirs; the NCCL one where a group
    has a backend per device."""
    names = [n for n in c10d_internals.backend_names(pg) if _plain(n)]
    if names:
        return next((n for n in names if "nccl" in n), names[0])
    text = str(backend).lower()
    return "nccl" if "nccl" in text else text.rsplit(":", 1)[-1] or "c10d"


def _plain(name: str) -> bool:
    return bool(name) and name.replace("_", "").replace("-", "").isalnum()


# -- one-sided windows -----------------------------------------------------------------------


def register_window(window: Any, st: GroupState) -> WindowState | None:
    """Record ``window``'s ops from now on: the group's ``n``-th window (created collectively,
    so the same on every member) becomes row ``<group>/window<n>`` of the process-group table."""
    if st.pg < 0:
        return None
    st.windows += 1
    name = f"{st.name}/window{st.windows}"
    desc = f"{st.desc} window {st.windows}" if st.desc else f"window {st.windows}"
    ws = WindowState(st, st.box.add_process_group(name, desc, st.ranks, True))
    WINDOWS[window] = ws
    return ws


def wrap_windows(
    window_cls: Any, group_cls: Any, state_of: Callable[[Any], GroupState | None]
) -> bool:
    """Wrap ``window_cls``'s put/signal/wait_signal and ``group_cls.new_window`` (once);
    ``state_of(group)``: the recording state of a group (None: not recorded). Returns whether
    anything was wrapped (False: this torch has no windows)."""
    if window_cls is None or getattr(window_cls, "_frtools_wrapped", False):
        return False
    for method, (op, peer_at, peer_name, has_tensor) in WINDOW_OPS.items():
        original = getattr(window_cls, method, None)
        if original is not None:
            code = OP_NAMES.index(op)
            call = window_call(method, code, peer_at, peer_name, has_tensor, original)
            setattr(window_cls, method, call)
    new_window = getattr(group_cls, "new_window", None)
    if new_window is not None:

        def recorded_new_window(self: Any, *args: Any, **kwargs: Any) -> Any:
            window = new_window(self, *args, **kwargs)
            st = None
            try:
                st = state_of(self)
                if st is not None and st.fr.enabled:
                    register_window(window, st)
            except Exception as exc:
                if st is not None:
                    st.fr.fail(exc)
            return window

        recorded_new_window.__name__ = "new_window"
        recorded_new_window.__wrapped__ = new_window  # type: ignore[attr-defined]
        group_cls.new_window = recorded_new_window
    window_cls._frtools_wrapped = True
    return True
