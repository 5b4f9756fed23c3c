"""``load_trace``: a directory (or one file) of dumps -> one ``Trace``.

Each file is read on its own (in worker processes when there are many), into one Arrow
table; then the loader keeps the newest dump of each rank, merges what the files know of
each process group, infers membership where no file knows it (Gloo), maps group-local
P2P peers to global ranks, and concatenates the tables. Whatever goes wrong with one file
becomes that file's ``InputFile`` reason; only "nothing usable at all" raises.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import stat
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from frtools.formats import limits
from frtools.formats.limits import InputRefused, file_kind
from frtools.formats.manifest import MANIFEST_NAME, STACKS_SUFFIX
from frtools.model.ranks import MAX_WORLD_SIZE, valid_world_size
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
    """What reading one file gave: its ``InputFile`` and, if usable, its ``RankDump``."""

    input: InputFile
    dump: RankDump | None = None
    mtime: float = 0.0


def read_file(path: str | Path) -> FileResult:
    """Read one file with whichever reader claims it; never raises.

    An unusable dump still names its rank (from the file name) so that a report can say
    "rank 3: dump truncated" rather than only "rank 3 missing"."""
    result = _read_file(Path(path))
    if result.input.status == "error" and result.input.rank is None:
        result.input.rank = rank_from_filename(Path(path).name)[0]
    return result


def _read_file(path: Path) -> FileResult:
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
    fmt = reader.FORMAT
    # a dump parses into ~100 small containers per entry, none in a cycle: the cyclic GC
    # would only rescan them again and again (half the read time on big dumps)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        dump = reader.read(path)
    except (DumpError, InputRefused) as e:
        return FileResult(InputFile(p, "error", str(e), format=fmt), mtime=st.st_mtime)
    except RecursionError:
        reason = "nests too deeply to be a dump; refused"
        return FileResult(InputFile(p, "error", reason, format=fmt), mtime=st.st_mtime)
    except MemoryError:
        reason = "too large to load (out of memory)"
        return FileResult(InputFile(p, "error", reason, format=fmt), mtime=st.st_mtime)
    except Exception as e:  # a reader bug must cost one file, not the whole analysis
        reason = f"{fmt} reader failed: {type(e).__name__}: {e}"
        return FileResult(InputFile(p, "error", reason, format=fmt), mtime=st.st_mtime)
    finally:
        if gc_was_enabled:
            gc.enable()
    info = InputFile(
        p, "ok", "; ".join(dump.notes), rank=dump.rank_info.rank, format=dump.rank_info.format
    )
    return FileResult(info, dump, st.st_mtime)


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
) -> list[FileResult]:
    if workers is None:
        workers = min(os.cpu_count() or 1, MAX_WORKERS) if len(files) > PARALLEL_MIN_FILES else 1
    workers = max(1, min(workers, len(files) or 1))
    bar, advance = _progress_bar(len(files)) if progress else (None, lambda: None)
    results: list[FileResult] = []
    spool = _spool_dir() if workers > 1 else None
    try:
        if workers > 1:
            chunk = max(1, min(32, len(files) // (workers * 8) or 1))
            try:
                with ProcessPoolExecutor(max_workers=workers) as pool:
                    # fork every worker now, before the progress bar starts its thread
                    pool.submit(int).result()
                    if bar is not None:
                        bar.start()
                    jobs = [(str(f), spool) for f in files]
                    done = pool.map(_read_to_spool, jobs, chunksize=chunk)
                    if meanwhile is not None:
                        meanwhile()  # the workers read on; their results wait in the queue
                        meanwhile = None
                    for r, table_path in done:
                        if table_path is not None and r.dump is not None:
                            try:
                                r.dump.entries = _unspool(table_path)
                            except (OSError, pa.ArrowException) as e:
                                r = FileResult(
                                    InputFile(r.input.path, "error", f"cannot read: {e}"),
                                    mtime=r.mtime,
                                )
                        results.append(r)
                        advance()
            except (BrokenProcessPool, OSError):
                pass  # a worker died (out of memory, killed) or none could start: finish here
        if bar is not None:
            bar.start()
        if meanwhile is not None:
            meanwhile()
        for f in files[len(results) :]:
            results.append(read_file(f))
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


def _read_to_spool(job: tuple[str, str | None]) -> tuple[FileResult, str | None]:
    """In a worker: read one file and write its entries as an Arrow IPC file, so that the
    parent maps them instead of unpickling a copy (pickling the tables through the pool's
    pipe cost more than reading the files on two cores)."""
    path, spool = job
    result = read_file(path)
    if spool is None or result.dump is None:
        return result, None
    table_path = None
    try:
        fd, table_path = tempfile.mkstemp(suffix=".arrow", dir=spool)
        with os.fdopen(fd, "wb") as f, pa.ipc.new_file(f, result.dump.entries.schema) as w:
            w.write_table(result.dump.entries)
    except OSError:  # shared memory full (a container's 64 MB): this table goes by the pipe
        if table_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(table_path)
        return result, None
    result.dump.entries = None  # type: ignore[assignment]
    return result, table_path


def _unspool(table_path: str) -> pa.Table:
    with pa.memory_map(table_path) as source:
        table = pa.ipc.open_file(source).read_all()
    os.unlink(table_path)  # the mapping keeps the pages until the table is gone
    return table


def _newest_first(results: Iterable[FileResult]) -> list[FileResult]:
    def key(r: FileResult) -> tuple[int, bool, float, str]:
        assert r.dump is not None
        t = r.dump.max_time_created_ns
        # same newest op: the same moment; prefer the file with call sites (pickle over JSON)
        has_stacks = r.dump.entries.column("stack").null_count < r.dump.entries.num_rows
        return (t if t is not None else -1, has_stacks, r.mtime, r.input.path)

    return sorted(results, key=key, reverse=True)


def _groups_recorded(dump: RankDump) -> set[str]:
    return set(pc.unique(dump.entries.column("pg_name")).to_pylist()) - {None}


def _other_recorders(ordered: list[FileResult]) -> tuple[list[FileResult], list[FileResult]]:
    """Split a rank's files (newest first) after the first into other recorders and older
    copies. torch 2.15 keeps one Flight Recorder per backend (Gloo's, ProcessGroupNCCL's,
    the one c10d's hook fills for nccl2): a rank on mixed groups has several records, each
    of other groups, and together they are its record. A file whose groups overlap the
    kept ones', or that holds no op, is an older or poorer copy."""
    assert ordered[0].dump is not None
    seen = _groups_recorded(ordered[0].dump)
    others, older = [], []
    for r in ordered[1:]:
        assert r.dump is not None
        groups = _groups_recorded(r.dump)
        if groups and seen and not groups & seen:
            others.append(r)
            seen |= groups
        else:
            older.append(r)
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


def _merge_groups(dumps: Sequence[RankDump]) -> dict[str, ProcessGroup]:
    """Membership from the files that list it (the most common list where they disagree);
    where none does, from which ranks recorded ops on the group (``inferred``)."""
    descs: dict[str, Counter] = defaultdict(Counter)
    listed: dict[str, Counter] = defaultdict(Counter)
    # one tuple object per distinct member list, counted by id: 16,384 files each listing
    # a 2,048-rank group would otherwise hash and compare 33 M ints over and over
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    by_id: dict[int, tuple[int, ...]] = {}
    for d in dumps:
        for name, g in d.process_groups.items():
            if g.desc:
                descs[name][g.desc] += 1
            if g.ranks:
                g.ranks = canonical.setdefault(g.ranks, g.ranks)
                by_id[id(g.ranks)] = g.ranks
                listed[name][id(g.ranks)] += 1
    names = set(descs) | set(listed)
    for d in dumps:
        names.update(d.process_groups)

    # who recorded ops on a group: needed only for groups no file lists (Gloo), and found
    # per file (one rank each) rather than by grouping millions of entries
    recorded: dict[str, list[int]] = {}
    unlisted = {n for n in names if not listed[n]}
    if unlisted:
        for d in dumps:
            used = d.entries.column("pg_name").unique().to_pylist()
            for name in unlisted.intersection(n for n in used if n is not None):
                recorded.setdefault(name, []).append(d.rank_info.rank)

    groups: dict[str, ProcessGroup] = {}
    for name in sorted(names, key=_pg_sort_key):
        if not name:
            continue
        desc = ""
        if descs[name]:
            # a real description beats PyTorch's placeholder "undefined"
            ranked = sorted(descs[name].items(), key=lambda kv: (kv[0] == "undefined", -kv[1]))
            desc = ranked[0][0]
        if listed[name]:
            ranks_id, _ = listed[name].most_common(1)[0]
            groups[name] = ProcessGroup(name, desc, by_id[ranks_id], inferred=False)
        else:
            members = tuple(sorted(set(recorded.get(name, ()))))
            groups[name] = ProcessGroup(name, desc, members, inferred=True)
    return groups


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
    limits.current()  # a bad FRTOOLS_LIMITS stops here (ConfigError), not file by file
    root = Path(path)
    if not root.exists():
        raise UnusableInput(f"{root}: no such file or directory")
    if world_size is not None and not valid_world_size(world_size):
        raise UnusableInput(
            f"world size {world_size} is beyond the limit of {MAX_WORLD_SIZE} ranks"
        )
    files = _files_under(root)
    if not files:
        raise UnusableInput(f"{root}: no files to read (empty directory)")
    results = _read_all(files, workers, progress, meanwhile)

    inputs: list[InputFile] = [r.input for r in results]
    by_rank: dict[int, list[FileResult]] = defaultdict(list)
    for r in results:
        if r.dump is not None:
            by_rank[r.dump.rank_info.rank].append(r)
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
    for rank, candidates in sorted(by_rank.items()):
        ordered = _newest_first(candidates)
        keep = ordered[0]
        assert keep.dump is not None
        others, older = _other_recorders(ordered)
        chosen[rank] = _merge_recorders(keep.dump, [r.dump for r in others])  # type: ignore[misc]
        kept_inputs[rank] = keep.input
        for r in others:
            _add_reason(r.input, f"another recorder of rank {rank}, merged with {keep.input.path}")
        for r in older:
            r.input.status = "duplicate"
            r.input.reason = (
                f"older dump of rank {rank}; using {keep.input.path}"
                if r.dump is not None and r.dump.entries.num_rows
                else f"nothing beyond the other record of rank {rank}; using {keep.input.path}"
            )
        for r in ordered[1:]:
            r.dump = None  # let go of the table

    dumps = [chosen[r] for r in sorted(chosen)]
    entries = concat_entries([d.entries for d in dumps])
    groups = _merge_groups(dumps)
    for d in dumps:
        for name, g in d.process_groups.items():
            merged = groups.get(name)
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
                _map_peers(d.entries, groups, d.unmapped_peer_groups)
                if d.unmapped_peer_groups
                else d.entries
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


__all__ = ["FileResult", "UnusableInput", "load_trace", "read_file"]
