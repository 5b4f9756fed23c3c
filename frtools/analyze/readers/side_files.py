"""Side files of a dump directory: ``rank_<R>.stacks``, ``rank_<R>.native``,
``manifest.json`` and ``device_<host>.json``.

They are not rank records, so no reader claims them; the loader calls these two functions
on the finished Trace:

* ``attach_stacks(trace, root)`` puts each rank's faulthandler text on ``RankInfo.stacks``
  (when the record reader did not already find stacks);
* ``attach_devices(trace, root)`` puts each host's device facts on ``Trace.devices``;
* ``apply_manifest(trace, root)`` applies what ``frtools dump`` saw at collection time:
  ``RankInfo.alive`` (process gone or not) — and, for an frtools box that recorded no
  ending, ``RankInfo.exit_kind`` ``running``/``killed`` from it —, the host where the record
  lacks one, and the job's world size where no record states it.

Both never raise: a side file that cannot be used becomes its ``InputFile`` reason. Side
files are opened as hostile files are (``frtools.formats.limits``): a link, a FIFO or a
device named like one is refused, never followed or waited on, and only a capped amount is
read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from frtools.formats import device_facts, limits
from frtools.formats.manifest import (
    MANIFEST_NAME,
    NATIVE_STACKS_SUFFIX,
    STACKS_SUFFIX,
    ManifestError,
    NotAManifest,
    rank_in_file_name,
    read_manifest,
)
from frtools.model.ranks import MAX_WORLD_SIZE, format_ranks, valid_rank, valid_world_size
from frtools.model.trace import InputFile, Trace

from .registry import capabilities

# the rank of a stacks file: the number its name ends with (``rank_3.stacks``,
# ``host-a_3.stacks``)
_STACKS_RE = re.compile(rf"(?:^|[^0-9])(\d+){re.escape(STACKS_SUFFIX)}$")
# exit kinds of an frtools record that recorded no ending of its own (liveness decided them)
_UNENDED = (None, "running", "killed")


def _walk(root: Path, match: Callable[[str], bool]) -> list[Path]:
    if root.is_file():
        root = root.parent
    found = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(dirpath) / n for n in sorted(names) if match(n))
    return found


def _set_input(trace: Trace, path: Path, status: str, reason: str, rank: int | None) -> None:
    p = str(path)
    for item in trace.inputs:
        if item.path == p:
            item.status, item.reason, item.rank = status, reason, rank
            return
    trace.inputs.append(InputFile(p, status, reason, rank=rank))


def _read_side(trace: Trace, path: Path, rank: int, limit_name: str, tail: bool) -> str | None:
    """A side file's text, at most the limit ``limit_name`` (with ``tail``, its last part:
    the newest stacks dump is what counts; else a longer file is refused); None, with the
    file's ``InputFile`` reason, when it cannot be read."""
    try:
        data = limits.read_regular(
            path,
            getattr(limits.current(), limit_name),
            limit_name=limit_name,
            follow_symlinks=False,
            tail=tail,
        )
    except limits.InputRefused as exc:
        _set_input(trace, path, "error", str(exc), rank)
        return None
    except OSError as exc:
        _set_input(trace, path, "error", f"cannot read: {exc.strerror or exc}", rank)
        return None
    return data.decode("utf-8", errors="replace")


def _stacks_rank(name: str) -> int | None:
    m = _STACKS_RE.search(name)
    if not m or len(m.group(1)) > len(str(MAX_WORLD_SIZE)):
        return None
    rank = int(m.group(1))
    return rank if valid_rank(rank) else None


def attach_stacks(trace: Trace, root: str | os.PathLike[str]) -> None:
    """Attach ``rank_<R>.stacks`` files under ``root`` to their ranks' ``RankInfo.stacks``.

    When several files name the same rank, the one next to the rank's record wins, else
    the newest.
    """
    by_rank: dict[int, list[Path]] = {}
    for path in _walk(Path(root), lambda n: n.endswith(STACKS_SUFFIX)):
        rank = _stacks_rank(path.name)
        if rank is None:
            _set_input(trace, path, "skipped", "stacks file without a rank in its name", None)
            continue
        by_rank.setdefault(rank, []).append(path)
    for rank, paths in sorted(by_rank.items()):
        info = trace.ranks.get(rank)
        if info is None:
            for p in paths:
                _set_input(trace, p, "skipped", f"stacks of rank {rank}, which has no record", rank)
            continue
        source_dir = Path(info.source).parent if info.source else None

        def preference(p: Path, source_dir: Path | None = source_dir) -> tuple[bool, float]:
            try:
                mtime = p.stat().st_mtime
            except OSError:
                mtime = 0.0
            return (p.parent == source_dir, mtime)

        ordered = sorted(paths, key=preference, reverse=True)
        chosen = ordered[0]
        text = _read_side(trace, chosen, rank, "stacks_bytes", tail=True)
        if text is None:
            continue
        if info.stacks is None and text.strip():
            info.stacks = text
        _set_input(trace, chosen, "ok", f"Python stacks of rank {rank}", rank)
        for p in ordered[1:]:
            _set_input(trace, p, "duplicate", f"older stacks of rank {rank}; using {chosen}", rank)


