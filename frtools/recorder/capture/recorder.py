"""The Recorder: what every recorded group of a process shares — the black box, the interned
texts (op names, shapes, dtypes; call stacks through ``CallSites``), the failure switch and
the completion poller.

CPU ops: each group's ``done`` queues the Work in ``pending``; a poller thread marks it
completed once ``is_completed()`` and its future holds no error, or failed
(``BlackBox.mark_failed``, with the backend's error text: a dead peer, a timeout) when it
holds one; a completed op also completes its group's older ones (some Gloo works never
report completion), never a failed one. CUDA ops: a start and an end ``torch.cuda.Event`` (the end one
recorded in a ``then`` callback of the work's CUDA future, which runs with the collective's
stream as current stream, so it is ordered after the op) handed to ``BlackBox.watch_cuda``;
the native watchdog polls them without the GIL. A future that ends in an error marks the op
failed instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from typing import Any

import torch

from frtools.recorder.capture.hot_path import CallSites
from frtools.recorder.notices import recording_disabled
from frtools.recorder.shutdown import before_finalization


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


def error_text(exc: BaseException) -> str:
    """A failed op's error as the backend said it (Gloo: ``[…/pair.cc:561] Connection closed
    by peer …``, ``Timed out waiting 4000ms for recv operation to complete``)."""
    return str(exc) or type(exc).__name__


def _failure(work: Any) -> str | None:
    """The error of a completed work; None when it succeeded or cannot tell (a Gloo P2P work
    has no future, and ``exception()``/``is_success()`` print a deprecation)."""
    try:
        fut = work.get_future()
    except RuntimeError:  # no future (Gloo P2P): completion is all there is to know
        return None
    try:
        fut.value()
    except Exception as exc:
        return error_text(exc)
    return None


class Recorder:
    """Everything the hooks share: the black box, the string caches, the failure switch.

    Read by each group's hot path (``GroupState``): ``enabled``, ``box``,
    ``stack_lookup``/``stack_miss`` (``CallSites``), ``sizes1``/``dtypes1`` (the one-tensor
    caches, read inline), ``cuda_events``, ``pending`` (CPU works the poller checks) and
    ``poller`` (None until the first CPU op).
    """

    def __init__(
        self, box: Any, cuda_events: bool = True, poll_ms: int = 10, stacks: bool = True
    ) -> None:
        self.box = box
        self.enabled = True
        self.cuda_events = cuda_events
        self.call_sites = CallSites(box.intern)
        # the calling stack's id (-1: not seen yet; then stack_miss() from the same place)
        self.stack_miss = self.call_sites.miss
        self.stack_lookup = self.call_sites.lookup_for(stacks)
        self.sizes1: dict[Any, int] = {}
        self.dtypes1: dict[Any, int] = {}
        self._sizes: dict[Any, int] = {}
        self._dtypes: dict[Any, int] = {}
        self._op_tables: dict[str, list[int]] = {}
        self._failed_once = False
        self._cuda_keep: list[tuple[Any, Any]] = []
        # (rid, work, order token or None) of CPU ops not known to be completed yet
        self.pending: deque[tuple[int, Any, Any]] = deque()
        self.poller: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        self._poll_s = poll_ms / 1000.0
        self._stop = threading.Event()
        self._pid = os.getpid()
        # the C++ hook body's side of this recorder: (module, body), False: not used
        self._native: Any = None

    def native_body(self) -> tuple[Any, Any] | None:
        """(module, native Recorder) of the C++ hook body (``native_hooks``), made at the
        first hooked group; None where it is not built or cannot be used (the Python hooks
        record then; said once)."""
        if self._native is None:
            self._native = False
            from frtools.recorder import native_hooks

            module = native_hooks.load()
            if module is not None:
                try:
                    body = native_hooks.recorder_body(self, module)
                except Exception as exc:
                    native_hooks.unusable(exc)
                else:
                    self._native = (module, body)
                    before_finalization(body.final_poll)
        return self._native or None

    def fail(self, exc: BaseException) -> None:
        """Turn recording off for the rest of the process, saying so once."""
        self.pause()
        if not self._failed_once:
            self._failed_once = True
            recording_disabled(f"{type(exc).__name__}: {exc}")

    def set_stacks(self, on: bool) -> None:
        """Record call stacks (``FRTOOLS_STACKS``) or not; switchable at any time."""
        self.stack_lookup = self.call_sites.lookup_for(on)
        if self._native:
            self._native[1].set_stacks(on)

    def pause(self) -> None:
        """Record nothing more (``uninstall``): the Python and the C++ hook bodies."""
        self.enabled = False
        if self._native:
            self._native[1].set_enabled(False)

    # -- interning -------------------------------------------------------------------------

    def op_ids(self, backend: str, op_names: tuple[str, ...]) -> list[int]:
        """Interned profiling names (``gloo:all_reduce`` …) for one backend, by op code."""
        table = self._op_tables.get(backend)
        if table is None:
            table = self._op_tables[backend] = [
                self.box.intern(f"{backend}:{name}") for name in op_names
            ]
        return table

    def sizes_id(self, tensors: Any) -> tuple[int, int]:
        """(sizes id, dtypes id) for a list of tensors (or one tensor)."""
        if tensors.__class__ is list and len(tensors) == 1:  # the common case, cached apart
            t = tensors[0]
            shape, dtype = t.shape, t.dtype
            sid = self.sizes1.get(shape)
            if sid is None:
                sid = self.sizes1[shape] = self._intern_sizes((shape,))
            did = self.dtypes1.get(dtype)
            if did is None:
                did = self.dtypes1[dtype] = self._intern_dtypes((dtype,))
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
        # imported at first sight of a shape: frtools.model.trace brings pyarrow
        from frtools.model.trace import sizes_key

        return self.box.intern(sizes_key(shapes))

    def _intern_dtypes(self, dtypes: Any) -> int:
        from frtools.model.trace import dtypes_key

        text = dtypes_key([_dtype_name(d) for d in dtypes])
        return self.box.intern(text) if text else 0

    # -- completion ------------------------------------------------------------------------

    def poll(self) -> None:
        """Mark the queued works that have finished (the poller thread calls this; the C++
        hook body's queue has its own poller, passed here too)."""
        if self._native:
            self._native[1].poll()
        if not self._poll_lock.acquire(blocking=False):
            return
        try:
            pending = self.pending
            mark = self.box.mark_completed
            done_upto: dict[Any, int] = {}
            waiting = []
            for _ in range(len(pending)):
                item = pending.popleft()
                rid, work, order = item
                if work.is_completed():
                    # a failed op (a peer died, a timeout) is not "completed": it is failed
                    error = _failure(work)
                    if error is None:
                        mark(rid)
                        if order is not None and rid > done_upto.get(order, -1):
                            done_upto[order] = rid
                    else:
                        self.box.mark_failed(rid, error)
                else:
                    waiting.append(item)
            for item in waiting:
                if item[2] is not None and item[0] < done_upto.get(item[2], -1):
                    mark(item[0])
                else:
                    pending.append(item)
        finally:
            self._poll_lock.release()

    def start_poller(self) -> None:
        """Start the thread that checks ``pending`` every ``poll_ms`` (at the first CPU op)."""

        def loop() -> None:
            while self.enabled and not self._stop.wait(self._poll_s):
                if self.pending:
                    with contextlib.suppress(Exception):
                        self.poll()

        self.poller = threading.Thread(target=loop, name="frtools-poller", daemon=True)
        self.poller.start()
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
        poller = self.poller
        if poller is not None and poller is not threading.current_thread():
            poller.join(timeout=2.0)
        with contextlib.suppress(Exception):
            self.poll()
        self.pending.clear()

    def watch_cuda(self, rid: int, work: Any) -> None:
        """Hand a CUDA op's start and end events to the native watchdog."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # current stream: the collective stream waited on it, so "can start"
        end = torch.cuda.Event(enable_timing=True)
        fut = work.get_future()

        def _record_end(done: Any) -> None:
            # Runs with the collective's stream as the current stream (CUDA futures set
            # it), so this event is ordered after the collective.
            try:
                try:
                    done.value()
                except Exception as exc:  # NCCL error, timeout, abort: failed, not completed
                    self.box.mark_failed(rid, error_text(exc))
                    return
                end.record()
                self.box.watch_cuda(rid, start.cuda_event, end.cuda_event)
            except Exception as exc:  # raised here it would vanish into the future
                self.fail(exc)

        fut.then(_record_end)
        # keep both events alive while the watchdog polls them
        self._cuda_keep.append((start, end))
        if len(self._cuda_keep) > 4096:
            del self._cuda_keep[:2048]
