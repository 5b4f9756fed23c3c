"""``load_trace``: a directory (or one file) of dumps -> one ``Trace``.

Thin over the readers: every file is read (``parallel``: in worker processes when there are
many; ``files``: one file and its reader), the newest record of each rank kept
(``merge``), membership merged from what the files know (``frtools.analyze.membership``),
group-local P2P peers mapped to global ranks (``merge``), and the world size settled.
Whatever goes wrong with one file becomes that file's ``InputFile`` reason; only "nothing
usable at all" raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from frtools.analyze import membership
from frtools.analyze.memory import keep_until_exit
from frtools.formats import limits
from frtools.model.ranks import MAX_WORLD_SIZE, valid_world_size
from frtools.model.trace import InputFile, Trace, concat_entries

from .base import RankDump
from .files import FileResult, files_under, no_cyclic_gc, read_file
from .merge import add_reason, choose, concat_dumps, map_peers, set_aside_earlier_runs
from .parallel import (  # noqa: F401 - the spool's two: tests reach them here
    Spans,
    _read_chunk_to_spool,
    _remove_stale_spools,
    entries,
    read_files,
)
from .registry import UNAVAILABLE, capabilities
from .side_files import apply_side_files


class UnusableInput(Exception):
    """Nothing usable was found (no dump at all, or the path does not exist). The message
    is one line for the user; the CLI exits 2 with it."""


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
    files = files_under(root)
    if not files:
        raise UnusableInput(f"{root}: no files to read (empty directory)")
    results = read_files(files, workers, progress, meanwhile, spans)

    inputs: list[InputFile] = [r.input for r in results]
    if not any(r.dumps for r in results):
        errors = [i for i in inputs if i.status == "error"]
        detail = f"; e.g. {errors[0].path}: {errors[0].reason}" if errors else ""
        extra = f" (reader unavailable: {', '.join(UNAVAILABLE)})" if UNAVAILABLE else ""
        raise UnusableInput(
            f"{root}: no usable Flight Recorder dump among {len(files)} "
            f"file{'s' if len(files) != 1 else ''}{detail}{extra}"
        )

    chosen, kept_inputs = choose(results, spans)
    set_aside_earlier_runs(chosen, kept_inputs)
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
        entries(d, spans)
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
    with no_cyclic_gc():
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
    table = concat_dumps(dumps, spans)
    stated = membership.stated(
        dumps,
        lambda d: entries(d, spans).column("pg_name").unique().to_pylist(),
        lambda d: capabilities(d.rank_info.format).lists_all_groups,
    )
    groups, disputed, refused = stated.groups, stated.disputed, stated.refused
    for d in dumps if refused else ():
        for name in refused.keys() & d.process_groups.keys():
            if d.process_groups[name].ranks:
                add_reason(kept_inputs[d.rank_info.rank], f"{refused[name]}: ignored")
                d.process_groups[name].ranks = ()
    for d in dumps if disputed else ():
        for name, g in d.process_groups.items():
            merged = groups.get(name) if name in disputed else None
            if g.ranks and merged is not None and merged.ranks is not g.ranks:
                add_reason(
                    kept_inputs[d.rank_info.rank],
                    f"lists process group {name} as {list(g.ranks)}; other files as "
                    f"{list(merged.ranks)}, which is used",
                )

    unusable = {i.rank for i in inputs if i.status == "error" and i.rank is not None}
    guessed_world_size, certain = membership.world_size(dumps, groups, unusable)
    trace = Trace(
        entries=table,
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

    membership.with_world(groups, world_size, any(d.default_pg_all for d in dumps))
    if any(d.unmapped_peer_groups for d in dumps):
        trace.entries = concat_entries(
            [
                map_peers(entries(d, spans), groups, d.unmapped_peer_groups)
                if d.unmapped_peer_groups
                else entries(d, spans)
                for d in dumps
            ]
        )
    for info in trace.ranks.values():
        if info.world_size is None:
            info.world_size = world_size
    # the per-rank objects reading left, not their tables (the trace holds what it needs)
    for d in dumps:
        d.entries = None  # type: ignore[assignment]
    keep_until_exit(dumps, chosen)
    return trace


__all__ = ["FileResult", "UnusableInput", "load_trace", "read_file", "read_rank_dumps"]
