"""See every c10d op a job issues, and hand each one to the native black box.

How (checked on torch 2.13 with Gloo, 4 ranks; see tests/test_recorder_capture.py):

* ``install()`` registers a c10d backend plugin named ``frtools``
  (``torch.distributed.Backend.register_backend(..., extended_api=True)``) and wraps
  ``torch.distributed.distributed_c10d._new_process_group_helper`` — the one function through
  which ``init_process_group``, ``new_group``, ``new_subgroups`` and friends create a group.
  For a group whose backends are all ``gloo``/``nccl`` the wrapper asks the helper for backend
  ``frtools`` instead, and afterwards puts the user's backend name back into ``_world``
  (``dist.get_backend(group)`` still answers ``gloo``/``nccl``; ``pg.name()`` too).
* The plugin's creator builds the real backends (``ProcessGroupGloo``/``ProcessGroupNCCL``,
  with the same options, sequence numbers and NCCL split source as the helper would) and
  returns a ``RecordingProcessGroup``: a Python subclass of ``torch.distributed.ProcessGroup``
  that registers those backends for their devices (DDP's start-up checks and
  ``pg._get_backend(device)`` find the real ones) and overrides every op method.
* Because the subclass goes through pybind11's trampoline (``PyProcessGroup``), C++ callers
  reach the Python overrides too: DDP's reducer all-reduces (``process_group_->allreduce``),
  ``allreduce_coalesced``, ``all_gather_single_coalesced``, ``reduce_scatter_single_coalesced``,
  ``all_to_all_single``, ``barrier``, ``broadcast``, ``allgather``, ``reduce_scatter``,
  ``send``, ``recv``. Python callers (``dist.*``, FSDP's ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``, ``batch_isend_irecv``, coalescing managers) look the method up on
  the object and reach every override, including ``all_gather_single``,
  ``reduce_scatter_single``, ``reduce``, ``gather``, ``scatter``, ``alltoall``,
  ``recv_anysource``.
* Each override records, then forwards the op to the real backend of the tensors' device
  (``ProcessGroupGloo.allreduce(...)`` …), whose binding releases the GIL while the op is
  issued. Not ``super().<op>()``: pybind11's trampoline (``WORK_OVERRIDE``) would run the
  C++ base op with the GIL held, so other Python threads stall behind a blocking op, and a
  backend thread that needs the GIL while holding its queue lock deadlocks with it (seen in
  a benchmark). If recording raises, the op is still forwarded.
* Functional collectives (``torch.distributed._functional_collectives``) resolve the group by
  name in C++ and call its virtual op methods; the object registered under that name is the
  ``RecordingProcessGroup``, so they are recorded: ``all_reduce`` as ``all_reduce``,
  ``all_gather_tensor`` as ``all_gather_into_tensor_coalesced``, ``reduce_scatter_tensor``
  as ``reduce_scatter_tensor_coalesced`` (what the trampoline receives).
* Checked by hand on 4 Gloo ranks: every ``dist.*`` collective, ``send``/``recv``,
  ``batch_isend_irecv``, ``_coalescing_manager`` (one ``allreduce_coalesced``), functional
  collectives, DDP (start-up broadcasts, reducer bucket all-reduces) and FSDP2
  ``fully_shard`` (``_all_gather_base`` / ``_reduce_scatter_base``), each with the same
  ``collective_seq_id`` as PyTorch's own recorder assigns.
* Known limits: ``batch_isend_irecv`` only groups P2P ops for plain ``ProcessGroup`` objects
  (``type(group) is ProcessGroup``), so on a recorded group each P2P op is issued on its own
  (correct, each recorded with its own ``p2p_seq_id``; NCCL then does not fuse them). A group
  whose backend is neither gloo nor nccl (mpi, ucc, xccl, a third-party plugin) is left
  unwrapped and unrecorded, with one warning.

Per op the Python part is thin (``_GroupState``, per-group constants in a slotted object):
bump the group's counter, look the shapes/dtypes up in small dicts and the call stack in the
native call-site cache (``frtools.recorder._callsite``: the frame chain walked in C, keyed by
(code object, last instruction); a Python walk when it is not built), each text interned once
in the black box's string table, one ``BlackBox.record()`` call, and completion tracking.
The usual call form ``(tensors, opts)`` goes to the backend binding as is. Measured cost:
``benchmarks/recorder_overhead.py``, docs/benchmarks.md "Recorder overhead". CPU ops: the Work is queued and a poller
thread marks it completed once ``is_completed()`` and its future holds no error (a failed
op — a dead peer — stays incomplete); a completed op also completes its group's older ones
(some Gloo works never report completion). CUDA ops: a start and an end
``torch.cuda.Event`` (the end one recorded in a ``then`` callback of the work's CUDA future,
which runs with the collective's stream as current stream, so it is ordered after the op)
handed to ``BlackBox.watch_cuda``; the native watchdog polls them without the GIL.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

from frtools.recorder.shutdown import before_finalization

BACKEND_NAME = "frtools"
_WRAPPABLE = ("gloo", "nccl")

# Op codes index this table; names are PyTorch Flight Recorder's op names (the part after
# "nccl:" / "gloo:" in its profiling names), so both kinds of trace align.
OP_NAMES = (
    "all_reduce",  # 0
    "allreduce_coalesced",  # 1
    "broadcast",  # 2
    "reduce",  # 3
    "all_gather",  # 4
    "_all_gather_base",  # 5
    "all_gather_coalesced",  # 6
    "all_gather_into_tensor_coalesced",  # 7
    "gather",  # 8
    "scatter",  # 9
    "reduce_scatter",  # 10
    "_reduce_scatter_base",  # 11
    "reduce_scatter_tensor_coalesced",  # 12
    "all_to_all",  # 13
    "all_to_all",  # 14 (list form)
    "barrier",  # 15
    "send",  # 16
    "recv",  # 17
    "recv",  # 18 (any source)
    "coalesced",  # 19
)

_STACK_DEPTH = 32


def warn_disabled(reason: str) -> None:
    """The one line a user sees when recording cannot go on; the job itself goes on."""
    from frtools.recorder import _warn

    _warn(reason)


def _dtype_name(dtype: torch.dtype) -> str:
    """PyTorch Flight Recorder's dtype spelling (c10::ScalarType names: Float, BFloat16 …)."""
    try:
        legacy = torch.empty(0, dtype=dtype).type()  # "torch.FloatTensor"
        name = legacy.rsplit(".", 1)[-1]
        if name.endswith("Tensor"):
            return name[: -len("Tensor")]
    except Exception:
        pass
    return str(dtype).replace("torch.", "")


