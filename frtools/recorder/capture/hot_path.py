"""What runs on every op: record it, forward it to the real backend, track its completion.

* ``GroupState`` — one recorded group's constants and counters in a slotted object (an
  attribute of the pybind11 ProcessGroup subclass costs several times more to read, and the
  hot path reads a dozen per op), with the per-op record (``coll``, ``coll_nested``, ``p2p``)
  and completion (``done``) steps.
* ``make_override`` — the body of each ProcessGroup op method, one template per argument
  shape; ``process_group`` builds the 21 overrides from its table with it.
* ``CallSites`` — the calling Python stack of an op as an interned id.

Frames of this module are frtools' own. The call-site walk skips the innermost frames whose
code lives in this file — the native cache (``frtools.recorder._callsite``) takes one file
to skip, and the Python walk does the same — so everything on the stack when a call site is
looked up (the overrides, the record methods, the miss path) is defined here.

Each override records, then forwards the op to the real backend of the tensors' device
(``ProcessGroupGloo.allreduce(...)`` …), whose binding releases the GIL while the op is
issued. Not the ProcessGroup base method: pybind11's trampoline (``WORK_OVERRIDE``) would run
the C++ base op with the GIL held, so other Python threads stall behind a blocking op, and a
backend thread that needs the GIL while holding its queue lock deadlocks with it (seen in a
benchmark). A call form the backend binding does not accept (legacy overloads) raises
TypeError before anything is issued and takes the base method instead. If recording raises,
the op is still forwarded.
"""

from __future__ import annotations

import enum
import functools
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from frtools.formats.blackbox import splits_text

STACK_DEPTH = 32

_NO: Any = object()  # "argument not given" (None can be a real argument)


def _args(lead: tuple, opts: Any, args: tuple) -> tuple:
    """Positional arguments of a forwarded call, for the rare call forms (legacy overloads)."""
    return (*lead, *args) if opts is _NO else (*lead, opts, *args)


def _first_tensor(x: Any) -> Any:
    """The first tensor of a tensor / list / list of lists (for the device check)."""
    if x.__class__ is list and x and x[0].__class__ is not list:
        return x[0]
    while isinstance(x, list | tuple):
        if not x:
            return None
        x = x[0]
    return x if isinstance(x, torch.Tensor) else None


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


