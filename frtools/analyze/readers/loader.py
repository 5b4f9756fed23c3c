"""``load_trace``: a directory (or one file) of dumps -> one ``Trace``.

Each file is read on its own (in worker processes when there are many), into one Arrow
table; then the loader keeps the newest dump of each rank, merges what the files know of
each process group, infers membership where no file knows it (Gloo), maps group-local
P2P peers to global ranks, and concatenates the tables. Whatever goes wrong with one file
becomes that file's ``InputFile`` reason; only "nothing usable at all" raises.

A file may hold several ranks (a host summary): its reader's ``read_all`` returns one
``RankDump`` per rank, their entries slices of one table. Worker processes hand over one
table per chunk of files, and the final concatenation takes runs of slices of one table as
one slice, so 16,384 host summaries of 8 ranks do not become 131,072 tables.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import stat
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from frtools.formats import limits
from frtools.formats.limits import InputRefused, file_kind
from frtools.formats.manifest import MANIFEST_NAME, STACKS_SUFFIX
from frtools.model.ranks import MAX_WORLD_SIZE, format_ranks, valid_world_size
from frtools.model.trace import InputFile, ProcessGroup, Trace, concat_entries

from .base import DumpError, RankDump, rank_from_filename, read_head
from .registry import UNAVAILABLE, reader_for
from .side_files import apply_side_files

# below this many files, reading in-process beats paying for worker start-up
PARALLEL_MIN_FILES = 64
MAX_WORKERS = 8

_SIDE_FILES = {
    MANIFEST_NAME: "manifest of an frtools dump, not a rank's record",
}
_SIDE_SUFFIXES = {
    STACKS_SUFFIX: "Python stacks text, not a rank's record",
    ".txt": "text file, not a dump",
    ".log": "log file, not a dump",
    ".md": "text file, not a dump",
}


class UnusableInput(Exception):
    """Nothing usable was found (no dump at all, or the path does not exist). The message
    is one line for the user; the CLI exits 2 with it."""


@dataclass
class FileResult:
    """What reading one file gave: its ``InputFile`` and, if usable, its ``RankDump``
    (``more``: the other ranks of a file that holds several)."""

    input: InputFile
    dump: RankDump | None = None
    mtime: float = 0.0
    more: list[RankDump] = field(default_factory=list)

    @property
    def dumps(self) -> list[RankDump]:
        return ([self.dump] if self.dump is not None else []) + self.more


def read_file(path: str | Path) -> FileResult:
    """Read one file with whichever reader claims it; never raises.

    An unusable dump still names its rank (from the file name) so that a report can say
    "rank 3: dump truncated" rather than only "rank 3 missing"."""
    result = _read_file(Path(path))
    if result.input.status == "error" and result.input.rank is None:
        result.input.rank = rank_from_filename(Path(path).name)[0]
    return result


def _classify(path: Path) -> FileResult | tuple[ModuleType, float]:
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


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    # a dump parses into ~100 small containers per entry, none in a cycle: the cyclic GC
    # would only rescan them again and again (half the read time on big dumps)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _failure(p: str, fmt: str, mtime: float, e: BaseException) -> FileResult:
    if isinstance(e, (DumpError, InputRefused)):
        reason = str(e)
    elif isinstance(e, RecursionError):
        reason = "nests too deeply to be a dump; refused"
    elif isinstance(e, MemoryError):
        reason = "too large to load (out of memory)"
    else:  # a reader bug must cost one file, not the whole analysis
        reason = f"{fmt} reader failed: {type(e).__name__}: {e}"
    return FileResult(InputFile(p, "error", reason, format=fmt), mtime=mtime)


def _success(p: str, dumps: list[RankDump], mtime: float) -> FileResult:
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


def _read_file(path: Path) -> FileResult:
    found = _classify(path)
    if isinstance(found, FileResult):
        return found
    reader, mtime = found
    fmt = reader.FORMAT
    with _no_cyclic_gc():
        try:
            read_all = getattr(reader, "read_all", None)
            dumps = read_all(path) if read_all is not None else [reader.read(path)]
        except Exception as e:  # noqa: BLE001 - sorted out by _failure
            return _failure(str(path), fmt, mtime, e)
    return _success(str(path), dumps, mtime)


def _read_chunk(paths: Sequence[str], spans: Spans) -> list[FileResult]:
    """Read several files; those whose reader reads many at once (``read_many``: packed
    host summaries) are read in one call, their dumps' entries left None and found in
    ``spans`` (one table for all of them)."""
    results: list[FileResult | None] = [None] * len(paths)
    batches: dict[str, tuple[ModuleType, list[tuple[int, Path, float]]]] = {}
    for i, p in enumerate(paths):
        path = Path(p)
        found = _classify(path)
        if isinstance(found, FileResult):
            results[i] = found
        elif hasattr(found[0], "read_many"):
            batches.setdefault(found[0].__name__, (found[0], []))[1].append((i, path, found[1]))
        else:
            results[i] = _read_file(path)
    for reader, items in batches.values():
        with _no_cyclic_gc():
            try:
                outs, table, rows = reader.read_many([path for _, path, _ in items])
            except Exception:  # noqa: BLE001 - a batch failure: each file on its own
                outs = None
        if outs is None:
            for i, path, _ in items:
                results[i] = _read_file(path)
            continue
        offset = 0  # the files' rows follow each other in the batch's table
        for (i, path, mtime), out, counts in zip(items, outs, rows, strict=True):
            if isinstance(out, BaseException):
                results[i] = _failure(str(path), reader.FORMAT, mtime, out)
                continue
            if counts:  # a packed host's dumps: slices of the batch's table
                for d, c in zip(out, counts, strict=True):
                    spans[id(d)] = (table, offset, c)
                    offset += c
            # else JSON summaries: each dump came with its own table
            results[i] = _success(str(path), out, mtime)
    final = []
    for p, r in zip(paths, results, strict=True):
        assert r is not None
        if r.input.status == "error" and r.input.rank is None:
            r.input.rank = rank_from_filename(Path(p).name)[0]
        final.append(r)
    return final


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
    return files


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


def _read_all(
    files: Sequence[Path],
    workers: int | None,
    progress: bool,
    meanwhile: Callable[[], None] | None = None,
    spans: Spans | None = None,
) -> list[FileResult]:
    spans = {} if spans is None else spans
    if workers is None:
        workers = min(os.cpu_count() or 1, MAX_WORKERS) if len(files) > PARALLEL_MIN_FILES else 1
    workers = max(1, min(workers, len(files) or 1))
    bar, advance = _progress_bar(len(files)) if progress else (None, lambda: None)
    results: list[FileResult] = []
    spool = _spool_dir() if workers > 1 else None
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
                        if table_path is not None:
                            try:
                                _adopt(chunk_results, _unspool(table_path), where, spans)
                            except (OSError, pa.ArrowException) as e:
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
            for r in _read_chunk(rest[i : i + CHUNK_FILES], spans):
                results.append(r)
                advance()
    finally:
        if bar is not None:
            bar.stop()
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    return results


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


# id(RankDump) -> (table, offset, rows), for one load: a dump whose entries are rows of a
# table it shares with other dumps (a batch of host summaries, a worker's chunk). Its
# ``entries`` stay None until needed (``_entries``): slicing 131,072 tables costs seconds,
# and the final concatenation takes runs of adjacent rows as one slice.
Spans = dict[int, tuple[pa.Table, int, int]]


def _entries(d: RankDump, spans: Spans) -> pa.Table:
    if d.entries is None:
        table, offset, rows = spans[id(d)]
        d.entries = table.slice(offset, rows)
    return d.entries


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
        for d in r.dumps:
            if id(d) in spans:
                table, offset, rows = spans[id(d)]
            else:
                table, offset, rows = d.entries, 0, d.entries.num_rows
            if id(table) not in start:
                start[id(table)] = total
                pieces.append(table)
                total += table.num_rows
            mine.append((start[id(table)] + offset, rows))
        where.append(mine)
    if not pieces:
        return None, where
    joined = concat_entries(pieces) if len(pieces) > 1 else pieces[0]
    return joined.combine_chunks(), where


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
    results = _read_chunk(paths, spans)
    if spool is None:
        _materialize(results, spans)
        return results, None, []
    table, where = _shared_table(results, spans)
    if table is None:
        return results, None, where
    table_path = None
    try:
        fd, table_path = tempfile.mkstemp(suffix=".arrow", dir=spool)
        with os.fdopen(fd, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
    except OSError:  # shared memory full (a container's 64 MB): these tables go by the pipe
        if table_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(table_path)
        _materialize(results, spans)
        return results, None, where
    for r in results:
        for d in r.dumps:
            d.entries = None  # type: ignore[assignment]
    return results, table_path, where


def _materialize(results: Sequence[FileResult], spans: Spans) -> None:
    for r in results:
        for d in r.dumps:
            _entries(d, spans)


def _adopt(
    results: Sequence[FileResult],
    table: pa.Table,
    where: list[list[tuple[int, int]]],
    spans: Spans,
) -> None:
    for r, mine in zip(results, where, strict=True):
        for d, (offset, rows) in zip(r.dumps, mine, strict=True):
            spans[id(d)] = (table, offset, rows)


def _unspool(table_path: str) -> pa.Table:
    with pa.memory_map(table_path) as source:
        table = pa.ipc.open_file(source).read_all()
    os.unlink(table_path)  # the mapping keeps the pages until the table is gone
    return table


def _concat_dumps(dumps: Sequence[RankDump], spans: Spans) -> pa.Table:
    """The dumps' entries in order, a run of adjacent slices of one table taken as one."""
    pieces: list[pa.Table] = []
    run: list[Any] | None = None  # [table, start, end]
    for d in dumps:
        span = spans.get(id(d))
        if span is not None and run is not None and span[0] is run[0] and span[1] == run[2]:
            run[2] += span[2]
            continue
        if run is not None:
            pieces.append(run[0].slice(run[1], run[2] - run[1]))
            run = None
        if span is not None:
            run = [span[0], span[1], span[1] + span[2]]
        else:
            pieces.append(d.entries)
    if run is not None:
        pieces.append(run[0].slice(run[1], run[2] - run[1]))
    return concat_entries(pieces)