class Recorder:
    """Everything the hooks share: the black box, the string caches, the failure switch."""

    def __init__(
        self, box: Any, cuda_events: bool = True, poll_ms: int = 10, stacks: bool = True
    ) -> None:
        self.box = box
        self.enabled = True
        self.cuda_events = cuda_events
        self._op_tables: dict[str, list[int]] = {}
        self._sizes: dict[Any, int] = {}
        self._dtypes: dict[Any, int] = {}
        self._sizes1: dict[Any, int] = {}
        self._dtypes1: dict[Any, int] = {}
        self._frames: dict[Any, str] = {}
        self._stacks: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._failed_once = False
        self._cuda_keep: list[tuple[Any, Any]] = []
        self._here = __file__
        # the calling stack's id, or -1 when not cached yet (then stack_miss() works it out)
        self._native_stacks = _stack_cache()
        self.stacks = stacks
        self.stack_lookup: Callable[[], int] = _no_stack
        self.set_stacks(stacks)
        # (rid, work) of CPU ops not known to be completed yet
        self._pending: deque[tuple[int, Any]] = deque()
        self._poll_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._poll_s = poll_ms / 1000.0
        self._stop = threading.Event()
        self._pid = os.getpid()

    def fail(self, exc: BaseException) -> None:
        """Turn recording off for the rest of the process, saying so once."""
        self.enabled = False
        if not self._failed_once:
            self._failed_once = True
            warn_disabled(f"{type(exc).__name__}: {exc}")

    def op_ids(self, backend: str) -> list[int]:
        """Interned profiling names (``gloo:all_reduce`` …) for one backend, by op code."""
        table = self._op_tables.get(backend)
        if table is None:
            table = self._op_tables[backend] = [
                self.box.intern(f"{backend}:{name}") for name in OP_NAMES
            ]
        return table

    # -- interning -------------------------------------------------------------------------

    def sizes_id(self, tensors: Any) -> tuple[int, int]:
        """(sizes id, dtypes id) for a list of tensors (or one tensor)."""
        if tensors.__class__ is list and len(tensors) == 1:  # the common case, cached apart
            t = tensors[0]
            shape, dtype = t.shape, t.dtype
            sid = self._sizes1.get(shape)
            if sid is None:
                sid = self._sizes1[shape] = self._intern_sizes((shape,))
            did = self._dtypes1.get(dtype)
            if did is None:
                did = self._dtypes1[dtype] = self._intern_dtypes((dtype,))
            return sid, did
        if isinstance(tensors, torch.Tensor):
            key = (tensors.shape,)
            dkey = (tensors.dtype,)
        else:
            key = tuple([t.shape for t in tensors])
            dkey = tuple([t.dtype for t in tensors])
        sid = self._sizes.get(key)
        if sid is None:
            sid = self._sizes[key] = self._intern_sizes(key)
        did = self._dtypes.get(dkey)
        if did is None:
            did = self._dtypes[dkey] = self._intern_dtypes(dkey)
        return sid, did

    def _intern_sizes(self, shapes: Any) -> int:
        from frtools.model.trace import sizes_key  # first sight of these shapes only

        return self.box.intern(sizes_key(shapes))

    def _intern_dtypes(self, dtypes: Any) -> int:
        from frtools.model.trace import dtypes_key

        text = dtypes_key([_dtype_name(d) for d in dtypes])
        return self.box.intern(text) if text else 0

    def nested_sizes_id(self, lists: Any) -> tuple[int, int]:
        """Shapes of a list of lists of tensors, flattened (as PyTorch's recorder does)."""
        return self.sizes_id([t for ts in lists for t in ts])

    def set_stacks(self, on: bool) -> None:
        """Record call stacks (``FRTOOLS_STACKS``) or not; switchable at any time."""
        self.stacks = on
        if not on:
            self.stack_lookup = _no_stack
        elif self._native_stacks is not None:
            self.stack_lookup = self._native_stacks.lookup
        else:
            self.stack_lookup = self._py_stack_id

    def stack_id(self) -> int:
        """The calling Python stack, innermost first, interned; frames of this module skipped."""
        sid = self.stack_lookup()
        return sid if sid >= 0 else self.stack_miss()

    def stack_miss(self) -> int:
        """First sight of a stack with the native cache: intern its text, remember its id.

        Called from this module, so the native cache walks the same frames as in lookup().
        """
        frame = sys._getframe(1)
        here = self._here
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        sid = self._intern_stack(frame)
        cache = self._native_stacks
        if cache is not None:
            cache.store(sid)
        return sid

    def _py_stack_id(self) -> int:
        """stack_lookup without the native cache (no compiler at install time).

        Keyed by a flat tuple of ints — id(code object), last instruction — cheap to build and
        hash (a code object's own hash is not). Line numbers are only worked out the first
        time a stack is seen; the code objects are kept referenced by ``_frames`` from then on,
        so their ids stay theirs.
        """
        frame = sys._getframe(1)
        here = self._here
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        top = frame
        key = []
        append = key.append
        depth = 0
        while frame is not None and depth < _STACK_DEPTH:
            append(id(frame.f_code))
            append(frame.f_lasti)
            frame = frame.f_back
            depth += 1
        tkey = tuple(key)
        sid = self._stacks.get(tkey)
        if sid is None:
            sid = self._stacks[tkey] = self._intern_stack(top)
        return sid

    def _intern_stack(self, frame: Any) -> int:
        lines = []
        frames = self._frames
        depth = 0
        while frame is not None and depth < _STACK_DEPTH:
            code, lasti = frame.f_code, frame.f_lasti
            fkey = (code, lasti)
            line = frames.get(fkey)
            if line is None:
                line = frames[fkey] = (
                    f"{code.co_filename}:{_line_of(code, lasti)} in {code.co_name}"
                )
            lines.append(line)
            frame = frame.f_back
            depth += 1
        return self.box.intern("\n".join(lines))

    # -- completion ------------------------------------------------------------------------

    def watch(self, rid: int, work: Any, tensor: Any, order: Any = None) -> None:
        """Arrange for ``rid`` to be marked completed once ``work`` is.

        ``order``: collectives of one group complete in issue order, so when one completes,
        the group's older ones are marked completed too (some Gloo works, e.g. the one of
        ``reduce_scatter_tensor``, never report completion themselves). None for P2P.

        CUDA ops: start/end events polled by the native watchdog (no GIL). CPU ops: the work
        is queued and checked with ``is_completed()`` by a poller thread every ``poll_ms``
        (completion times are discovery times, as in PyTorch's recorder). Checking in the
        caller's thread, or a ``Future.add_done_callback`` per op (Gloo's worker thread then
        takes the GIL at every completion), cost more than the recording itself.
        """
        if work is None:
            self.box.mark_completed(rid)
            return
        if self.cuda_events and tensor is not None and tensor.is_cuda:
            self._watch_cuda(rid, work)
            return
        self._pending.append((rid, work, order))
        if self._poller is None:
            self._start_poller()

    def poll(self) -> None:
        """Mark the queued works that have finished (the poller thread calls this)."""
        if not self._poll_lock.acquire(blocking=False):
            return
        try:
            pending = self._pending
            mark = self.box.mark_completed
            done_upto: dict[Any, int] = {}
            waiting = []
            for _ in range(len(pending)):
                item = pending.popleft()
                rid, work, order = item
                if work.is_completed():
                    # a failed op (a peer died, a timeout) is not "completed": leave its state
                    if _succeeded(work):
                        mark(rid)
                        if order is not None and rid > done_upto.get(order, -1):
                            done_upto[order] = rid
                else:
                    waiting.append(item)
            for item in waiting:
                if item[2] is not None and item[0] < done_upto.get(item[2], -1):
                    mark(item[0])
                else:
                    pending.append(item)
        finally:
            self._poll_lock.release()

    def _start_poller(self) -> None:
        def loop() -> None:
            while self.enabled and not self._stop.wait(self._poll_s):
                if self._pending:
                    with contextlib.suppress(Exception):
                        self.poll()

        self._poller = threading.Thread(target=loop, name="frtools-poller", daemon=True)
        self._poller.start()
        before_finalization(self._stop_poller)

    def _stop_poller(self) -> None:
        """Stop and join the poller, then mark what finished since its last pass (the job's
        last ops) and drop the queued works, all before the interpreter finalizes.

        The poller must not outlive that point: a daemon thread still running Python then is
        killed (``pthread_exit``) as soon as it takes the GIL back, and when that happens
        inside a pybind11 destructor that released the GIL (the last reference to a Work or
        a ProcessGroup, whose deallocs do) the forced unwind hits a ``noexcept`` frame and the
        process aborts: "terminate called without an active exception", exit code -6.
        """
        if os.getpid() != self._pid:
            return  # a forked child (multiprocessing runs this hook there): parent's works
        self._stop.set()
        poller = self._poller
        if poller is not None and poller is not threading.current_thread():
            poller.join(timeout=2.0)
        with contextlib.suppress(Exception):
            self.poll()
        self._pending.clear()

    def _watch_cuda(self, rid: int, work: Any) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # current stream: the collective stream waited on it, so "can start"
        end = torch.cuda.Event(enable_timing=True)
        fut = work.get_future()

        def _record_end(_: Any) -> None:
            # Runs with the collective's stream as the current stream (CUDA futures set
            # it), so this event is ordered after the collective.
            try:
                end.record()
                self.box.watch_cuda(rid, start.cuda_event, end.cuda_event)
            except Exception as exc:  # raised here it would vanish into the future
                self.fail(exc)

        fut.then(_record_end)
        # keep both events alive while the watchdog polls them
        self._cuda_keep.append((start, end))
        if len(self._cuda_keep) > 4096:
            del self._cuda_keep[:2048]


