"""Readers: every input file -> one canonical ``frtools.model.trace.Trace``.

``load_trace(path)`` is the single entry point the analysis uses. One reader module per
format (``FORMAT``, ``sniff(path, head)``, ``read(path) -> RankDump``), found through
``READERS``; see docs/dump-formats.md for what each PyTorch version wrote.
"""

from __future__ import annotations

from .base import DumpError, RankDump, rank_from_filename
from .loader import UnusableInput, load_trace, read_file
from .registry import READERS, reader_for

__all__ = [
    "READERS",
    "DumpError",
    "RankDump",
    "UnusableInput",
    "load_trace",
    "rank_from_filename",
    "read_file",
    "reader_for",
]
