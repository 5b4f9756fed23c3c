"""A pickle loader that only builds plain data.

A Flight Recorder dump is dicts, lists, tuples, strings, numbers, booleans and None; PyTorch
writes it with its own pickler and no class references (checked on 2.13 with pickletools:
no GLOBAL/STACK_GLOBAL/REDUCE opcodes). TorchScript's pickler can emit one family of
globals for typed lists (``torch.jit._pickle.build_intlist`` …, and
``restore_type_tag``); those are mapped to harmless identity functions here. Anything else —
``os.system``, ``builtins.eval``, a tensor rebuild — is refused before it can run: a dump
is data, never code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any


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


def loads_data(data: bytes) -> Any:
    """Unpickle ``data`` allowing plain containers and scalars only."""
    return DataUnpickler(io.BytesIO(data)).load()
