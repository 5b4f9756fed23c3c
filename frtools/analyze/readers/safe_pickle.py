"""A pickle loader that only builds plain data.

A Flight Recorder dump is dicts, lists, tuples, strings, numbers, booleans and None; PyTorch
writes it with its own pickler and no class references (checked on 2.13 with pickletools:
no GLOBAL/STACK_GLOBAL/REDUCE opcodes). TorchScript's pickler can emit one family of
globals for typed lists (``torch.jit._pickle.build_intlist`` …, and
``restore_type_tag``); those are mapped to harmless identity functions here. Anything else —
``os.system``, ``builtins.eval``, a tensor rebuild — is refused before it can run: a dump
is data, never code.

A pickle is also bounded before and after it is loaded (``frtools.formats.limits``):

* ``scan`` walks the opcodes first (nothing is built) and refuses a memo index beyond the
  input (CPython's unpickler sizes its memo from it: 9 bytes could take gigabytes) and a
  pickle whose objects would take more than ``parsed_bytes``, estimated per opcode
  (``estimate``, the same formula the native parser applies);
* ``expanded_values`` counts what the loaded data expands to when every shared (memo)
  reference counts for what it refers to: 60 KB can refer to one 15,000-int list 15,000
  times, and every reader that renders values as text would build it out.
"""

from __future__ import annotations

import io
import itertools
import pickle
import pickletools
import sys
from typing import Any

from frtools.formats import limits


class RefusedPickle(pickle.UnpicklingError):
    """The pickle references a global that a dump never needs."""


def _identity_list(data: Any) -> Any:
    return data


def _restore_type_tag(value: Any, _type_str: Any) -> Any:
    return value


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.jit._pickle", "build_intlist"): _identity_list,
    ("torch.jit._pickle", "build_doublelist"): _identity_list,
    ("torch.jit._pickle", "build_boollist"): _identity_list,
    ("torch.jit._pickle", "build_tensorlist"): _identity_list,
    ("torch.jit._pickle", "build_complexlist"): _identity_list,
    ("torch.jit._pickle", "restore_type_tag"): _restore_type_tag,
}


class DataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` refuses every global but the few
    identity helpers above (still the C unpickler: subclassing keeps its speed)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        raise RefusedPickle(
            f"refused: the pickle tries to load {module}.{name}; a dump is data, never code"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("refused: the pickle uses persistent ids; a dump is data, never code")


def loads_data(data: bytes, stored: int | None = None) -> Any:
    """Unpickle ``data`` allowing plain containers and scalars only, within the limits:
    ``RefusedPickle`` (before anything is built) for a memo index beyond the input or an
    estimated size beyond ``parsed_bytes``, and (once loaded) for data that expands beyond
    ``expanded_values`` (both scaled up for a file of ``stored`` bytes on disk by
    ``per_stored_byte``; default: ``len(data)``)."""
    lim = limits.current()
    scan(data, lim, stored)
    obj = DataUnpickler(io.BytesIO(data)).load()
    check_expansion(obj, lim, stored if stored is not None else len(data))
    return obj


# --- what a pickle costs, before it is loaded ------------------------------------------------

# per opcode: how its argument is read (-1 a line, -2 two lines, -11/-14/-18 a length of
# 1/4/8 bytes then that many bytes, -24 a signed 4-byte length; >= 0 a fixed size)
_ARG: list[int | None] = [None] * 256
for _op in pickletools.opcodes:
    _arg = _op.arg
    _code = ord(_op.code)
    if _arg is None:
        _ARG[_code] = 0
    elif _arg.n >= 0:
        _ARG[_code] = _arg.n
    elif _arg.n == pickletools.UP_TO_NEWLINE:
        _ARG[_code] = -2 if _arg.name == "stringnl_noescape_pair" else -1
    elif _arg.n == pickletools.TAKEN_FROM_ARGUMENT1:
        _ARG[_code] = -11
    elif _arg.n == pickletools.TAKEN_FROM_ARGUMENT4:
        _ARG[_code] = -24
    elif _arg.n == pickletools.TAKEN_FROM_ARGUMENT4U:
        _ARG[_code] = -14
    elif _arg.n == pickletools.TAKEN_FROM_ARGUMENT8U:
        _ARG[_code] = -18
del _op, _arg, _code

# opcodes that build a new container (or object): they cost more than a value; a dict
# (or a set) more again (CPython: 232 bytes once it holds an item, 224 an empty set)
_CONTAINERS = frozenset(b"}])dlt\x85\x86\x87\x8f\x91Rbio\x81\x92")
_DICTS = frozenset(b"}d\x8f\x91")
# opcodes that build a str or bytes object (CPython: ~50 bytes + its length)
_STRINGS = frozenset(b"STUVXBC\x8c\x8d\x8e\x96")
STOP = ord(".")
FRAME = 0x95
# per opcode, for the scan's fast path: the size of its argument when it is fixed and
# nothing about it is counted, else -1 (a container, STOP, LONG_BINPUT, PUT, a line or a
# counted length). BINPUT's index (< 256) can size no memo worth counting.
_STEP = [
    -1
    if a is None
    or a < 0
    or (a == 0 and (code in _CONTAINERS or code == STOP))
    or code in (ord("r"), FRAME)
    else a
    for code, a in enumerate(_ARG)
]

# The estimate, in bytes, of what a pickle's objects take once loaded, an upper bound of
# what CPython takes for any sequence of opcodes (measured: 72 bytes an empty dict, 232 one
# holding an item, 64 a list, ~60 + length a str, 8 a reference and ~30 a dict item):
#   OP_BYTES per opcode + the bytes of the pickle up to STOP (every argument: string
#   contents, numbers) + OBJECT_BYTES per container or string + DICT_BYTES more per dict +
#   MEMO_BYTES per memo slot up to the highest index PUT or LONG_BINPUT names. The native parser
#   (_frpickle.cpp) computes the same number.
OP_BYTES = 48
OBJECT_BYTES = 40
DICT_BYTES = 200
MEMO_BYTES = 16


def estimate(ops: int, consumed: int, objects: int, dicts: int, memo_top: int) -> int:
    """The estimate above: ``ops`` opcodes up to STOP, ``consumed`` bytes, ``objects``
    opcodes building a container or a string, of which ``dicts`` dicts, ``memo_top`` =
    highest explicit memo index + 1."""
    return (
        OP_BYTES * ops
        + consumed
        + OBJECT_BYTES * objects
        + DICT_BYTES * dicts
        + MEMO_BYTES * memo_top
    )


def _truncated() -> RefusedPickle:
    return RefusedPickle("truncated pickle (data ends before the dump does)")


def scan(data: bytes, limit: limits.Limits | None = None, stored: int | None = None) -> int:
    """Walk the opcodes of ``data`` up to STOP without building anything; returns the
    estimate of what loading it takes. ``RefusedPickle`` for a memo index beyond the input,
    a length beyond the end, a frame inside a frame (CPython's C unpickler answers one with
    a MemoryError), or an estimate beyond ``parsed_bytes``. An opcode the scan does
    not know, or bytes ending without STOP, are left to the unpickler (it reports them)."""
    lim = limit or limits.current()
    n = len(data)
    cap = lim.parsed_cap(n if stored is None else stored)
    i = ops = objects = dicts = memo_top = frame_end = 0
    step_of = _STEP
    arg = _ARG
    find = data.find
    from_bytes = int.from_bytes
    while i < n:
        op = data[i]
        i += 1
        ops += 1
        step = step_of[op]
        if step >= 0:  # most opcodes: a fixed-size argument, nothing to count
            i += step
            continue
        a = arg[op]
        if a is None:
            break  # not an opcode: the unpickler says so
        if a == 0:
            if op == STOP:
                break
            objects += 1  # a container
            dicts += op in _DICTS
        elif a > 0:  # LONG_BINPUT or FRAME
            if i + a > n:
                raise _truncated()
            value = from_bytes(data[i : i + a], "little")
            i += a
            if op != FRAME:
                memo_top = _memo(value, memo_top, n)
            elif i < frame_end:  # as the native parser: a frame starts where one ended
                raise RefusedPickle("corrupt pickle: a frame begins inside another frame")
            elif value > n - i:
                raise _truncated()
            else:
                frame_end = i + value
        elif a == -1 or a == -2:
            end = find(b"\n", i)
            if a == -2 and end >= 0:
                end = find(b"\n", end + 1)
            if end < 0:
                raise _truncated()
            if op == 112:  # PUT: a decimal line
                text = data[i:end].strip()
                if text.isdigit() and len(text) < 20:
                    memo_top = _memo(int(text), memo_top, n)
            objects += op in _CONTAINERS or op in _STRINGS
            i = end + 1
        else:
            width = -a % 10
            if i + width > n:
                raise _truncated()
            size = from_bytes(data[i : i + width], "little", signed=a == -24)
            if size < 0:
                break  # a negative length: the unpickler refuses it
            objects += op in _STRINGS
            i += width + size
            if i > n:
                raise _truncated()
    need = estimate(ops, min(i, n), objects, dicts, memo_top)
    if need > cap:
        raise RefusedPickle(
            str(
                limits.exceeded(
                    f"pickle would take about {limits.size_text(need)} once loaded",
                    "parsed_bytes",
                    cap,
                )
            )
        )
    return need


def _memo(idx: int, top: int, n: int) -> int:
    if idx >= n:
        raise RefusedPickle(
            f"pickle memo index {idx:,} beyond its own {n:,} bytes (no pickler writes one); refused"
        )
    return max(top, idx + 1)


# --- what loaded data expands to -------------------------------------------------------------

# a string (or bytes) counts one value, plus one per this many bytes
STRING_UNIT = 8


def expanded_values(obj: Any, cap: int | None = None) -> int:
    """The number of values ``obj`` holds when every reference is counted for what it
    refers to (a list shared 15,000 times counts 15,000 times): containers and scalars one
    each, strings one plus one per ``STRING_UNIT`` characters. A container referenced from
    more than one place is summed once and remembered by identity; the others (known from
    their reference count) are visited once and forgotten, so this costs a pass over the
    data and memory for its nesting depth. Stops early once beyond ``cap``; a container
    that holds itself gives ``ValueError``."""
    cls = obj.__class__
    if cls is str or cls is bytes:
        return 1 + len(obj) // STRING_UNIT
    if cls is not dict and cls is not list and cls is not tuple:
        return 1
    limit = cap if cap is not None else float("inf")
    refcount = sys.getrefcount
    shared: dict[int, int | None] = {id(obj): None}  # id -> total (None: being summed)
    # frames: [container, its children (an iterator), the sum so far, remembered]
    frames: list[list[Any]] = [[obj, _children(obj), 1, True]]
    while frames:
        frame = frames[-1]
        total = frame[2]
        entered = False
        for c in frame[1]:
            cc = c.__class__
            if cc is str or cc is bytes:
                total += 1 + len(c) // STRING_UNIT
            elif cc is dict or cc is list or cc is tuple:
                # referenced by its parent, ``c`` and the call's argument: 3 when unshared
                remember = refcount(c) > _UNSHARED_REFS
                if remember:
                    key = id(c)
                    if key in shared:
                        got = shared[key]
                        if got is None:
                            raise ValueError(
                                "the pickle refers to itself (a container holds itself)"
                            )
                        total += got
                        continue
                    shared[key] = None
                else:
                    flat = _flat_values(c)  # most containers hold scalars only: no frame
                    if flat:
                        total += flat
                        continue
                frame[2] = total
                frames.append([c, _children(c), 1, remember])
                entered = True
                break
            else:
                total += 1
        if entered:
            continue
        frames.pop()
        if frame[3]:
            shared[id(frame[0])] = total
        if total > limit or not frames:
            return total
        frames[-1][2] += total
    return 0  # not reached


# what a container's reference count is when only its parent refers to it, seen from the
# loop above (the parent, the loop variable, the argument of sys.getrefcount)
_UNSHARED_REFS = 3


def _flat_values(c: Any) -> int:
    """``expanded_values`` of a container holding no container, else 0."""
    total = 1
    # a dict's values first: where a container is, if any (keys seldom are)
    for part in (c.values(), c.keys()) if c.__class__ is dict else (c,):
        for g in part:
            gc = g.__class__
            if gc is str or gc is bytes:
                total += 1 + len(g) // STRING_UNIT
            elif gc is dict or gc is list or gc is tuple:
                return 0
            else:
                total += 1
    return total


def _children(c: Any) -> Any:
    return itertools.chain(c.keys(), c.values()) if c.__class__ is dict else iter(c)


def check_expansion(obj: Any, limit: limits.Limits | None = None, stored: int = 0) -> None:
    """``RefusedPickle`` when ``obj`` expands beyond ``expanded_values`` (scaled for a file
    of ``stored`` bytes) or holds itself."""
    lim = limit or limits.current()
    cap = lim.expanded_cap(stored)
    try:
        got = expanded_values(obj, cap)
    except ValueError as e:
        raise RefusedPickle(f"{e}; a dump never does; refused") from None
    if got > cap:
        raise RefusedPickle(
            str(
                limits.exceeded(
                    "pickle expands to more values than allowed through shared references",
                    "expanded_values",
                    cap,
                    unit="values",
                )
            )
        )
