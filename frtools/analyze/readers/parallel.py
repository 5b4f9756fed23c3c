"""Reading many files: in worker processes when there are many, their tables handed over
through a spool of Arrow IPC files in shared memory, and files whose reader reads many at
once (packed host summaries, black boxes, PyTorch pickles) read in one call.

A file may hold several ranks (a host summary): its reader's ``read_all`` returns one
``RankDump`` per rank, their entries slices of one table. Worker processes hand over one
table per chunk of files, and the final concatenation takes runs of slices of one table as
one slice (``Spans``), so 16,384 host summaries of 8 ranks do not become 131,072 tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from frtools.model.trace import InputFile, concat_entries

from .base import RankDump, rank_from_filename
from .files import FileResult, classify, failure, no_cyclic_gc, read_one, success, success_block
from .registry import capabilities

# below this many files, and this many bytes in all, reading in-process beats paying for
# worker start-up; a few large files (merged partials of a fleet, ~30 MB each) are read in
# parallel too (four 131,072-rank level-3 partials: 18.3 -> 7.9 s)
PARALLEL_MIN_FILES = 64
PARALLEL_MIN_BYTES = 16 << 20
MAX_WORKERS = 8

# id(RankDump) -> (table, offset, rows), for one load: a dump whose entries are rows of a
# table it shares with other dumps (a batch of host summaries, a worker's chunk). Its
# ``entries`` stay None until needed (``entries``): slicing 131,072 tables costs seconds,
# and the final concatenation takes runs of adjacent rows as one slice.
Spans = dict[int, tuple[pa.Table, int, int]]


def entries(d: RankDump, spans: Spans) -> pa.Table:
    """A dump's entries: its slice of a shared table, taken when first asked."""
    if d.entries is None:
        table, offset, rows = spans[id(d)]
        d.entries = table.slice(offset, rows)
    return d.entries


def read_chunk(paths: Sequence[str], spans: Spans, *, blocks: bool = False) -> list[FileResult]:
    """Read several files; those whose reader reads many at once (``read_many``: packed
    host summaries, black boxes, PyTorch pickles) are read in one call, their dumps'
    entries left None and found in ``spans`` (one table for all of them). ``blocks``: a
    file of several ranks that its reader returned as a ``RankBlock`` stays one
    (``FileResult.block``; its rows: the span of ``id(block)``), for a worker to hand over
    without making its dumps."""
    results: list[FileResult | None] = [None] * len(paths)
    batches: dict[str, tuple[ModuleType, list[tuple[int, Path, float]]]] = {}
    for i, p in enumerate(paths):
        path = Path(p)
        found = classify(path)
        if isinstance(found, FileResult):
            results[i] = found
        elif capabilities(found[0]).batches:
            batches.setdefault(found[0].__name__, (found[0], []))[1].append((i, path, found[1]))
        else:
            results[i] = read_one(path)
    for reader, items in batches.values():
        with no_cyclic_gc():
            try:
                outs, table, rows = reader.read_many([path for _, path, _ in items])
            except Exception:  # noqa: BLE001 - a batch failure: each file on its own
                outs = None
        if outs is None:
            for i, path, _ in items:
                results[i] = read_one(path)
            continue
        offset = 0  # the files' rows follow each other in the batch's table
        for (i, path, mtime), out, counts in zip(items, outs, rows, strict=True):
            if isinstance(out, BaseException):
                results[i] = failure(str(path), reader.FORMAT, mtime, out)
                continue
            if not isinstance(out, list):  # a RankBlock: its rows follow each other
                spans[id(out)] = (table, offset, sum(counts))
                offset += sum(counts)
                r = success_block(str(path), out, mtime)
                if not blocks or len(out.rows) <= 1:  # its dumps made here, each its span
                    _unblock(r, spans)
                    if r.input.status == "ok":  # one rank's file says its rank and notes
                        r = success(str(path), r.dumps, mtime)
                results[i] = r
                continue
            if counts:  # a packed host's dumps: slices of the batch's table
                for d, c in zip(out, counts, strict=True):
                    spans[id(d)] = (table, offset, c)
                    offset += c
            # else JSON summaries: each dump came with its own table
            results[i] = success(str(path), out, mtime)
    final = []
    for p, r in zip(paths, results, strict=True):
        assert r is not None
        if r.input.status == "error" and r.input.rank is None:
            r.input.rank = rank_from_filename(Path(p).name)[0]
        final.append(r)
    return final


