"""The reader registry: which module reads which file.

Readers are tried in order; the first whose ``sniff`` says yes reads the file. The
frtools snapshot reader (``frtools_snapshot``, written with the recorder) is picked up
when that module exists and comes first: its magic is the most specific.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from . import torch_json, torch_pickle
from .base import Capabilities, Reader

# reader modules that exist but failed to import: name -> reason (shown by the loader)
UNAVAILABLE: dict[str, str] = {}


def _optional(name: str) -> ModuleType | None:
    module = f"{__package__}.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            UNAVAILABLE[name] = f"{type(e).__name__}: {e}"
        return None
    except Exception as e:  # a broken optional reader must not break the others
        UNAVAILABLE[name] = f"{type(e).__name__}: {e}"
        return None


def _readers() -> tuple[ModuleType, ...]:
    found = [m for m in (_optional("frtools_snapshot"), _optional("summary")) if m is not None]
    return (*found, torch_pickle, torch_json)


READERS: tuple[ModuleType, ...] = _readers()
# each format's declared capabilities, by the name its dumps carry (``RankInfo.format``)
_CAPABILITIES: dict[str, Capabilities] = {r.FORMAT: Capabilities.of(r) for r in READERS}
_NONE = Capabilities()


def capabilities(reader: Reader | str) -> Capabilities:
    """What a reader (or the reader of a format name, as a dump's ``RankInfo.format`` gives
    it) declares it can do; a format no reader knows can do nothing beyond entries."""
    if isinstance(reader, str):
        return _CAPABILITIES.get(reader, _NONE)
    return _CAPABILITIES.get(reader.FORMAT) or Capabilities.of(reader)


def reader_for(path: Path, head: bytes) -> ModuleType | None:
    """The reader that claims this file, ``None`` when no reader does."""
    for reader in READERS:
        try:
            if reader.sniff(path, head):
                return reader
        except Exception:  # a reader's sniff must never stop the others
            continue
    return None