def attach_native_stacks(trace: Trace, root: str | os.PathLike[str]) -> None:
    """Attach ``rank_<R>.native`` files (py-spy's JSON, read whole up to
    ``native_stacks_bytes``) to their ranks' ``RankInfo.native_stacks``; the one next to the
    rank's record wins. The text is parsed later, as untrusted, by ``analyze.stacks``."""
    for path in _walk(Path(root), lambda n: n.endswith(NATIVE_STACKS_SUFFIX)):
        rank = rank_in_file_name(path.name, NATIVE_STACKS_SUFFIX)
        info = trace.ranks.get(rank) if rank is not None else None
        if info is None:
            _set_input(trace, path, "skipped", "native stacks of no rank with a record", rank)
            continue
        if info.native_stacks is not None and path.parent != Path(info.source).parent:
            _set_input(trace, path, "duplicate", f"native stacks of rank {rank} again", rank)
            continue
        text = _read_side(trace, path, rank, "native_stacks_bytes", tail=False)
        if text is None:
            continue
        info.native_stacks = text
        _set_input(trace, path, "ok", f"native stacks of rank {rank} (py-spy)", rank)


def apply_manifest(trace: Trace, root: str | os.PathLike[str]) -> None:
    """Apply every ``manifest.json`` under ``root``: which ranks' processes were gone at
    collection time, their hosts, the world size."""
    for path in _walk(Path(root), lambda n: n == MANIFEST_NAME):
        try:
            data = read_manifest(path)
        except NotAManifest as exc:
            _set_input(trace, path, "skipped", str(exc), None)
            continue
        except ManifestError as exc:
            _set_input(trace, path, "error", str(exc), None)
            continue
        notes: list[str] = []
        ranks = data.get("ranks") if isinstance(data.get("ranks"), dict) else {}
        for key, entry in ranks.items():
            if not isinstance(entry, dict) or not str(key).isdigit() or len(str(key)) > 8:
                continue
            info = trace.ranks.get(int(key))
            if info is None:
                continue
            alive = entry.get("alive")
            if isinstance(alive, bool):
                info.alive = alive
                if capabilities(info.format).records_ending and info.exit_kind in _UNENDED:
                    # the box recorded no ending: liveness at collection time decides
                    info.exit_kind = "running" if alive else "killed"
            if info.host is None and isinstance(entry.get("host"), str):
                info.host = entry["host"]
        world = data.get("world_size")
        if isinstance(world, int) and not isinstance(world, bool) and world > 0:
            if not valid_world_size(world):
                notes.append(
                    f"world_size {world} is beyond the limit of {MAX_WORLD_SIZE} ranks; ignored"
                )
            elif unsupported := limits.current().unsupported_ranks(
                "world_size", world, len(trace.ranks)
            ):
                notes.append(f"{unsupported}; ignored")
            elif trace.world_size is None:
                trace.world_size = world
        gone = _rank_list(data.get("ranks_gone"))
        silent = _rank_list(data.get("ranks_no_answer"))
        parts = [
            f"collected by `frtools dump` ({_short(data.get('mode', '?'))}) on "
            f"{_short(data.get('host'))}"
        ]
        if gone:
            parts.append(f"process gone: ranks {format_ranks(gone)}")
        if silent:
            parts.append(f"did not answer: ranks {format_ranks(silent)}")
        _set_input(trace, path, "ok", "; ".join(parts + notes), None)


def _rank_list(value: object) -> list[int]:
    """The valid ranks of a manifest's rank list (anything else in it is ignored)."""
    if not isinstance(value, list):
        return []
    return [r for r in value if valid_rank(r)]


def _short(value: object, n: int = 80) -> str:
    text = str(value) if isinstance(value, (str, int, float)) or value is None else "?"
    return text if len(text) <= n else text[: n - 1] + "…"


def attach_devices(trace: Trace, root: str | os.PathLike[str]) -> None:
    """Read every ``device_<host>.json`` under ``root`` (``formats.device_facts``, checked
    field by field) into ``Trace.devices``; of two files of one host the later collection wins.
    A refused file is its ``InputFile`` reason, never an error of the analysis."""
    for path in _walk(Path(root), device_facts.is_device_file):
        try:
            facts = device_facts.read(path)
        except device_facts.DeviceFactsError as exc:
            _set_input(trace, path, "skipped", str(exc), None)
            continue
        old = trace.devices.get(facts.host)
        if old is not None and (old.collected_ns or 0) >= (facts.collected_ns or 0):
            _set_input(trace, path, "duplicate", f"older device facts of {facts.host}", None)
            continue
        if old is not None:
            _set_input(
                trace, Path(old.path), "duplicate", f"older device facts of {old.host}", None
            )
        trace.devices[facts.host] = facts
        got = ", ".join(f"{s.source} {s.status}" for s in facts.sources) or "no sources"
        _set_input(trace, path, "ok", _short(f"device facts of {facts.host} ({got})", 200), None)


def apply_side_files(trace: Trace, root: str | os.PathLike[str]) -> None:
    """All of the above, in the order the loader should run them."""
    apply_manifest(trace, root)
    attach_stacks(trace, root)
    attach_native_stacks(trace, root)
    attach_devices(trace, root)
