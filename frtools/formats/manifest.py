"""A dump folder's files: the rank files' names, their side files, and ``manifest.json``
(what a collection found, who answered, who was gone).

The analyzer cannot tell from a rank file alone whether its process was alive when it was
collected, or whether a rank without a file never existed or simply did not answer; the
collector knows, and writes it down next to the files.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools import __version__
from frtools.formats import limits
from frtools.formats.private_files import write_new
from frtools.model.ranks import MAX_WORLD_SIZE

MANIFEST_NAME = "manifest.json"
BOX_SUFFIX = ".frt"  # a rank's black box: ``rank_<R>.frt``
STACKS_SUFFIX = ".stacks"  # every thread's Python stacks beside it: ``rank_<R>.stacks``
# py-spy's ``dump --native --json`` of the rank's process, taken by ``frtools dump``
NATIVE_STACKS_SUFFIX = ".native"


def rank_file_name(rank: int, suffix: str = BOX_SUFFIX) -> str:
    """``rank_<R><suffix>``: the name of a rank's file in a recorder or dump folder."""
    return f"rank_{int(rank)}{suffix}"


def rank_in_file_name(name: str, suffix: str = BOX_SUFFIX) -> int | None:
    """The rank of a ``rank_<R><suffix>`` name (``rank_file_name`` read back); ``None`` for
    any other name, or a rank at or beyond ``model.ranks.MAX_WORLD_SIZE``."""
    m = re.fullmatch(rf"rank_(\d{{1,{len(str(MAX_WORLD_SIZE))}}}){re.escape(suffix)}", name)
    rank = int(m.group(1)) if m else None
    return rank if rank is not None and rank < MAX_WORLD_SIZE else None


def stacks_path(box_path: str | os.PathLike[str]) -> Path:
    """The stacks file that belongs to a rank file (``rank_3.frt`` -> ``rank_3.stacks``)."""
    return Path(box_path).with_suffix(STACKS_SUFFIX)


def native_stacks_path(box_path: str | os.PathLike[str]) -> Path:
    """The native stacks file beside a rank file (``rank_3.frt`` -> ``rank_3.native``)."""
    return Path(box_path).with_suffix(NATIVE_STACKS_SUFFIX)


MANIFEST_KIND = "frtools-dump-manifest"
MANIFEST_VERSION = 1


@dataclass
class RankEntry:
    """One rank as the collector saw it."""

    rank: int
    host: str | None = None
    pid: int | None = None
    alive: bool | None = None  # process running when collected (None: unknown, other host)
    answered: bool = False  # wrote a fresh snapshot / stacks on request
    files: list[str] = field(default_factory=list)  # names relative to the manifest's dir
    note: str = ""
    error: str = ""  # the file is not a usable black box (the reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "error": self.error,
            "host": self.host,
            "pid": self.pid,
            "alive": self.alive,
            "answered": self.answered,
            "files": self.files,
            "note": self.note,
        }


@dataclass
class Manifest:
    job_id: str
    mode: str  # "local", "job-wide", "stall", "torch-socket", "torch-store", "torch-pipe"
    host: str = field(default_factory=socket.gethostname)
    created_ns: int = field(default_factory=time.time_ns)
    world_size: int | None = None
    elapsed_s: float | None = None  # request to last answer / last copy
    ranks: dict[int, RankEntry] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ranks_found(self) -> list[int]:
        return sorted(r for r, e in self.ranks.items() if e.files)

    @property
    def ranks_answered(self) -> list[int]:
        return sorted(r for r, e in self.ranks.items() if e.answered)

    @property
    def ranks_gone(self) -> list[int]:
        return sorted(r for r, e in self.ranks.items() if e.alive is False)

    @property
    def ranks_no_answer(self) -> list[int]:
        return sorted(
            r
            for r, e in self.ranks.items()
            if not e.answered and e.alive is not False and not e.error
        )

    @property
    def ranks_unreadable(self) -> list[int]:
        return sorted(r for r, e in self.ranks.items() if e.error)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": MANIFEST_KIND,
            "manifest_version": MANIFEST_VERSION,
            "frtools_version": __version__,
            "job_id": self.job_id,
            "mode": self.mode,
            "host": self.host,
            "created_ns": self.created_ns,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_ns / 1e9)),
            "world_size": self.world_size,
            "elapsed_s": None if self.elapsed_s is None else round(self.elapsed_s, 3),
            "ranks_found": self.ranks_found,
            "ranks_answered": self.ranks_answered,
            "ranks_gone": self.ranks_gone,
            "ranks_no_answer": self.ranks_no_answer,
            "ranks_unreadable": self.ranks_unreadable,
            "ranks": {str(r): self.ranks[r].to_dict() for r in sorted(self.ranks)},
            "notes": self.notes,
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``manifest.json`` atomically (a reader never sees half a manifest)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        return write_new(Path(directory) / MANIFEST_NAME, text)


class ManifestError(ValueError):
    """A manifest that cannot be read; the message is a one-line reason."""


class NotAManifest(ManifestError):
    """JSON that is not an frtools dump manifest (someone else's ``manifest.json``)."""


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest as a dict; ``NotAManifest`` when it is not one of ours,
    ``ManifestError`` when it cannot be read or is refused: a manifest is read only when it
    is a regular file (not a link, a FIFO or a device) of at most ``manifest_bytes``
    (``frtools.formats.limits``)."""
    lim = limits.current()
    try:
        raw = limits.read_regular(
            path, lim.manifest_bytes, limit_name="manifest_bytes", follow_symlinks=False
        )
        limits.check_json(raw, lim)
        data = json.loads(raw)
    except limits.InputRefused as exc:
        raise ManifestError(f"manifest {exc}") from None
    except RecursionError:
        raise ManifestError("manifest nests too deeply; refused") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"unreadable manifest: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
        raise NotAManifest("not an frtools dump manifest")
    return data
