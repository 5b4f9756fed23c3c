"""One file -> a ``FileResult``: which reader claims it (or why none does), and what
reading it gave. Never raises: whatever goes wrong with one file becomes that file's
``InputFile`` reason.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from frtools.analyze.memory import no_cyclic_gc
from frtools.formats.limits import InputRefused, file_kind
from frtools.formats.manifest import MANIFEST_NAME, STACKS_SUFFIX
from frtools.model.ranks import format_ranks
from frtools.model.trace import InputFile

from .base import DumpError, RankBlock, RankDump, rank_from_filename, read_head
from .registry import capabilities, reader_for

_SIDE_FILES = {
    MANIFEST_NAME: "manifest of an frtools dump, not a rank's record",
}
_SIDE_SUFFIXES = {
    STACKS_SUFFIX: "Python stacks text, not a rank's record",
    ".txt": "text file, not a dump",
    ".log": "log file, not a dump",
    ".md": "text file, not a dump",
}


@dataclass
class FileResult:
    """What reading one file gave: its ``InputFile`` and, if usable, its ``RankDump``
    (``more``: the other ranks of a file that holds several)."""

    input: InputFile
    dump: RankDump | None = None
    mtime: float = 0.0
    more: list[RankDump] = field(default_factory=list)
    # a file of several ranks whose dumps are not made yet: what a worker process hands
    # over; ``unblock`` makes them
    block: RankBlock | None = None

    @property
    def dumps(self) -> list[RankDump]:
        assert self.block is None, "unblock() first"
        return ([self.dump] if self.dump is not None else []) + self.more

    def unblock(self) -> list[RankDump]:
        """Make the dumps of a ``block`` (nothing to do without one); returns them. Making
        them fails as reading would: this file's reason (no dump), not the analysis's."""
        block, self.block = self.block, None
        if block is not None:
            try:
                with no_cyclic_gc():
                    dumps = block.dumps()
            except Exception as e:  # noqa: BLE001 - sorted out by failure
                self.input = failure(self.input.path, block.format, self.mtime, e).input
                return []
            self.dump, self.more = (dumps[0], dumps[1:]) if dumps else (None, [])
        return self.dumps


def read_file(path: str | Path) -> FileResult:
    """Read one file with whichever reader claims it; never raises.

    An unusable dump still names its rank (from the file name) so that a report can say
    "rank 3: dump truncated" rather than only "rank 3 missing"."""
    result = read_one(Path(path))
    if result.input.status == "error" and result.input.rank is None:
        result.input.rank = rank_from_filename(Path(path).name)[0]
    return result


def classify(path: Path) -> FileResult | tuple[ModuleType, float]:
    """The file's fate without reading it all: a ``FileResult`` when it is settled already
    (unreadable, empty, not a dump), else the reader that claims it and its mtime."""
    p = str(path)
    try:
        st = path.stat()
    except OSError as e:
        return FileResult(InputFile(p, "error", f"cannot read: {e.strerror or e}"))
    side = _SIDE_FILES.get(path.name) or _SIDE_SUFFIXES.get(path.suffix.lower())
    if not stat.S_ISREG(st.st_mode):
        reason = f"is {file_kind(st.st_mode)}, not a regular file; refused"
        return FileResult(InputFile(p, "error", reason))
    if st.st_size == 0:
        if side:
            return FileResult(InputFile(p, "skipped", side), mtime=st.st_mtime)
        return FileResult(InputFile(p, "error", "empty file (0 bytes)"), mtime=st.st_mtime)
    try:
        head = read_head(path)
    except InputRefused as e:
        return FileResult(InputFile(p, "error", str(e)))
    except OSError as e:
        return FileResult(InputFile(p, "error", f"cannot read: {e.strerror or e}"))
    reader = reader_for(path, head)
    if reader is None:
        if not head and path.suffix.lower() in (".gz", ".gzip"):
            return FileResult(InputFile(p, "error", "corrupt gzip file"), mtime=st.st_mtime)
        reason = side or "not a dump: no reader recognizes its content"
        return FileResult(InputFile(p, "skipped", reason), mtime=st.st_mtime)
    return reader, st.st_mtime


def failure(p: str, fmt: str, mtime: float, e: BaseException) -> FileResult:
    if isinstance(e, (DumpError, InputRefused)):
        reason = str(e)
    elif isinstance(e, RecursionError):
        reason = "nests too deeply to be a dump; refused"
    elif isinstance(e, MemoryError):
        reason = "too large to load (out of memory)"
    else:  # a reader bug must cost one file, not the whole analysis
        reason = f"{fmt} reader failed: {type(e).__name__}: {e}"
    return FileResult(InputFile(p, "error", reason, format=fmt), mtime=mtime)


def success_block(p: str, block: RankBlock, mtime: float) -> FileResult:
    """``success`` of a file of several ranks whose dumps are not made yet."""
    info = InputFile(p, "ok", f"ranks {format_ranks(block.ranks)}", format=block.format)
    return FileResult(info, mtime=mtime, block=block)


def success(p: str, dumps: list[RankDump], mtime: float) -> FileResult:
    if not dumps:
        return FileResult(InputFile(p, "error", "holds no rank"), mtime=mtime)
    dump = dumps[0]
    if len(dumps) > 1:
        ranks = format_ranks(d.rank_info.rank for d in dumps)
        info = InputFile(p, "ok", f"ranks {ranks}", format=dump.rank_info.format)
        return FileResult(info, dump, mtime, more=dumps[1:])
    info = InputFile(
        p, "ok", "; ".join(dump.notes), rank=dump.rank_info.rank, format=dump.rank_info.format
    )
    return FileResult(info, dump, mtime)


def read_one(path: Path) -> FileResult:
    found = classify(path)
    if isinstance(found, FileResult):
        return found
    reader, mtime = found
    fmt = reader.FORMAT
    with no_cyclic_gc():
        try:
            several = capabilities(reader).several_ranks
            dumps = reader.read_all(path) if several else [reader.read(path)]
        except Exception as e:  # noqa: BLE001 - sorted out by _failure
            return failure(str(path), fmt, mtime, e)
    return success(str(path), dumps, mtime)


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
    return files