def _newest_first(
    candidates: Iterable[tuple[FileResult, RankDump]], spans: Spans
) -> list[tuple[FileResult, RankDump]]:
    def key(c: tuple[FileResult, RankDump]) -> tuple[int, bool, int, float, str]:
        r, d = c
        _entries(d, spans)
        t = d.max_time_created_ns
        # same newest op: the same moment; prefer the file with call sites (pickle over JSON),
        # then the fuller record (a black box over the summary written beside it)
        has_stacks = d.entries.column("stack").null_count < d.entries.num_rows
        return (t if t is not None else -1, has_stacks, d.entries.num_rows, r.mtime, r.input.path)

    return sorted(candidates, key=key, reverse=True)


def _groups_recorded(dump: RankDump) -> set[str]:
    return set(pc.unique(dump.entries.column("pg_name")).to_pylist()) - {None}


Candidate = tuple[FileResult, RankDump]


def _other_recorders(ordered: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """Split a rank's records (newest first) after the first into other recorders and older
    copies. torch 2.15 keeps one Flight Recorder per backend (Gloo's, ProcessGroupNCCL's,
    the one c10d's hook fills for nccl2): a rank on mixed groups has several records, each
    of other groups, and together they are its record. A record whose groups overlap the
    kept ones', or that holds no op, is an older or poorer copy."""
    if len(ordered) == 1:  # the common case: no per-rank scan of the groups column
        return [], []
    seen = _groups_recorded(ordered[0][1])
    others, older = [], []
    for c in ordered[1:]:
        groups = _groups_recorded(c[1])
        if groups and seen and not groups & seen:
            others.append(c)
            seen |= groups
        else:
            older.append(c)
    return others, older


def _merge_recorders(keep: RankDump, others: list[RankDump]) -> RankDump:
    """One rank's record from several recorders' files (disjoint groups)."""
    if not others:
        return keep
    for o in others:
        for name, g in o.process_groups.items():
            if name not in keep.process_groups or (g.ranks and not keep.process_groups[name].ranks):
                keep.process_groups[name] = g
        for name, status in o.rank_info.pg_status.items():
            keep.rank_info.pg_status.setdefault(name, status)
        keep.unmapped_peer_groups |= o.unmapped_peer_groups
        keep.bad_entries += o.bad_entries
        keep.notes.extend(o.notes)
        keep.default_pg_all = keep.default_pg_all or o.default_pg_all
        keep.rank_info.wrapped = keep.rank_info.wrapped or o.rank_info.wrapped
        if o.rank_info.stacks and not keep.rank_info.stacks:
            keep.rank_info.stacks = o.rank_info.stacks
        times = [t for t in (keep.max_time_created_ns, o.max_time_created_ns) if t is not None]
        keep.max_time_created_ns = max(times) if times else None
    keep.entries = concat_entries([keep.entries, *(o.entries for o in others)])
    return keep


def _merge_groups(
    dumps: Sequence[RankDump], spans: Spans
) -> tuple[dict[str, ProcessGroup], set[str], dict[str, str]]:
    """Membership from the files that list it (the most common list where they disagree);
    where none does, from which ranks recorded ops on the group (``inferred``). Also the
    groups whose files disagree (their dissenters get a note: none to look for when empty),
    and the groups whose member lists the records cannot support, with why.

    Plain dicts and one pass: 131,072 ranks name ~400,000 distinct groups (one of each
    size-1 kind per rank); a Counter per group costs seconds there."""
    # name -> {desc: count}, {id(member tuple): count}
    descs: dict[str, dict[str, int]] = {}
    listed: dict[str, dict[int, int]] = {}
    # one tuple object per distinct member list, counted by id: 16,384 files each listing
    # a 2,048-rank group would otherwise hash and compare 33 M ints over and over
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    by_id: dict[int, tuple[int, ...]] = {}
    # a list object several files share (one reader process's parse, a host summary's ranks)
    # is hashed once: 131,072 ranks each naming a 16,384-rank group would hash 2 G ints
    seen: dict[int, tuple[int, ...]] = {}
    # the default group where a file says "all ranks": the loader fills it from the world
    # size, nobody's ops need to be looked at for it
    everyone: set[str] = set()
    refused: dict[str, str] = {}
    for d in dumps:
        for name, g in d.process_groups.items():
            dc = descs.get(name)
            if dc is None:
                dc = descs[name] = {}
                listed[name] = {}
            if g.desc:
                dc[g.desc] = dc.get(g.desc, 0) + 1
            if g.ranks:
                same = seen.get(id(g.ranks))
                if same is None:
                    same = seen[id(g.ranks)] = canonical.setdefault(g.ranks, g.ranks)
                    by_id[id(same)] = same
                g.ranks = same
                lc = listed[name]
                lc[id(same)] = lc.get(id(same), 0) + 1
            elif d.default_pg_all and (name == "0" or g.desc == "default_pg"):
                everyone.add(name)

    # a member list the records cannot support (a tiny file naming a million members) is
    # not believed: the group is inferred as if no file listed it
    cap = limits.current().ranks_supported(len(dumps))
    for name, lc in listed.items():
        for rid in [rid for rid in lc if _claimed(by_id[rid]) > cap]:
            refused[name] = (
                limits.current().unsupported_ranks(
                    f"process group {name}'s member list claims", _claimed(by_id[rid]), len(dumps)
                )
                or ""
            )
            del lc[rid]

    # who recorded ops on a group: needed only for groups no file lists (Gloo), and found
    # per file (one rank each) rather than by grouping millions of entries
    recorded: dict[str, list[int]] = {}
    unlisted = {n for n, lc in listed.items() if not lc} - everyone
    if unlisted:
        for d in dumps:
            # a format with a group table records ops only on the groups it lists
            if not _records_unknown_groups(d) and unlisted.isdisjoint(d.process_groups):
                continue
            used = _entries(d, spans).column("pg_name").unique().to_pylist()
            for name in unlisted.intersection(n for n in used if n is not None):
                recorded.setdefault(name, []).append(d.rank_info.rank)

    groups: dict[str, ProcessGroup] = {}
    disputed: set[str] = set()
    for name in sorted(descs, key=_pg_sort_key):
        if not name:
            continue
        dc = descs[name]
        desc = ""
        if len(dc) == 1:
            desc = next(iter(dc))
        elif dc:
            # a real description beats PyTorch's placeholder "undefined"
            desc = min(dc.items(), key=lambda kv: (kv[0] == "undefined", -kv[1]))[0]
        lc = listed[name]
        if lc:
            if len(lc) > 1:
                disputed.add(name)
            ranks_id = next(iter(lc)) if len(lc) == 1 else max(lc.items(), key=lambda kv: kv[1])[0]
            groups[name] = ProcessGroup(name, desc, by_id[ranks_id], inferred=False)
        else:
            members = tuple(sorted(set(recorded.get(name, ()))))
            groups[name] = ProcessGroup(name, desc, members, inferred=True)
    return groups, disputed, refused


def _claimed(ranks: tuple[int, ...]) -> int:
    """How many ranks a member list makes the analysis expect (its highest rank + 1)."""
    return max(len(ranks), max(ranks) + 1) if ranks else 0


def _records_unknown_groups(d: RankDump) -> bool:
    """Whether a dump may hold ops on groups it does not list (readers of formats without
    a group table)."""
    return d.rank_info.format not in ("frtools", "frtools-summary")


def _pg_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _map_peers(table: pa.Table, groups: dict[str, ProcessGroup], names: set[str]) -> pa.Table:
    """Group-local P2P peers -> global ranks, for groups whose file did not know members."""
    peer = table.column("peer").to_pylist()
    pg = table.column("pg_name").to_pylist()
    changed = False
    for i, (p, name) in enumerate(zip(peer, pg, strict=True)):
        if p is None or name not in names:
            continue
        g = groups.get(name)
        if g is None or not g.ranks:
            continue
        peer[i] = g.ranks[p] if 0 <= p < len(g.ranks) else None
        changed = True
    if not changed:
        return table
    idx = table.schema.get_field_index("peer")
    return table.set_column(idx, table.schema.field(idx), pa.array(peer, type=pa.int32()))


def _read_rank_dumps(
    root: Path,
    workers: int | None,
    progress: bool,
    meanwhile: Callable[[], None] | None,
    spans: Spans,
) -> tuple[list[InputFile], dict[int, RankDump], dict[int, InputFile]]:
    """Every file under ``root`` read, and the newest dump of each rank chosen: the inputs,
    rank -> dump, rank -> the input it came from. Raises ``UnusableInput``."""
    if not root.exists():
        raise UnusableInput(f"{root}: no such file or directory")
    files = _files_under(root)
    if not files:
        raise UnusableInput(f"{root}: no files to read (empty directory)")
    results = _read_all(files, workers, progress, meanwhile, spans)

    inputs: list[InputFile] = [r.input for r in results]
    by_rank: dict[int, list[tuple[FileResult, RankDump]]] = defaultdict(list)
    for r in results:
        for d in r.dumps:
            by_rank[d.rank_info.rank].append((r, d))
    if not by_rank:
        errors = [i for i in inputs if i.status == "error"]
        detail = f"; e.g. {errors[0].path}: {errors[0].reason}" if errors else ""
        extra = f" (reader unavailable: {', '.join(UNAVAILABLE)})" if UNAVAILABLE else ""
        raise UnusableInput(
            f"{root}: no usable Flight Recorder dump among {len(files)} "
            f"file{'s' if len(files) != 1 else ''}{detail}{extra}"
        )

    chosen: dict[int, RankDump] = {}
    kept_inputs: dict[int, InputFile] = {}
    superseded: dict[int, list[int]] = defaultdict(list)
    owners: dict[int, FileResult] = {}
    for rank, candidates in sorted(by_rank.items()):
        ordered = _newest_first(candidates, spans) if len(candidates) > 1 else candidates
        keep, dump = ordered[0]
        others, older = _other_recorders(ordered) if len(ordered) > 1 else ([], [])
        if others:  # the merged record is a table of its own, no longer a slice
            spans.pop(id(dump), None)
            dump = _merge_recorders(dump, [d for _, d in others])
        chosen[rank] = dump
        kept_inputs[rank] = keep.input
        for r, _ in others:
            _add_reason(r.input, f"another recorder of rank {rank}, merged with {keep.input.path}")
        for r, d in older:
            if r.more:  # a file of several ranks: only this rank of it is older
                superseded[id(r)].append(rank)
                owners[id(r)] = r
                continue
            r.input.status = "duplicate"
            r.input.reason = (
                f"older dump of rank {rank}; using {keep.input.path}"
                if d.entries.num_rows
                else f"nothing beyond the other record of rank {rank}; using {keep.input.path}"
            )
            r.dump = None  # let go of the table
    for key, ranks in superseded.items():
        r = owners[key]
        if len(ranks) == len(r.dumps):
            r.input.status = "duplicate"
            r.input.reason = f"ranks {format_ranks(ranks)}: newer or fuller records are used"
        else:
            _add_reason(r.input, f"ranks {format_ranks(ranks)}: newer or fuller records used")
    return inputs, chosen, kept_inputs


def read_rank_dumps(
    path: str | os.PathLike[str], *, workers: int | None = None
) -> tuple[list[InputFile], dict[int, RankDump]]:
    """Every file under ``path`` read and the newest record of each rank chosen, before
    anything across ranks is merged or inferred (what one host's files alone say): the
    inputs and rank -> RankDump. Raises ``UnusableInput`` when nothing is usable."""
    spans: Spans = {}
    inputs, chosen, _ = _read_rank_dumps(Path(path), workers, False, None, spans)
    for d in chosen.values():
        _entries(d, spans)
    return inputs, chosen


def load_trace(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: bool = False,
    world_size: int | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> Trace:
    """Read every dump under ``path`` (a directory, searched recursively, or one file).

    ``workers``: processes reading files in parallel; ``None`` picks min(cpus, 8) when
    there are more than 64 files, else reads in-process. ``world_size``: the job's size when
    the caller knows it (Gloo dumps do not say it, so a lost highest rank is otherwise
    invisible); it wins over what the files suggest. ``meanwhile``: called once in this
    process while worker processes read (the caller's own start-up, e.g. imports, then
    costs no wall time). Raises ``UnusableInput`` when nothing
    usable was found, or a dump's rank does not fit ``world_size``.
    """
    # reading builds millions of small objects in no cycle; the cyclic GC would rescan the
    # growing heap over and over (at 131,072 ranks: 9 s of the 19 s this process spent)
    with _no_cyclic_gc():
        return _load_trace(Path(path), workers, progress, world_size, meanwhile)


def _load_trace(
    root: Path,
    workers: int | None,
    progress: bool,
    world_size: int | None,
    meanwhile: Callable[[], None] | None,
) -> Trace:
    limits.current()  # a bad FRTOOLS_LIMITS stops here (ConfigError), not file by file
    if world_size is not None and not valid_world_size(world_size):
        raise UnusableInput(
            f"world size {world_size} is beyond the limit of {MAX_WORLD_SIZE} ranks"
        )
    spans: Spans = {}
    inputs, chosen, kept_inputs = _read_rank_dumps(root, workers, progress, meanwhile, spans)
    dumps = [chosen[r] for r in sorted(chosen)]
    unsupported = world_size and limits.current().unsupported_ranks(
        "world size", world_size, len(dumps)
    )
    if unsupported:  # --world-size: what the records can support bounds it too
        raise UnusableInput(f"{unsupported} under {root}")
    entries = _concat_dumps(dumps, spans)
    groups, disputed, refused = _merge_groups(dumps, spans)
    for d in dumps if refused else ():
        for name in refused.keys() & d.process_groups.keys():
            if d.process_groups[name].ranks:
                _add_reason(kept_inputs[d.rank_info.rank], f"{refused[name]}: ignored")
                d.process_groups[name].ranks = ()
    for d in dumps if disputed else ():
        for name, g in d.process_groups.items():
            merged = groups.get(name) if name in disputed else None
            if g.ranks and merged is not None and merged.ranks is not g.ranks:
                _add_reason(
                    kept_inputs[d.rank_info.rank],
                    f"lists process group {name} as {list(g.ranks)}; other files as "
                    f"{list(merged.ranks)}, which is used",
                )

    unusable = {i.rank for i in inputs if i.status == "error" and i.rank is not None}
    guessed_world_size, certain = _world_size(dumps, groups, unusable)
    trace = Trace(
        entries=entries,
        ranks={d.rank_info.rank: d.rank_info for d in dumps},
        process_groups=groups,
        inputs=inputs,
        world_size=guessed_world_size if certain else None,
    )
    # manifest.json (job's world size, which processes were gone, hosts) and rank_<R>.stacks
    apply_side_files(trace, root)
    if world_size is not None:
        beyond = [r for r in trace.ranks if r >= world_size]
        if beyond:
            raise UnusableInput(
                f"world size {world_size}, but {root} holds a dump of rank {max(beyond)}"
            )
        trace.world_size = world_size
    trace.world_stated = trace.world_size is not None
    if trace.world_size is None:
        trace.world_size = world_size if world_size is not None else guessed_world_size
    world_size = trace.world_size

    # the default group holds every rank: files that say "all ranks" (big frtools
    # snapshots, a ranks string "all") know it; Gloo dumps leave it to be inferred
    all_ranks = any(d.default_pg_all for d in dumps)
    default = _default_group(groups) or (groups.get("0") if all_ranks else None)
    if default is not None and (default.inferred or not default.ranks) and world_size:
        groups[default.name] = ProcessGroup(
            default.name,
            default.desc,
            tuple(range(world_size)),
            inferred=default.inferred and not all_ranks,
        )
    if any(d.unmapped_peer_groups for d in dumps):
        trace.entries = concat_entries(
            [
                _map_peers(_entries(d, spans), groups, d.unmapped_peer_groups)
                if d.unmapped_peer_groups
                else _entries(d, spans)
                for d in dumps
            ]
        )
    for info in trace.ranks.values():
        if info.world_size is None:
            info.world_size = world_size
    return trace


def _add_reason(info: InputFile, reason: str) -> None:
    info.reason = f"{info.reason}; {reason}" if info.reason else reason


def _default_group(groups: dict[str, ProcessGroup]) -> ProcessGroup | None:
    for g in groups.values():
        if g.desc == "default_pg":
            return g
    return None


def _world_size(
    dumps: Sequence[RankDump], groups: dict[str, ProcessGroup], unusable: set[int]
) -> tuple[int | None, bool]:
    """The job's world size and whether a file states it (``False``: only the highest
    rank seen + 1, which a manifest may still correct)."""
    default = _default_group(groups)
    if default is not None and default.ranks and not default.inferred:
        return max(default.ranks) + 1, True
    stated = [d.rank_info.world_size for d in dumps if d.rank_info.world_size]
    if stated:
        return max(stated), True
    known = {d.rank_info.rank for d in dumps} | unusable
    for g in groups.values():
        known.update(g.ranks)
    return (max(known) + 1 if known else None), False


__all__ = ["FileResult", "UnusableInput", "load_trace", "read_file", "read_rank_dumps"]