def _no_stack() -> int:
    return 0


def _stack_cache() -> Any:
    """The native call-site cache (``frtools.recorder._callsite``); None: stacks in Python."""
    try:
        from frtools.recorder._callsite import StackCache

        return StackCache(Recorder.stack_miss.__code__, _STACK_DEPTH)
    except Exception:  # not built (no compiler): the Python walk does the same, slower
        return None


def _succeeded(work: Any) -> bool:
    """Whether a completed work succeeded (``is_success()`` would print a deprecation)."""
    try:
        fut = work.get_future()
    except RuntimeError:  # no future (Gloo P2P): completion is all there is to know
        return True
    try:
        fut.value()
    except Exception:
        return False
    return True


def _line_of(code: Any, lasti: int) -> int:
    """Source line of the instruction at byte offset ``lasti`` (what ``f_lineno`` says)."""
    line = code.co_firstlineno
    for start, end, lineno in code.co_lines():
        if start <= lasti < end and lineno is not None:
            return lineno
        if start > lasti:
            break
        if lineno is not None:
            line = lineno
    return line


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _first_tensor(x: Any) -> Any:
    """The first tensor of a tensor / list / list of lists (for the device check)."""
    if x.__class__ is list and x and x[0].__class__ is not list:
        return x[0]
    while isinstance(x, list | tuple):
        if not x:
            return None
        x = x[0]
    return x if _is_tensor(x) else None