def _progress_bar(total: int) -> tuple[Any, Callable[[], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    task = bar.add_task("reading dumps", total=total)
    return bar, lambda: bar.advance(task)


def read_files(
    files: Sequence[Path],
    workers: int | None,
    progress: bool,
    meanwhile: Callable[[], None] | None = None,
    spans: Spans | None = None,
) -> list[FileResult]:
    spans = {} if spans is None else spans
    if workers is None:
        workers = min(os.cpu_count() or 1, MAX_WORKERS) if _worth_workers(files) else 1
    workers = max(1, min(workers, len(files) or 1))
    bar, advance = _progress_bar(len(files)) if progress else (None, lambda: None)
    results: list[FileResult] = []
    spool = _spool_dir() if workers > 1 else None
    runs: Runs = {}
    try:
        if workers > 1:
            chunks = _chunks(files, workers)
            try:
                with ProcessPoolExecutor(max_workers=workers) as pool:
                    # fork every worker now, before the progress bar starts its thread
                    pool.submit(int).result()
                    if bar is not None:
                        bar.start()
                    jobs = [([str(f) for f in c], spool) for c in chunks]
                    done = pool.map(_read_chunk_to_spool, jobs)
                    if meanwhile is not None:
                        meanwhile()  # the workers read on; their results wait in the queue
                        meanwhile = None
                    for chunk_results, table_path, where in done:
                        for r in chunk_results:
                            if r.block is not None:
                                r.unblock()
                        if table_path is not None:
                            try:
                                _adopt(chunk_results, _unspool(table_path, runs), where, spans)
                            except (OSError, pa.ArrowException, ValueError, StopIteration) as e:
                                chunk_results = [
                                    FileResult(
                                        InputFile(r.input.path, "error", f"cannot read: {e}"),
                                        mtime=r.mtime,
                                    )
                                    if r.dumps
                                    else r
                                    for r in chunk_results
                                ]
                        for r in chunk_results:
                            results.append(r)
                            advance()
            except (BrokenProcessPool, OSError):
                pass  # a worker died (out of memory, killed) or none could start: finish here
        if bar is not None:
            bar.start()
        if meanwhile is not None:
            meanwhile()
        rest = [str(f) for f in files[len(results) :]]
        for i in range(0, len(rest), CHUNK_FILES):
            for r in read_chunk(rest[i : i + CHUNK_FILES], spans):
                results.append(r)
                advance()
    finally:
        if bar is not None:
            bar.stop()
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    return results


def _worth_workers(files: Sequence[Path]) -> bool:
    """Many files, or at least two holding ``PARALLEL_MIN_BYTES`` between them."""
    if len(files) > PARALLEL_MIN_FILES:
        return True
    if len(files) < 2:
        return False
    total = 0
    for f in files:
        with contextlib.suppress(OSError):  # its reader says what is wrong with it
            total += f.stat().st_size
    return total >= PARALLEL_MIN_BYTES


_SPOOL_PREFIX = "frtools-read-"


def _spool_dir() -> str | None:
    """Where worker processes hand their tables over: shared memory where there is some
    (the parent maps each file, no copy), else the temp dir; None: pickle them instead.

    The directory is named after this process, so that the spool of an analysis that was
    killed (its files would hold shared memory until reboot) is removed by the next one."""
    for base in ("/dev/shm", None):
        if base is not None and not os.access(base, os.W_OK):
            continue
        _remove_stale_spools(base or tempfile.gettempdir())
        try:
            return tempfile.mkdtemp(prefix=f"{_SPOOL_PREFIX}{os.getpid()}-", dir=base)
        except OSError:
            continue
    return None


def _remove_stale_spools(base: str) -> None:
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            pid = entry.name[len(_SPOOL_PREFIX) :].split("-", 1)[0]
            if not entry.name.startswith(_SPOOL_PREFIX) or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:  # its analysis is gone
                shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                pass  # alive (another user's): leave it


# what a worker reads into one spooled table: at most this many files and bytes. Small
# files (host summaries, ~10 KB) go in big chunks: each chunk costs a spool file, a pickle
# of its results, a set of dictionaries to unify and its member lists to hash again (at
# 16,384 summaries, 32-file chunks cost 6 s of the parent's time); big dumps in few.
CHUNK_FILES = 32
CHUNK_MAX_FILES = 512
CHUNK_BYTES = 128 << 20


def _chunks(files: Sequence[Path], workers: int) -> list[Sequence[Path]]:
    """Files in chunks for ``workers`` processes: each worker gets several (the last ones
    finish together), none holds more than CHUNK_MAX_FILES files or CHUNK_BYTES bytes."""
    most = max(1, min(CHUNK_MAX_FILES, len(files) // (workers * 8) or 1))
    chunks: list[Sequence[Path]] = []
    start, size = 0, 0
    for i, f in enumerate(files):
        try:
            n = f.stat().st_size
        except OSError:
            n = 0  # its reader says what is wrong with it
        if i > start and (i - start >= most or size + n > CHUNK_BYTES):
            chunks.append(files[start:i])
            start, size = i, 0
        size += n
    if start < len(files):
        chunks.append(files[start:])
    return chunks


def _shared_table(
    results: Sequence[FileResult], spans: Spans
) -> tuple[pa.Table | None, list[list[tuple[int, int]]]]:
    """All entries of ``results`` as one single-chunk table, and per file each dump's
    (offset, rows) in it."""
    pieces: list[pa.Table] = []
    start: dict[int, int] = {}  # id(table) -> its offset in the joined table
    total = 0
    where: list[list[tuple[int, int]]] = []
    for r in results:
        mine = []
        for table, offset, rows in _spans_of(r, spans):
            if id(table) not in start:
                start[id(table)] = total
                pieces.append(table)
                total += table.num_rows
            mine.append((start[id(table)] + offset, rows))
        where.append(mine)
    if not pieces:
        return None, where
    joined = concat_entries(pieces) if len(pieces) > 1 else pieces[0]
    if all(c.num_chunks <= 1 for c in joined.columns):  # one file's table: already one chunk
        return joined, where
    return joined.combine_chunks(), where


def _spans_of(r: FileResult, spans: Spans) -> list[tuple[pa.Table, int, int]]:
    """Each dump's (table, offset, rows), in order (a block's ranks: its rows in turn)."""
    if r.block is not None:
        table, offset, _ = spans[id(r.block)]
        out = []
        for rows in r.block.rows:
            out.append((table, offset, rows))
            offset += rows
        return out
    return [spans.get(id(d)) or (d.entries, 0, d.entries.num_rows) for d in r.dumps]


def _read_chunk_to_spool(
    job: tuple[list[str], str | None],
) -> tuple[list[FileResult], str | None, list[list[tuple[int, int]]]]:
    """In a worker: read a chunk of files and write all their entries as one Arrow IPC
    file, so that the parent maps them instead of unpickling a copy (pickling the tables
    through the pool's pipe cost more than reading the files on two cores). Per file, each
    dump's (offset, rows) in that table. The files' results go back in one pickle, so
    member lists that many ranks share travel once."""
    paths, spool = job
    spans: Spans = {}
    results = read_chunk(paths, spans, blocks=spool is not None)
    if spool is None:
        _materialize(results, spans)
        return results, None, []
    table, where = _shared_table(results, spans)
    if table is None:
        return results, None, where
    table_path = None
    try:
        fd, table_path = tempfile.mkstemp(suffix=".arrow", dir=spool)
        with os.fdopen(fd, "wb") as f:
            _spool_table(table, f)
    except OSError:  # shared memory full (a container's 64 MB): these tables go by the pipe
        if table_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(table_path)
        _materialize(results, spans)
        return results, None, where
    for r in results:
        for d in [] if r.block is not None else r.dumps:
            d.entries = None  # type: ignore[assignment]
    return results, table_path, where


def _unblock(r: FileResult, spans: Spans) -> None:
    """Make a block's dumps, each with its span of the block's rows."""
    if r.block is None:
        return
    placed = _spans_of(r, spans)
    made = r.unblock()
    if made:  # none where making them failed
        for d, span in zip(made, placed, strict=True):
            spans[id(d)] = span


def _materialize(results: Sequence[FileResult], spans: Spans) -> None:
    """Every dump made, with its entries: what goes back by the pipe."""
    for r in results:
        _unblock(r, spans)
        for d in r.dumps:
            entries(d, spans)


def _adopt(
    results: Sequence[FileResult],
    table: pa.Table,
    where: list[list[tuple[int, int]]],
    spans: Spans,
) -> None:
    for r, mine in zip(results, where, strict=True):
        dumps = r.dumps
        if not dumps:  # none made (a block whose dumps failed): its rows go unused
            continue
        for d, (offset, rows) in zip(dumps, mine, strict=True):
            spans[id(d)] = (table, offset, rows)


# A spool file: an Arrow IPC file of the chunk's table less its constant columns (nulls in
# every row, or one int or bool), which the parent puts back as slices of one array it
# shares among the chunks. Every byte a worker writes there is new shared memory, and on a
# VM new memory past the first GB costs ~2.7 s a GB: at 16,384 black boxes the constant
# columns were 33 of 148 bytes a row.
_CONSTANT_COLUMNS = b"frtools.constant_columns"  # JSON [[name, value, dictionary], ...]
_SCHEMA = b"frtools.schema"  # the whole table's schema, serialized
_ROWS = b"frtools.rows"  # its rows (every column may be constant)
# an all-null dictionary column keeps its dictionary in the metadata up to this many values
_KEPT_DICTIONARY = 1024
_VARIES = object()
# (type, value) -> an array of that value, which constant columns of any chunk slice
Runs = dict[tuple[pa.DataType, Any], pa.Array]


def _spool_table(table: pa.Table, sink: Any) -> None:
    """Write ``table`` to ``sink`` as a spool file (``_unspool`` reads it back)."""
    constants, fields, columns = [], [], []
    for field, column in zip(table.schema, table.columns, strict=True):
        value = _constant(column) if table.num_rows else _VARIES
        if value is _VARIES:
            fields.append(field)
            columns.append(column)
        else:
            constants.append([field.name, *value])
    metadata = {
        _CONSTANT_COLUMNS: json.dumps(constants).encode(),
        _SCHEMA: table.schema.serialize().to_pybytes(),
        _ROWS: str(table.num_rows).encode(),
    }
    spooled = pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=metadata))
    with pa.ipc.new_file(sink, spooled.schema) as writer:
        writer.write_table(spooled)


def _constant(column: pa.ChunkedArray) -> Any:
    """(value, dictionary) where every row holds one int or bool (value) or is null (None;
    a dictionary column's dictionary, kept as it was), else ``_VARIES``."""
    kind = column.type
    if column.null_count == len(column):
        if not pa.types.is_dictionary(kind):
            return None, None
        if column.num_chunks != 1 or not pa.types.is_string(kind.value_type):
            return _VARIES
        if len(column.chunk(0).dictionary) > _KEPT_DICTIONARY:
            return _VARIES
        return None, column.chunk(0).dictionary.to_pylist()
    if column.null_count or not (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        return _VARIES
    low, high = (v.as_py() for v in pc.min_max(column).values())
    return (low, None) if low == high else _VARIES


def _unspool(table_path: str, runs: Runs | None = None) -> pa.Table:
    """The table a spool file holds, its constant columns slices of ``runs``' arrays."""
    with pa.memory_map(table_path) as source:
        spooled = pa.ipc.open_file(source).read_all()
    os.unlink(table_path)  # the mapping keeps the pages until the table is gone
    metadata = spooled.schema.metadata or {}
    if _SCHEMA not in metadata:
        return spooled
    schema = pa.ipc.read_schema(pa.py_buffer(metadata[_SCHEMA]))
    constants = {name: rest for name, *rest in json.loads(metadata[_CONSTANT_COLUMNS])}
    runs = {} if runs is None else runs
    columns, kept, rows = [], iter(spooled.columns), int(metadata[_ROWS])
    for field in schema:
        if field.name not in constants:
            columns.append(next(kept))
            continue
        value, dictionary = constants[field.name]
        kind = field.type
        if dictionary is None:
            run = _run(kind, value, rows, runs)
        else:  # null codes into the dictionary the column had
            codes = _run(kind.index_type, None, rows, runs)
            run = pa.DictionaryArray.from_arrays(codes, pa.array(dictionary, kind.value_type))
        columns.append(pa.chunked_array([run], type=kind))
    return pa.Table.from_arrays(columns, schema=schema)


def _run(kind: pa.DataType, value: Any, rows: int, runs: Runs) -> pa.Array:
    """``rows`` rows of ``value`` (None: null), a slice of the array kept for it in ``runs``
    (grown to twice its length when too short)."""
    run = runs.get((kind, value))
    if run is None or len(run) < rows:
        size = max(rows, 2 * len(run)) if run is not None else rows
        run = pa.nulls(size, kind) if value is None else pa.repeat(pa.scalar(value, kind), size)
        runs[(kind, value)] = run
    return run.slice(0, rows)
