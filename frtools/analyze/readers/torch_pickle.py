"""PyTorch Flight Recorder pickles (``_dump_nccl_trace`` / ``_dump_fr_trace`` output, the
files ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` / ``TORCH_FR_DUMP_TEMP_FILE`` name), any version,
plain or gzip'd.

Where the optional native module ``_frpickle`` is built, a dump is parsed in C++ straight
into columns with the GIL released (thread-safe; the loader reads in worker processes,
since turning the result into Arrow arrays still needs the GIL); a pickle it does not fully
understand — anything but plain data of the expected shape — goes
the Python way, through the restricted unpickler, which owns every error message.
``FRTOOLS_NATIVE_PICKLE=0`` turns the native parser off.
"""

from __future__ import annotations

import gc
import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa

from frtools.config import NATIVE_PICKLE
from frtools.formats import limits
from frtools.formats.torch_fr.normalize import (
    EntryColumns,
    entries_table,
    has_split_keys,
    reuses_group_names,
)
from frtools.model.trace import ENTRY_SCHEMA

from .base import DumpError, RankDump, read_content
from .safe_pickle import RefusedPickle, loads_data
from .torch_fr import native_parts, native_rank_dump, rank_dump

try:
    from . import _frpickle
except ImportError:  # not built (no compiler at install): the Python path reads everything
    _frpickle = None
# the parser leaves a dump whose entries have all_to_all split keys to Python on its own;
# a build from before that is kept from such dumps by a scan of the bytes
_SCAN_FOR_SPLITS = not getattr(_frpickle, "DEFERS_SPLIT_KEYS", 0)

FORMAT = "torch-pickle"
# Gloo's dumps record ops on groups their pg_config does not list
LISTS_ALL_GROUPS = False


_PICKLE_NAMES = (".pkl", ".pickle", ".pkl.gz", ".pickle.gz")


def sniff(path: Path, head: bytes) -> bool:
    # protocol 2+ starts with PROTO (0x80 <n>); PyTorch's pickler writes protocol 2. A file
    # named like a pickle is claimed whatever its protocol, so that a hostile protocol-0
    # pickle is refused by name instead of being skipped as "not a dump".
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    return path.name.lower().endswith(_PICKLE_NAMES)


def native_available() -> bool:
    """The native parser is built and not turned off with ``FRTOOLS_NATIVE_PICKLE=0``."""
    return _frpickle is not None and NATIVE_PICKLE.read()


def read(path: Path) -> RankDump:
    data, stored = read_content(path)
    if _native_first(data):
        dump = read_native(data, path, stored)
        if dump is not None:
            return dump
    return read_python(data, path, stored)


def read_many(
    paths: list[Path],
) -> tuple[list[list[RankDump] | Exception], pa.Table, list[list[int]]]:
    """Several dumps at once (a worker's chunk of files): per file its RankDump, or the
    error that refused it (worded by the loader as for one file), and the entries of those
    the native parser read as one table (``rows``: per file its dump's row count in it, in
    order; those dumps' ``entries`` are None). A dump read the Python way comes with its
    own table (its ``rows`` empty). Per file, its ~30 small Arrow arrays cost a third of
    what reading it does; here they are one array per column for the chunk."""
    out: list[list[RankDump] | Exception] = []
    rows: list[list[int]] = []
    parts: list[EntryColumns] = []
    for path in paths:
        try:
            data, stored = read_content(path)
            got = _native(data, path, stored) if _native_first(data) else None
            if got is None:
                out.append([read_python(data, path, stored)])
                rows.append([])
                continue
        except Exception as e:  # noqa: BLE001 - one file's failure, as read_one words it
            out.append(e)
            rows.append([])
            continue
        out.append([got[0]])
        rows.append([got[1].n])
        parts.append(got[1])
    return out, entries_table(parts) if parts else ENTRY_SCHEMA.empty_table(), rows


def _native_first(data: bytes) -> bool:
    return native_available() and not (_SCAN_FOR_SPLITS and has_split_keys(data))


def read_native(data: bytes, path: Path, stored: int | None = None) -> RankDump | None:
    """The dump via the native parser, or None when the parser leaves it to Python (also
    when the pickle is beyond a limit: Python then refuses it, naming the limit).
    ``stored``: the file's size on disk (default: ``len(data)``), which the limits scale
    with. Thread-safe; the parse runs without the GIL."""
    parsed = _parse(data, stored)
    return None if parsed is None else native_rank_dump(*parsed, path, FORMAT)


def _native(data: bytes, path: Path, stored: int | None) -> tuple[RankDump, EntryColumns] | None:
    """``read_native`` with the entries as columns (``native_parts``)."""
    parsed = _parse(data, stored)
    return None if parsed is None else native_parts(*parsed, path, FORMAT)


def _parse(data: bytes, stored: int | None) -> tuple[Any, Any] | None:
    lim = limits.current()
    size = len(data) if stored is None else stored
    if _frpickle is None:
        return None
    parsed = _frpickle.parse(data, lim.parsed_cap(size), lim.expanded_cap(size))
    if parsed is not None and reuses_group_names(parsed[1]["process_group"][1]):
        return None  # a group created again in the process: the Python path sorts it out
    return parsed


def read_python(data: bytes, path: Path, stored: int | None = None) -> RankDump:
    """The dump via the restricted Python unpickler (every error message comes from here);
    ``stored`` as for ``read_native``."""
    # a dump is ~20 small containers per entry: the cyclic GC would rescan them all many
    # times while they are built (2-3x the load time), and none of them form cycles
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        dump = loads_data(data, stored)
    except RefusedPickle as e:
        raise DumpError(str(e)) from None
    except EOFError:
        raise DumpError("truncated pickle (data ends before the dump does)") from None
    except RecursionError:
        raise DumpError("pickle nests too deeply to be a dump; refused") from None
    except MemoryError:
        raise DumpError("pickle too large to load (out of memory); refused") from None
    except (
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        UnicodeDecodeError,
        OverflowError,
    ) as e:
        reason = str(e) or type(e).__name__
        if "truncated" in reason:
            raise DumpError("truncated pickle (data ends before the dump does)") from None
        raise DumpError(f"corrupt pickle: {reason}") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    return rank_dump(dump, path, FORMAT)