_NO: Any = object()  # "argument not given" (None can be a real argument)


def _args(lead: tuple, opts: Any, args: tuple) -> tuple:
    """Positional arguments of a forwarded call, for the rare call forms (legacy overloads)."""
    return (*lead, *args) if opts is _NO else (*lead, opts, *args)


class _GroupState:
    """One recorded group's constants and counters, and its per-op record path.

    A plain object with slots: an attribute of the pybind11 ProcessGroup subclass costs
    several times more to read, and the hot path reads a dozen per op.
    """

    __slots__ = (
        "fr",
        "box",
        "pg",
        "ops",
        "ranks",
        "coll_seq",
        "p2p_seq",
        "coalescing",
        "cpu",
        "cuda",
        "single",
        "barrier_backend",
        "maybe_cuda",
        "sizes1",
        "dtypes1",
        "order",
    )

    def __init__(self, recorder: Recorder, ops: list[int], ranks: list[int]) -> None:
        self.fr = recorder
        self.box = recorder.box
        self.pg = -1
        self.ops = ops
        self.ranks = ranks
        self.coll_seq = 0
        self.p2p_seq = 0
        self.coalescing = False
        self.cpu: Any = None
        self.cuda: Any = None
        self.single: Any = None  # the one real backend whatever the device, if only one
        self.barrier_backend: Any = None
        # a CPU-only torch build never sees a CUDA tensor: no is_cuda check per op
        self.maybe_cuda = bool(torch.backends.cuda.is_built())
        self.sizes1 = recorder._sizes1
        self.dtypes1 = recorder._dtypes1
        # the poller's key for this group's completion order: a token, not this object
        # (which holds the real backends), so that queued works never hold the last
        # reference to a process group's backends (their dealloc would run on the poller)
        self.order = object()

    def coll(self, op: int, inputs: Any, outputs: Any) -> int:
        """Record one collective; returns the record id (-1: not recorded)."""
        fr = self.fr
        if not fr.enabled:
            return -1
        try:
            if not self.coalescing:
                self.coll_seq += 1
            if inputs.__class__ is list and len(inputs) == 1:  # the common case, inline
                t = inputs[0]
                isz = self.sizes1.get(t.shape)
                idt = self.dtypes1.get(t.dtype)
                if isz is None or idt is None:
                    isz, idt = fr.sizes_id(inputs)
            else:
                isz, idt = fr.sizes_id(inputs)
            if outputs is inputs:
                osz, odt = isz, idt
            else:
                osz, odt = fr.sizes_id(outputs)
            sid = fr.stack_lookup()
            if sid < 0:
                sid = fr.stack_miss()
            return self.box.record(
                self.pg, self.ops[op], self.coll_seq, 0, -1, False, isz, osz, idt, odt, sid
            )
        except Exception as exc:
            fr.fail(exc)
            return -1

    def coll_nested(self, op: int, inputs: Any, outputs: Any) -> int:
        """coll() for ops taking lists of lists (shapes flattened, as PyTorch's recorder)."""
        if not self.fr.enabled:
            return -1
        try:
            inputs, outputs = _flatten(inputs), _flatten(outputs)
        except Exception as exc:
            self.fr.fail(exc)
            return -1
        return self.coll(op, inputs, outputs)

    def p2p(self, op: int, tensors: Any, peer: int) -> int:
        fr = self.fr
        if not fr.enabled:
            return -1
        try:
            self.p2p_seq += 1
            sz, dt = fr.sizes_id(tensors)
            ranks = self.ranks
            gpeer = ranks[peer] if 0 <= peer < len(ranks) else peer
            sid = fr.stack_lookup()
            if sid < 0:
                sid = fr.stack_miss()
            return self.box.record(
                self.pg, self.ops[op], 0, self.p2p_seq, gpeer, True, sz, sz, dt, dt, sid
            )
        except Exception as exc:
            fr.fail(exc)
            return -1

    def pick(self, tensors: Any) -> Any:
        """The real backend for these tensors' device (as ProcessGroup::getBackend picks)."""
        t = _first_tensor(tensors)
        if t is not None and t.is_cuda:
            return self.cuda or self.cpu
        return self.cpu or self.cuda

    def done(self, rid: int, work: Any, tensors: Any, order: bool = True) -> None:
        """Completion tracking for record ``rid`` (Recorder.watch, inlined for the hot path)."""
        fr = self.fr
        try:
            if work is None:
                fr.box.mark_completed(rid)
                return
            if self.maybe_cuda and fr.cuda_events:
                t = _first_tensor(tensors)
                if t is not None and t.is_cuda:
                    fr._watch_cuda(rid, work)
                    return
            fr._pending.append((rid, work, self.order if order else None))
            if fr._poller is None:
                fr._start_poller()
        except Exception as exc:
            fr.fail(exc)