def split_counts(tensor: Any, splits: Any, members: int) -> list[int] | None:
    """Elements an ``all_to_all_single`` tensor holds for each member: its dim-0 split sizes
    (rows) times the elements of a row; with no sizes given, the even split torch makes.
    None where there is no such split (a 0-d tensor, rows not divisible by the group)."""
    shape = tensor.shape
    if not len(shape):
        return None
    row = math.prod(shape[1:])
    if splits:
        return [int(s) * row for s in splits]
    if members > 0 and shape[0] % members == 0:
        return [shape[0] // members * row] * members
    return None


# --------------------------------------------------------------------------------------
# Call sites
# --------------------------------------------------------------------------------------


def _no_stack() -> int:
    return 0


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


class CallSites:
    """The calling Python stack of an op, innermost first, frames of this module skipped, as
    an id in the black box's string table: ``lookup()`` (-1: not seen yet) then, on a miss,
    ``miss()`` from the same place.

    ``lookup_for(on)`` is the native call-site cache's lookup (the frame chain walked in C,
    keyed by (code object, last instruction)), or a Python walk when it is not built, or a
    constant 0 with stacks off (``FRTOOLS_STACKS=0``).
    """

    __slots__ = ("_intern_text", "_lines", "_py_stacks", "_native")

    def __init__(self, intern: Callable[[str], int]) -> None:
        self._intern_text = intern
        self._lines: dict[Any, str] = {}  # (code, lasti) -> "file:line in name"
        self._py_stacks: dict[tuple, int] = {}
        self._native = _native_cache()

    def lookup_for(self, on: bool) -> Callable[[], int]:
        """The lookup to use with stacks on or off."""
        if not on:
            return _no_stack
        if self._native is not None:
            return self._native.lookup
        return self._py_lookup

    def miss(self) -> int:
        """First sight of a stack with the native cache: intern its text, remember its id.

        Called from this module, so the native cache walks the same frames as in lookup().
        """
        frame = sys._getframe(1)
        here = __file__
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        sid = self._intern(frame)
        native = self._native
        if native is not None:
            native.store(sid)
        return sid

    def _py_lookup(self) -> int:
        """lookup() without the native cache (no compiler at install time).

        Keyed by a flat tuple of ints — id(code object), last instruction — cheap to build and
        hash (a code object's own hash is not). Line numbers are only worked out the first
        time a stack is seen; the code objects are kept referenced by ``_lines`` from then on,
        so their ids stay theirs.
        """
        frame = sys._getframe(1)
        here = __file__
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        top = frame
        key = []
        append = key.append
        depth = 0
        while frame is not None and depth < STACK_DEPTH:
            append(id(frame.f_code))
            append(frame.f_lasti)
            frame = frame.f_back
            depth += 1
        tkey = tuple(key)
        sid = self._py_stacks.get(tkey)
        if sid is None:
            sid = self._py_stacks[tkey] = self._intern(top)
        return sid

    def _intern(self, frame: Any) -> int:
        lines = []
        known = self._lines
        depth = 0
        while frame is not None and depth < STACK_DEPTH:
            code, lasti = frame.f_code, frame.f_lasti
            key = (code, lasti)
            line = known.get(key)
            if line is None:
                line = known[key] = f"{code.co_filename}:{_line_of(code, lasti)} in {code.co_name}"
            lines.append(line)
            frame = frame.f_back
            depth += 1
        return self._intern_text("\n".join(lines))


def _native_cache() -> Any:
    """The native call-site cache, skipping this module's frames; None: stacks in Python."""
    try:
        from frtools.recorder._callsite import StackCache

        return StackCache(CallSites.miss.__code__, STACK_DEPTH)
    except Exception:  # not built (no compiler): the Python walk does the same, slower
        return None


# --------------------------------------------------------------------------------------
# One group's record and completion steps
# --------------------------------------------------------------------------------------


class GroupState:
    """One recorded group's constants and counters, and its per-op record path."""

    __slots__ = (
        "fr",
        "box",
        "pending",
        "pg",
        "ops",
        "ranks",
        "coll_seq",
        "p2p_seq",
        "coalescing",
        "cpu",
        "cuda",
        "single",
        "issue",
        "barrier_backend",
        "maybe_cuda",
        "sizes1",
        "dtypes1",
        "order",
        "name",
        "desc",
        "windows",
    )

    def __init__(self, recorder: Any, ops: list[int], ranks: list[int]) -> None:
        """``recorder``: the process's ``Recorder`` (not imported here: it imports this)."""
        self.fr = recorder
        self.box = recorder.box
        self.pending = recorder.pending
        self.pg = -1  # index in the black box's process-group table, once registered
        self.ops = ops  # interned "<backend>:<op>" names, by op code
        self.ranks = ranks
        self.coll_seq = 0
        self.p2p_seq = 0
        self.coalescing = False
        self.cpu: Any = None
        self.cuda: Any = None
        self.single: Any = None  # the one real backend whatever the device, if only one
        # by op table row: that backend's binding issuing the op, resolved once (None: no
        # single backend, or not in its binding)
        self.issue: list[Any] = []
        self.barrier_backend: Any = None
        # a CPU-only torch build never sees a CUDA tensor: no is_cuda check per op
        self.maybe_cuda = bool(torch.backends.cuda.is_built())
        self.sizes1 = recorder.sizes1
        self.dtypes1 = recorder.dtypes1
        # the poller's key for this group's completion order: a token, not this object
        # (which holds the real backends), so that queued works never hold the last
        # reference to a process group's backends (their dealloc would run on the poller)
        self.order = object()
        self.name = ""
        self.desc = ""
        self.windows = 0  # one-sided windows created on the group

    def bind(self, name: str, desc: str, ranks: list[int]) -> None:
        """The group's name, description and members, once known: its row in the black
        box's process-group table. A row of its own even where its name has one: a job that
        destroys its groups and initializes again in the process (an in-process restart)
        gets the same names again, and the reader tells the instances apart by row."""
        if self.pg >= 0:
            return  # bound already
        self.name, self.desc, self.ranks = name, desc, ranks
        self.pg = self.box.add_process_group(name, desc, ranks, True)

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

    def splits(self, output: Any, input: Any, out_splits: Any, in_splits: Any) -> bool:
        """Hand an all_to_all's split sizes (elements per member, sent and received) to this
        thread's next record, the op's own; True where handed. Tensors
        (``all_to_all_single``) are split by ``*_splits``; lists (``all_to_all``) hold one
        tensor per member. Only all_to_all pays for this. A split the recorder cannot read
        leaves the op without splits: the call itself is torch's to judge."""
        if not self.fr.enabled:
            return False
        try:
            if output.__class__ is list:
                ins = [t.numel() for t in input]
                outs = [t.numel() for t in output]
            else:
                n = len(self.ranks)
                ins = split_counts(input, in_splits, n)
                outs = split_counts(output, out_splits, n)
            if ins is None or outs is None:
                return False
            self.box.pend_splits(splits_text(ins, outs))
            return True
        except Exception:  # noqa: BLE001 - the op is recorded without its splits
            return False

    def p2p(self, op: int, tensors: Any, peer: int) -> int:
        """Record one send/recv; ``peer`` is group-local (-1: any source)."""
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
        """Arrange for record ``rid`` to be marked completed once ``work`` is.

        ``order``: collectives of one group complete in issue order, so when one completes,
        the group's older ones are marked completed too (some Gloo works, e.g. the one of
        ``reduce_scatter_tensor``, never report completion themselves). False for P2P.

        CUDA ops: start/end events polled by the native watchdog (no GIL). CPU ops: the work
        is queued for the Recorder's poller thread (completion times are discovery times, as
        in PyTorch's recorder). Checking in the caller's thread, or a
        ``Future.add_done_callback`` per op (Gloo's worker thread then takes the GIL at every
        completion), cost more than the recording itself.
        """
        fr = self.fr
        try:
            if work is None:
                self.box.mark_completed(rid)
                return
            if self.maybe_cuda and fr.cuda_events:
                t = _first_tensor(tensors)
                if t is not None and t.is_cuda:
                    fr.watch_cuda(rid, work)
                    return
            self.pending.append((rid, work, self.order if order else None))
            if fr.poller is None:
                fr.start_poller()
        except Exception as exc:
            fr.fail(exc)


# --------------------------------------------------------------------------------------
# The op overrides: one template per argument shape
# --------------------------------------------------------------------------------------


class ArgShape(enum.Enum):
    """Where an op method's tensors and peer are, and which tensors are its input."""

    TENSORS = "(tensors, opts): in place"  # allreduce, broadcast, reduce
    OUT_IN = "(output, input, opts)"  # _allgather_base, reduce_scatter_single …
    # all_to_all_single (output, input, output splits, input splits, opts); alltoall (output
    # tensors, input tensors, opts): one per member
    SPLITS = "(output, input, ...): all_to_all, splits kept"
    OUT_LISTS_IN = "(output lists, input tensors, opts)"  # allgather, gather
    OUT_IN_LISTS = "(output tensors, input lists, opts)"  # scatter, reduce_scatter
    NO_TENSORS = "(opts)"  # barrier
    PEER = "(tensors, peer, tag)"  # send, recv
    ANY_SOURCE = "(tensors, tag)"  # recv_anysource


def make_override(
    method: str, shape: ArgShape, op: int, slot: int, forward: str, base: Callable[..., Any]
) -> Callable[..., Any]:
    """The ``method`` override of a RecordingProcessGroup: record op code ``op``, then issue
    the op with the real backend's binding: ``GroupState.issue[slot]`` (resolved once per
    group), else ``forward`` looked up on the backend of the tensors' device; ``base`` (the
    ProcessGroup method) for call forms the binding does not take.

    The function is named ``method`` (``co_name`` too), with ``self`` first: pybind11's
    trampoline tells a call of the base method *from* the override (run the C++ base) from
    one that should reach the override by the calling frame's code name and first argument.
    """
    override = _TEMPLATES[shape](op, slot, forward, base)
    override.__name__ = method
    override.__qualname__ = f"RecordingProcessGroup.{method}"
    override.__code__ = override.__code__.replace(co_name=method)
    return override


def _tensors(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(self: Any, tensors: Any, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(op, tensors, tensors)
        try:
            issue = st.issue[slot] or getattr(st.pick(tensors), forward)
            if opts is _NO or args or kwargs:
                work = issue(*_args((tensors,), opts, args), **kwargs)
            else:
                work = issue(tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((tensors,), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors)
        return work

    return override


def _out_in(
    op: int, slot: int, forward: str, base: Callable[..., Any], splits: bool = False
) -> Callable[..., Any]:
    """``splits``: an all_to_all, whose split sizes are kept too (ArgShape.SPLITS)."""

    def override(
        self: Any, output: Any, input: Any, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        pended = False
        if splits:  # all_to_all_single: opts, args[0] are the output/input splits
            out_splits = kwargs.get("output_split_sizes") if opts is _NO else opts
            in_splits = args[0] if args else kwargs.get("input_split_sizes")
            pended = st.splits(output, input, out_splits, in_splits)
        rid = st.coll(op, input, output)
        if pended and rid < 0:
            st.box.pend_splits(None)  # no record took them
        try:
            issue = st.issue[slot] or getattr(st.pick(input), forward)
            if opts is _NO or args or kwargs:
                work = issue(*_args((output, input), opts, args), **kwargs)
            else:
                work = issue(output, input, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((output, input), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input)
        return work

    return override


def _out_lists_in(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(
        self: Any, output_lists: Any, input_tensors: Any, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(op, input_tensors, output_lists)
        try:
            issue = st.issue[slot] or getattr(st.pick(input_tensors), forward)
            if opts is _NO or args or kwargs:
                work = issue(*_args((output_lists, input_tensors), opts, args), **kwargs)
            else:
                work = issue(output_lists, input_tensors, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((output_lists, input_tensors), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, input_tensors)
        return work

    return override


def _out_in_lists(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(
        self: Any, output_tensors: Any, input_lists: Any, opts: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.coll_nested(op, input_lists, output_tensors)
        try:
            issue = st.issue[slot] or getattr(st.pick(output_tensors), forward)
            if opts is _NO or args or kwargs:
                work = issue(*_args((output_tensors, input_lists), opts, args), **kwargs)
            else:
                work = issue(output_tensors, input_lists, opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((output_tensors, input_lists), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, output_tensors)
        return work

    return override


def _no_tensors(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(self: Any, opts: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.coll(op, (), ())
        try:
            issue = st.issue[slot] or getattr(st.barrier_backend, forward)
            if opts is _NO or args or kwargs:
                work = issue(*_args((), opts, args), **kwargs)
            else:
                work = issue(opts)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((), opts, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, None)
        return work

    return override


def _peer(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(
        self: Any, tensors: Any, peer: int, tag: Any = _NO, *args: Any, **kwargs: Any
    ) -> Any:
        st = self._frs
        rid = st.p2p(op, tensors, peer)
        try:
            issue = st.issue[slot] or getattr(st.pick(tensors), forward)
            if tag is _NO or args or kwargs:
                work = issue(*_args((tensors, peer), tag, args), **kwargs)
            else:
                work = issue(tensors, peer, tag)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((tensors, peer), tag, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors, False)
        return work

    return override


def _any_source(op: int, slot: int, forward: str, base: Callable[..., Any]) -> Callable[..., Any]:
    def override(self: Any, tensors: Any, tag: Any = _NO, *args: Any, **kwargs: Any) -> Any:
        st = self._frs
        rid = st.p2p(op, tensors, -1)
        try:
            issue = st.issue[slot] or getattr(st.pick(tensors), forward)
            if tag is _NO or args or kwargs:
                work = issue(*_args((tensors,), tag, args), **kwargs)
            else:
                work = issue(tensors, tag)
        except (TypeError, AttributeError):  # not in this backend's binding: the group's path
            work = base(self, *_args((tensors,), tag, args), **kwargs)
        if rid >= 0:
            st.done(rid, work, tensors, False)
        return work

    return override


_TEMPLATES: dict[ArgShape, Callable[..., Callable[..., Any]]] = {
    ArgShape.TENSORS: _tensors,
    ArgShape.OUT_IN: _out_in,
    ArgShape.SPLITS: functools.partial(_out_in, splits=True),
    ArgShape.OUT_LISTS_IN: _out_lists_in,
    ArgShape.OUT_IN_LISTS: _out_in_lists,
    ArgShape.NO_TENSORS: _no_tensors,
    ArgShape.PEER: _peer,
    ArgShape.ANY_SOURCE: _any_source,
}


# --------------------------------------------------------------------------------------
# Process-group hooks (torch >= 2.15): the same record and completion steps, driven by
# ProcessGroup.register_pre_hook / register_post_hook instead of op overrides
# --------------------------------------------------------------------------------------


class HookShape(enum.Enum):
    """Where a hooked op's tensors are, and whether it has a P2P peer (``root``)."""

    IN_PLACE = "inputs are the outputs"  # all_reduce, broadcast, reduce, coalesced all_reduce
    OUT_IN = "inputs and outputs"
    NO_TENSORS = "no tensors"  # barrier
    PEER = "P2P: the tensors, root = the peer"  # send, recv


def make_hooks(
    st: GroupState, specs: list[tuple[int, HookShape] | None], bind: Callable[[], bool]
) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """The (pre, post) hook pair of one group: the pre hook records the op (``specs``: by
    the hook op name's value, (op code, shape), None: not recorded) and keeps its record id by
    the hook's ``op_id``; the post hook, right after the op is issued, queues the Work for
    the completion poller (or its CUDA events for the watchdog). ``bind()`` registers the
    group in the black box (its members are only known once torch has published them, after
    the hooks are attached); until it succeeds the group's ops are not recorded.

    The record step of ``GroupState.coll``/``p2p`` and the completion step of ``done``,
    inlined: a Python hook pair already costs more per op than PyTorch's C++ recorder, so
    every attribute read counts. Neither hook raises: a hook that raises makes the
    ``torch.distributed`` call raise, so any failure turns recording off with one warning
    (``Recorder.fail``).
    """
    fr = st.fr
    box = st.box
    record = box.record
    ops = st.ops
    sizes1, dtypes1 = st.sizes1, st.dtypes1
    works = st.pending
    order = st.order
    issued: dict[int, tuple[int, bool, bool]] = {}  # op_id -> (record id, CUDA, collective)
    in_place, out_in, peer_op = HookShape.IN_PLACE, HookShape.OUT_IN, HookShape.PEER
    maybe_cuda = st.maybe_cuda

    def pre_hook(args: Any) -> None:
        if not fr.enabled:
            return
        try:
            # .value: hashing the enum itself costs a few times more (two calls into pybind11)
            spec = specs[args.name.value]
            if spec is None or (st.pg < 0 and not bind()):
                return
            code, shape = spec
            cuda = False
            if shape is in_place or shape is out_in:
                tensors = args.input_tensors
                if len(tensors) == 1:  # the common case, inline
                    t = tensors[0]
                    isz = sizes1.get(t.shape)
                    idt = dtypes1.get(t.dtype)
                    if isz is None or idt is None:
                        isz, idt = fr.sizes_id(tensors)
                    cuda = maybe_cuda and t.is_cuda and fr.cuda_events
                else:
                    isz, idt = fr.sizes_id(tensors)
                    if maybe_cuda and tensors:
                        cuda = tensors[0].is_cuda and fr.cuda_events
                if shape is in_place:
                    osz, odt = isz, idt
                else:
                    osz, odt = fr.sizes_id(args.output_tensors)
            elif shape is peer_op:
                tensors = args.input_tensors or args.output_tensors
                isz, idt = osz, odt = fr.sizes_id(tensors)
                if maybe_cuda and tensors:
                    cuda = tensors[0].is_cuda and fr.cuda_events
            else:  # no tensors
                isz, idt = osz, odt = fr.sizes_id(())
            sid = fr.stack_lookup()
            if sid < 0:
                sid = fr.stack_miss()
            if shape is peer_op:
                st.p2p_seq += 1
                peer = args.root
                ranks = st.ranks
                gpeer = ranks[peer] if 0 <= peer < len(ranks) else peer
                rid = record(st.pg, ops[code], 0, st.p2p_seq, gpeer, True, isz, osz, idt, odt, sid)
                issued[args.op_id] = (rid, cuda, False)
            else:
                st.coll_seq += 1
                rid = record(st.pg, ops[code], st.coll_seq, 0, -1, False, isz, osz, idt, odt, sid)
                issued[args.op_id] = (rid, cuda, True)
        except Exception as exc:
            fr.fail(exc)

    def post_hook(args: Any) -> None:
        if not issued:
            return
        try:
            item = issued.pop(args.op_id, None)
            if item is None:
                return
            rid, cuda, collective = item
            work = args.work
            if work is None:
                box.mark_completed(rid)
            elif cuda:
                fr.watch_cuda(rid, work)
            else:
                works.append((rid, work, order if collective else None))
                if fr.poller is None:
                    fr.start_poller()
        except Exception as exc:
            fr.fail(exc)

    return pre_hook, post_hook


def splits_call(
    method: str, original: Callable[..., Any], state_of: Callable[[Any], GroupState | None],
    lists: bool,
) -> Callable[..., Any]:  # fmt: skip
    """A ProcessGroup all_to_all method (``all_to_all_single``; ``alltoall``: ``lists``) that
    hands the split sizes to the record its pre hook writes (the hooks' arguments carry none),
    then calls ``original`` unchanged. They are handed over before the call: a backend may
    abort the process on a size mismatch while the call is still in flight. ``state_of(group)``:
    the group's recording state (None: not recorded by hooks)."""

    def call(self: Any, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        st = state_of(self)
        if st is None:
            return original(self, output, input, *args, **kwargs)
        if lists:  # (st.splits hands nothing over while the recorder is off)
            pended = st.splits(output, input, None, None)
        else:
            out_splits = args[0] if args else kwargs.get("output_split_sizes")
            in_splits = args[1] if len(args) > 1 else kwargs.get("input_split_sizes")
            pended = st.splits(output, input, out_splits, in_splits)
        if not pended:
            return original(self, output, input, *args, **kwargs)
        try:
            return original(self, output, input, *args, **kwargs)
        finally:
            st.box.pend_splits(None)  # a call that wrote no record leaves none for the next

    call.__name__ = method
    call.__qualname__ = f"ProcessGroup.{method}"
    call.__wrapped__ = original  # type: ignore[attr-defined]
    call._frtools_splits = True  # type: ignore[attr-defined]
    return call


# HookShape -> the C++ body's shape codes (pg_hooks.cpp, enum Shape)
NATIVE_SHAPES = {HookShape.IN_PLACE: 0, HookShape.OUT_IN: 1, HookShape.NO_TENSORS: 2}
NATIVE_SHAPES[HookShape.PEER] = 3


def make_native_group(
    st: GroupState, specs: list[tuple[int, HookShape] | None], bind: Callable[[], bool],
    module: Any, body: Any,
) -> Any:  # fmt: skip
    """make_hooks' pair as one C++ object (``module.Group`` of ``native_hooks``) to register
    on a group with ``attach(pg, hook_id)``: the same records (``specs``, ``bind`` as for
    make_hooks; ``body``: the Recorder's native side)."""

    def bind_native() -> tuple[int, list[int]] | None:
        return (st.pg, list(st.ranks)) if bind() else None

    table = [(-1, -1) if s is None else (s[0], NATIVE_SHAPES[s[1]]) for s in specs]
    return module.Group(body, list(st.ops), table, bind_native, st.maybe_cuda)


def native_hook_callables(
    group: Any, fr: Any
) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """Test seam: a C++ group's hooks called with hook arguments as Python objects (torch's
    ``PreHookArgs``/``PostHookArgs`` or stand-ins), the GIL released as a process group would.
    Defined here so that its frame is skipped like the Python hooks' own."""

    def pre_hook(args: Any) -> None:
        try:
            ins, outs = list(args.input_tensors), list(args.output_tensors)
            group._fire_pre(args.name.value, args.op_id, ins, outs, args.root)
        except Exception as exc:
            fr.fail(exc)

    def post_hook(args: Any) -> None:
        try:
            group._fire_post(args.name.value, args.op_id, args.work)
        except Exception as exc:
            fr.fail(exc)

    return pre_hook, post_hook


# --------------------------------------------------------------------------------------
# One-sided windows (torch >= 2.15, nccl2): put / signal / wait_signal, which neither the
# process-group hooks nor PyTorch's Flight Recorder see
# --------------------------------------------------------------------------------------


class WindowState:
    """One recorded window: its group's state, its row in the process-group table, and the
    index of each (op, peer) pair — the k-th signal from r to p on a window matches the k-th
    wait_signal at p for r."""

    __slots__ = ("group", "pg", "counts")

    def __init__(self, group: GroupState, pg: int) -> None:
        self.group = group
        self.pg = pg
        self.counts: dict[tuple[int, int], int] = {}

    def record(self, code: int, peer: int, tensors: Any) -> int:
        """Record one window op with ``peer`` a group-local rank; -1: not recorded."""
        st = self.group
        fr = st.fr
        if not fr.enabled:
            return -1
        try:
            key = (code, peer)
            index = self.counts[key] = self.counts.get(key, 0) + 1
            if tensors is None:
                sz = dt = 0
            else:
                sz, dt = fr.sizes_id(tensors)
            ranks = st.ranks
            gpeer = ranks[peer] if 0 <= peer < len(ranks) else peer
            sid = fr.stack_lookup()
            if sid < 0:
                sid = fr.stack_miss()
            return st.box.record(self.pg, st.ops[code], 0, index, gpeer, True, sz, sz, dt, dt, sid)
        except Exception as exc:
            fr.fail(exc)
            return -1


# window -> WindowState, for the windows created while recording (weakly held)
WINDOWS: weakref.WeakKeyDictionary[Any, WindowState] = weakref.WeakKeyDictionary()


def window_call(
    method: str, code: int, peer_at: int, peer_name: str, has_tensor: bool,
    original: Callable[..., Any],
) -> Callable[..., Any]:  # fmt: skip
    """A ``Window`` method that records op code ``code`` on a recorded window, then calls
    ``original`` unchanged (any window class: the recording does not care which backend).
    ``peer_at``: the peer's position among the arguments after ``self`` (``peer_name`` as a
    keyword); ``has_tensor``: the first argument is the tensor put."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        ws = WINDOWS.get(self)
        rid = -1
        tensors = None
        if ws is not None:
            try:
                peer = args[peer_at] if len(args) > peer_at else kwargs[peer_name]
                if has_tensor:
                    tensors = [args[0] if args else kwargs["tensor"]]
                rid = ws.record(code, int(peer), tensors)
            except Exception as exc:
                ws.group.fr.fail(exc)
        work = original(self, *args, **kwargs)
        if rid >= 0:
            ws.group.done(rid, work, tensors, False)
        return work

    call.__name__ = method
    call.__qualname__ = f"Window.{method}"
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call
