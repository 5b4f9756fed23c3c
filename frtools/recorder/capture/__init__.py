"""See every c10d op a job issues, and hand each one to the native black box.

Two paths, one record (same op names, same seq-id meaning, same completion tracking):

* **hooks** (torch >= 2.15, the default there; ``FRTOOLS_CAPTURE`` forces either path): a
  pre/post hook pair on every group the job creates (``hooks``), attached where torch
  publishes each group; the user's backend is untouched. Checked on 2.15 with Gloo: DDP's
  reducer, functional collectives, coalesced blocks, send/recv and FSDP2 fire the hooks.
  One-sided window ops (nccl2) fire none: ``Window``'s methods are wrapped instead.
* **wrap** (older torch): every process group the job creates is built through a backend
  plugin of ours and comes back as a ``RecordingProcessGroup``, a Python subclass of
  ``torch.distributed.ProcessGroup`` whose op methods record the op, then forward it to the
  real Gloo/NCCL backend. Because the subclass goes through pybind11's trampoline, C++
  callers (DDP's reducer) reach those methods too. (On 2.15 it still works for Gloo, but
  builds the legacy ``ProcessGroupNCCL`` for ``nccl``, which now means nccl2.)

* ``install`` — choosing the path; the hooks' attachment to each published group; the
  backend installation (the ``frtools`` plugin, the wrapper around group creation, the
  creator that builds the real backends).
* ``hooks`` — the hooks path: torch's hook op names -> frtools' (``HOOK_OPS``), one hook pair
  per group, the window wrappers.
* ``process_group`` — ``RecordingProcessGroup``, its op methods built from one table (``OPS``).
* ``hot_path`` — what runs per op: a group's record and completion steps (``GroupState``),
  the op-method templates (one per argument shape), the hook pair (``make_hooks``), the
  window ops, the call-site lookup.
* ``recorder`` — the ``Recorder`` every group of the process shares: the black box, interned
  texts, the completion poller.
* ``c10d_internals`` — every use of torch.distributed's private API, in one place.

Per op the Python part is thin: bump the group's counter, look the shapes/dtypes up in small
dicts and the call stack in the native call-site cache (``frtools.recorder._callsite``; a
Python walk when it is not built), each text interned once in the black box's string table,
one ``BlackBox.record()`` call, and completion tracking. The usual call form
``(tensors, opts)`` goes to the backend binding as is. Measured cost:
``benchmarks/recorder_overhead.py``, docs/benchmarks.md "Recorder overhead".

What is seen (checked by hand on 4 Gloo ranks): every ``dist.*`` collective, ``send``/``recv``,
``batch_isend_irecv``, ``_coalescing_manager`` (one ``allreduce_coalesced``), functional
collectives, DDP (start-up broadcasts, reducer bucket all-reduces) and FSDP2 ``fully_shard``
(``_all_gather_base`` / ``_reduce_scatter_base``), each with the same ``collective_seq_id`` as
PyTorch's own recorder assigns. Functional collectives
(``torch.distributed._functional_collectives``) resolve the group by name in C++ and call its
virtual op methods; the object registered under that name is the ``RecordingProcessGroup``,
so they are recorded: ``all_reduce`` as ``all_reduce``, ``all_gather_tensor`` as
``all_gather_into_tensor_coalesced``, ``reduce_scatter_tensor`` as
``reduce_scatter_tensor_coalesced`` (what the trampoline receives).

Known limits: ``monitored_barrier`` fires no hook (not recorded on the hooks path). A group
reconfigured in place (``dist._reconfigure``) keeps its hooks and counters but its row in the
process-group table keeps the old members. ``batch_isend_irecv`` only groups P2P ops for plain ``ProcessGroup`` objects
(``type(group) is ProcessGroup``), so on a recorded group each P2P op is issued on its own
(correct, each recorded with its own ``p2p_seq_id``; NCCL then does not fuse them). A group
whose backend is neither gloo nor nccl is left unwrapped and unrecorded, with one warning
(wrap path; the hooks path records any backend).
"""

from frtools.recorder.capture.install import (
    BACKEND_NAME,
    capture_mode,
    current_recorder,
    install,
    open_if_job_running,
    recording,
    uninstall,
)
from frtools.recorder.capture.process_group import OP_NAMES, OPS, RecordingProcessGroup
from frtools.recorder.capture.recorder import Recorder

__all__ = [
    "BACKEND_NAME",
    "OPS",
    "capture_mode",
    "OP_NAMES",
    "Recorder",
    "RecordingProcessGroup",
    "current_recorder",
    "install",
    "open_if_job_running",
    "recording",
    "uninstall",
]