class RecordingProcessGroup(ProcessGroup):
    """A ProcessGroup that records each op in the black box and forwards it unchanged."""

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
        self._fr = recorder
        self._fr_backend_name = backend_name
        prefix = "nccl" if any(b[1] == ProcessGroup.BackendType.NCCL for b in backends) else "gloo"
        st = self._frs = _GroupState(recorder, recorder.op_ids(prefix), global_ranks)
        self._fr_real = {}
        first_type = None
        for device, backend_type, backend in backends:
            self._register_backend(torch.device(device), backend_type, backend)
            self._fr_real[device] = backend
            first_type = first_type or backend_type
        if first_type is not None:
            self._set_default_backend(first_type)
        st.cpu = self._fr_real.get("cpu")
        st.cuda = self._fr_real.get("cuda")
        if st.cpu is None or st.cuda is None or st.cpu is st.cuda:
            st.single = st.cpu or st.cuda
        st.barrier_backend = (
            st.cuda
            if any(b[1] == ProcessGroup.BackendType.NCCL for b in backends)
            else (st.cpu or st.cuda)
        )

    def getBackendName(self) -> str:  # noqa: N802 - C++ virtual name
        return self._fr_backend_name

    def name(self) -> str:
        return self._fr_backend_name

    def _fr_register(self, name: str, desc: str) -> None:
        st = self._frs
        st.pg = st.box.add_process_group(name, desc, st.ranks)

    # -- collectives -----------------------------------------------------------------------
    # Each op records (one call into _GroupState), then goes straight to the real backend's
    # binding, which releases the GIL while the op is issued. (``super().<op>()`` would reach
    # the C++ base through pybind11's trampoline, which holds the GIL for the whole op.) A
    # call form the backend binding does not accept (legacy overloads) raises TypeError before
    # anything is issued and takes the group's own path instead.
    def allreduce(self, tensors, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(0, tensors, tensors)
        try:
            backend = st.single or st.pick(tensors)
            if opts is _NO or args or kwargs:
                work = backend.allreduce(*_args((tensors,), opts, args), **kwargs)
            else:
                work = backend.allreduce(tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().allreduce(*_args((tensors,), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors)
        return work

    def allreduce_coalesced(self, tensors, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(1, tensors, tensors)
        try:
            backend = st.single or st.pick(tensors)
            if opts is _NO or args or kwargs:
                work = backend.allreduce_coalesced(*_args((tensors,), opts, args), **kwargs)
            else:
                work = backend.allreduce_coalesced(tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().allreduce_coalesced(*_args((tensors,), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors)
        return work

    def broadcast(self, tensors, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(2, tensors, tensors)
        try:
            backend = st.single or st.pick(tensors)
            if opts is _NO or args or kwargs:
                work = backend.broadcast(*_args((tensors,), opts, args), **kwargs)
            else:
                work = backend.broadcast(tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().broadcast(*_args((tensors,), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors)
        return work

    def reduce(self, tensors, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(3, tensors, tensors)
        try:
            backend = st.single or st.pick(tensors)
            if opts is _NO or args or kwargs:
                work = backend.reduce(*_args((tensors,), opts, args), **kwargs)
            else:
                work = backend.reduce(tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().reduce(*_args((tensors,), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors)
        return work

    def allgather(
        self, output_lists, input_tensors, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(4, input_tensors, output_lists)
        try:
            backend = st.single or st.pick(input_tensors)
            if opts is _NO or args or kwargs:
                work = backend.allgather(
                    *_args((output_lists, input_tensors), opts, args), **kwargs
                )
            else:
                work = backend.allgather(output_lists, input_tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().allgather(*_args((output_lists, input_tensors), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input_tensors)
        return work

    def all_gather_single(self, output, input, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(5, input, output)
        try:
            backend = st.single or st.pick(input)
            if opts is _NO or args or kwargs:
                work = backend._allgather_base(*_args((output, input), opts, args), **kwargs)
            else:
                work = backend._allgather_base(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().all_gather_single(*_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    def _allgather_base(self, output, input, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(5, input, output)
        try:
            backend = st.single or st.pick(input)
            if opts is _NO or args or kwargs:
                work = backend._allgather_base(*_args((output, input), opts, args), **kwargs)
            else:
                work = backend._allgather_base(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super()._allgather_base(*_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    def allgather_coalesced(
        self, output_lists, input_tensors, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(6, input_tensors, output_lists)
        try:
            backend = st.single or st.pick(input_tensors)
            if opts is _NO or args or kwargs:
                work = backend.allgather_coalesced(
                    *_args((output_lists, input_tensors), opts, args), **kwargs
                )
            else:
                work = backend.allgather_coalesced(output_lists, input_tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().allgather_coalesced(
                *_args((output_lists, input_tensors), opts, args), **kwargs
            )
        if rid >= 0:
            st.done(rid, work, input_tensors)
        return work

    def all_gather_single_coalesced(
        self, outputs, inputs, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll(7, inputs, outputs)
        try:
            backend = st.single or st.pick(inputs)
            if opts is _NO or args or kwargs:
                work = backend.allgather_into_tensor_coalesced(
                    *_args((outputs, inputs), opts, args), **kwargs
                )
            else:
                work = backend.allgather_into_tensor_coalesced(outputs, inputs, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().all_gather_single_coalesced(
                *_args((outputs, inputs), opts, args), **kwargs
            )
        if rid >= 0:
            st.done(rid, work, inputs)
        return work

    def gather(
        self, output_lists, input_tensors, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(8, input_tensors, output_lists)
        try:
            backend = st.single or st.pick(input_tensors)
            if opts is _NO or args or kwargs:
                work = backend.gather(*_args((output_lists, input_tensors), opts, args), **kwargs)
            else:
                work = backend.gather(output_lists, input_tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().gather(*_args((output_lists, input_tensors), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input_tensors)
        return work

    def scatter(
        self, output_tensors, input_lists, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(9, input_lists, output_tensors)
        try:
            backend = st.single or st.pick(output_tensors)
            if opts is _NO or args or kwargs:
                work = backend.scatter(*_args((output_tensors, input_lists), opts, args), **kwargs)
            else:
                work = backend.scatter(output_tensors, input_lists, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().scatter(*_args((output_tensors, input_lists), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, output_tensors)
        return work

    def reduce_scatter(
        self, output_tensors, input_lists, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(10, input_lists, output_tensors)
        try:
            backend = st.single or st.pick(output_tensors)
            if opts is _NO or args or kwargs:
                work = backend.reduce_scatter(
                    *_args((output_tensors, input_lists), opts, args), **kwargs
                )
            else:
                work = backend.reduce_scatter(output_tensors, input_lists, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().reduce_scatter(
                *_args((output_tensors, input_lists), opts, args), **kwargs
            )
        if rid >= 0:
            st.done(rid, work, output_tensors)
        return work

    def reduce_scatter_single(
        self, output, input, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll(11, input, output)
        try:
            backend = st.single or st.pick(input)
            if opts is _NO or args or kwargs:
                work = backend._reduce_scatter_base(*_args((output, input), opts, args), **kwargs)
            else:
                work = backend._reduce_scatter_base(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().reduce_scatter_single(*_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    def _reduce_scatter_base(
        self, output, input, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll(11, input, output)
        try:
            backend = st.single or st.pick(input)
            if opts is _NO or args or kwargs:
                work = backend._reduce_scatter_base(*_args((output, input), opts, args), **kwargs)
            else:
                work = backend._reduce_scatter_base(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super()._reduce_scatter_base(*_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    def reduce_scatter_single_coalesced(
        self, outputs, inputs, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll(12, inputs, outputs)
        try:
            backend = st.single or st.pick(inputs)
            if opts is _NO or args or kwargs:
                work = backend.reduce_scatter_tensor_coalesced(
                    *_args((outputs, inputs), opts, args), **kwargs
                )
            else:
                work = backend.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().reduce_scatter_single_coalesced(
                *_args((outputs, inputs), opts, args), **kwargs
            )
        if rid >= 0:
            st.done(rid, work, inputs)
        return work

    def all_to_all_single(self, output, input, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(13, input, output)
        try:
            backend = st.single or st.pick(input)
            if opts is _NO or args or kwargs:
                work = backend.alltoall_base(*_args((output, input), opts, args), **kwargs)
            else:
                work = backend.alltoall_base(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().all_to_all_single(*_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    def alltoall(
        self, output_tensors, input_tensors, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll(14, input_tensors, output_tensors)
        try:
            backend = st.single or st.pick(input_tensors)
            if opts is _NO or args or kwargs:
                work = backend.alltoall(
                    *_args((output_tensors, input_tensors), opts, args), **kwargs
                )
            else:
                work = backend.alltoall(output_tensors, input_tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().alltoall(*_args((output_tensors, input_tensors), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input_tensors)
        return work

    def barrier(self, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(15, (), ())
        try:
            backend = st.barrier_backend
            if opts is _NO or args or kwargs:
                work = backend.barrier(*_args((), opts, args), **kwargs)
            else:
                work = backend.barrier(opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().barrier(*_args((), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, None)
        return work

    # -- point to point --------------------------------------------------------------------

    def send(self, tensors: Any, dst: int, tag: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.p2p(16, tensors, dst)
        try:
            backend = st.single or st.pick(tensors)
            if tag is _NO or args or kwargs:
                work = backend.send(*_args((tensors, dst), tag, args), **kwargs)
            else:
                work = backend.send(tensors, dst, tag)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().send(*_args((tensors, dst), tag, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors, False)
        return work

    def recv(self, tensors: Any, src: int, tag: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.p2p(17, tensors, src)
        try:
            backend = st.single or st.pick(tensors)
            if tag is _NO or args or kwargs:
                work = backend.recv(*_args((tensors, src), tag, args), **kwargs)
            else:
                work = backend.recv(tensors, src, tag)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().recv(*_args((tensors, src), tag, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors, False)
        return work

    def recv_anysource(self, tensors: Any, tag: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.p2p(18, tensors, -1)
        try:
            backend = st.single or st.pick(tensors)
            if tag is _NO or args or kwargs:
                work = backend.recv_anysource(*_args((tensors,), tag, args), **kwargs)
            else:
                work = backend.recv_anysource(tensors, tag)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = super().recv_anysource(*_args((tensors,), tag, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors, False)
        return work

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


def _flatten(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x,)
    out = []
    for item in x:
        if isinstance(item, list | tuple):
            out.extend(item)
        else:
            out.append(item)
    return out


# --------------------------------------------------------------------------------------
# Redirecting group creation
# --------------------------------------------------------------------------------------

_state = threading.local()
_installed: dict[str, Any] = {}


def _real_backend_map(backend: Any) -> dict[str, str] | None:
    """device -> backend the user asked for; None when it is not one we can wrap."""
    try:
        mapping = c10d.BackendConfig(c10d.Backend(str(backend))).get_device_backend_map()
    except Exception:
        return None
    result = {dev: str(b).lower() for dev, b in mapping.items()}
    if not result or any(b not in _WRAPPABLE for b in result.values()):
        return None
    return result


def _make_backend(
    backend_str: str,
    device: str,
    store: Any,
    rank: int,
    size: int,
    timeout: Any,
    opts: Any,
    pending: dict[str, Any],
) -> tuple[Any, Any]:
    """Build a real backend the way ``_new_process_group_helper`` does."""
    ranks = list(opts.global_ranks_in_group)
    group_name = opts.group_id
    if backend_str == "gloo":
        backend = c10d.ProcessGroupGloo(store, rank, size, timeout=timeout)
        backend.options.global_ranks_in_group = ranks
        backend.options.group_name = group_name
        backend._set_sequence_number_for_group()
        return ProcessGroup.BackendType.GLOO, backend
    options = pending.get("backend_options")
    if options is None:
        options = c10d.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    options._timeout = timeout
    split_from = pending.get("split_from")
    if split_from is not None:
        options.split_from = split_from
        options.split_color = c10d._process_group_color(ranks)
    options.global_ranks_in_group = ranks
    options.group_name = group_name
    backend = c10d.ProcessGroupNCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    return ProcessGroup.BackendType.NCCL, backend


def _create(dist_opts: Any, backend_options: Any) -> Any:
    """The ``frtools`` backend creator: real backends inside a RecordingProcessGroup."""
    pending = getattr(_state, "pending", None)
    if pending is None:
        raise RuntimeError("the frtools backend is only used through frtools.recorder.enable()")
    pending["backend_options"] = backend_options
    store = dist_opts.store
    rank, size, timeout = dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout
    backends = []
    made: dict[str, tuple[Any, Any]] = {}
    for device, backend_str in pending["map"].items():
        if backend_str not in made:
            sub_store = c10d.PrefixStore(f"{backend_str}/", store)
            made[backend_str] = _make_backend(
                backend_str, device, sub_store, rank, size, timeout, dist_opts, pending
            )
        backend_type, backend = made[backend_str]
        backends.append((device, backend_type, backend))
    ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    pg = RecordingProcessGroup(
        store, rank, size, pending["recorder"], backends, ranks, pending["backend_name"]
    )
    pending["pg"] = pg
    return pg


def _recorder_for(group_rank: int, group_size: int, is_default: bool, backend: str) -> Any:
    """The process's Recorder, opened at the first group it creates (None: not recording)."""
    recorder = _installed.get("recorder")
    if recorder is not None or _installed.get("open_failed"):
        return recorder
    opener = _installed.get("opener")
    if opener is None:
        return None
    if is_default:
        rank, world_size = group_rank, group_size
    else:  # enabled after init_process_group: the default group exists, unrecorded
        rank, world_size = c10d.get_rank(), c10d.get_world_size()
    recorder = opener(rank, world_size, backend)
    if recorder is None:
        _installed["open_failed"] = True
    _installed["recorder"] = recorder
    return recorder


def _prepare(
    group_size: int,
    group_rank: int,
    global_ranks_in_group: list[int],
    backend: Any,
    group_name: Any,
) -> dict[str, Any] | None:
    """What the ``frtools`` creator needs to build this group; None: create it plainly."""
    if _installed.get("paused"):
        return None
    mapping = _real_backend_map(backend)
    if mapping is None:
        warnings.warn(
            f"frtools: process group {group_name!r} with backend {str(backend)!r} is not "
            "recorded (only gloo and nccl are)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    try:
        recorder = _recorder_for(group_rank, group_size, not global_ranks_in_group, str(backend))
    except Exception as exc:
        _installed["open_failed"] = True
        warn_disabled(f"{type(exc).__name__}: {exc}")
        return None
    if recorder is None or not recorder.enabled:
        return None
    pending: dict[str, Any] = {"map": mapping, "backend_name": str(backend), "recorder": recorder}
    if c10d.is_initialized() and c10d._get_default_group().bound_device_id:
        try:
            pending["split_from"] = c10d._get_split_source(c10d._get_default_group())
        except Exception:
            pending["split_from"] = None
    return pending


def _wrapped_helper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _new_process_group_helper(
        group_size: int,
        group_rank: int,
        global_ranks_in_group: list[int],
        backend: Any,
        store: Any,
        group_name: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def plain() -> Any:
            return original(
                group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                *args, **kwargs,
            )  # fmt: skip

        try:
            pending = _prepare(group_size, group_rank, global_ranks_in_group, backend, group_name)
        except Exception as exc:  # a recorder bug must not stop group creation
            _installed["open_failed"] = True
            warn_disabled(f"{type(exc).__name__}: {exc}")
            pending = None
        if pending is None:
            return plain()
        recorder = pending["recorder"]
        _state.pending = pending
        try:
            pg, prefix_store = original(
                group_size, group_rank, global_ranks_in_group, BACKEND_NAME, store, group_name,
                *args, **kwargs,
            )  # fmt: skip
        except Exception as exc:
            # building the wrapped group failed: the user's group, plainly, is what matters
            recorder.fail(exc)
            _installed["paused"] = True
            return plain()
        finally:
            _state.pending = None
        if isinstance(pg, RecordingProcessGroup):
            device_id = kwargs.get("device_id", args[3] if len(args) > 3 else None)
            if device_id is not None and pg.bound_device_id is None:
                pg.bound_device_id = device_id  # set on the helper's own pg object, not ours
            world = c10d._world
            world.pg_map[pg] = (backend, prefix_store)
            world.pg_backend_config[pg] = str(c10d.BackendConfig(c10d.Backend(str(backend))))
            try:
                pg._fr_register(str(pg.group_name), str(pg.group_desc))
            except Exception as exc:
                recorder.fail(exc)
        return pg, prefix_store

    _new_process_group_helper.__wrapped__ = original  # type: ignore[attr-defined]
    return _new_process_group_helper


def install(opener: Callable[[int, int, str], Recorder | None]) -> None:
    """Route every process group created from now on through a RecordingProcessGroup.

    ``opener(rank, world_size, backend)`` is called once, at the first group this process
    creates, and returns the Recorder (or None after warning: the job goes on unrecorded).
    """
    _installed["opener"] = opener
    _installed["paused"] = False
    if "original" in _installed:
        return
    if BACKEND_NAME.upper() not in c10d.Backend._plugins:
        c10d.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    _installed["original"] = c10d._new_process_group_helper
    c10d._new_process_group_helper = _wrapped_helper(c10d._new_process_group_helper)


def current_recorder() -> Recorder | None:
    return _installed.get("recorder")


def uninstall() -> None:
    """Stop recording: existing groups stop recording, new groups are plain ones."""
    recorder = _installed.get("recorder")
    if recorder is not None:
        recorder.enabled = False
    _installed["paused"] = True
