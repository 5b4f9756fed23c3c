"""Reading a PyTorch Flight Recorder dump: the one normalizer of every version.

``normalize`` turns a parsed dump (plain dicts and lists, from pickle or JSON, any version
1.x … 2.x) into a ``TorchDump``: the Trace's entry columns (one Arrow table, built column by
column: no per-entry Python objects outlive the call) and what the top level says.
``native_columns`` does the same from the columns of the native pickle parser
(``frtools/analyze/readers/_native/frpickle.cpp``), with numpy over the few distinct values
instead of a loop over every entry, and leaves the table to ``entries_table``, which joins
several files' columns into one (a worker's chunk); both apply the same rules. Every lookup
takes the newest key first and falls back to the older ones (``frtools.formats.torch_fr``'s
version table), so one code path reads them all.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from frtools.formats import limits
from frtools.formats.limits import strict_int
from frtools.model.codes import join_dictionaries
from frtools.model.ops import P2P_OPS
from frtools.model.ranks import MAX_WORLD_SIZE, valid_rank
from frtools.model.trace import (
    ENTRY_SCHEMA,
    MAX_REPLACED_NOTES,
    ProcessGroup,
    call_site,
    earlier_incarnation_note,
    format_frame,
    is_default,
    replaced_instances_note,
    restart_cut,
    sizes_key,
)

from . import READ_KEYS, STATUS_KEYS, parse_member_list, parse_profiling_name

_DICT = pa.dictionary(pa.int32(), pa.string())


class TorchDumpError(ValueError):
    """Not a usable Flight Recorder dump; the message is a one-line reason."""


@dataclass
class TorchDump:
    """One rank's dump, normalized: the Trace's entry columns (``ENTRY_SCHEMA``) and what
    the top level says. ``process_groups`` holds what this dump knows of each group
    (``ranks=()`` where it does not know the members); ``unmapped_peer_groups`` names groups
    whose P2P ``peer`` values are still group-local, for lack of their members."""

    rank: int
    host: str | None
    version: str
    pid: int | None
    comm_lib_version: str | None
    pg_status: dict[str, dict[str, int]]
    process_groups: dict[str, ProcessGroup]
    default_pg_all: bool  # the default group's members were written as "all ranks"
    entries: pa.Table | None  # None from native_columns: its EntryColumns make the table
    unmapped_peer_groups: set[str] = field(default_factory=set)
    bad_entries: int = 0
    notes: list[str] = field(default_factory=list)


def _sizes(v: Any) -> str:
    if v is None:
        return ""
    try:
        return sizes_key(v)
    except (TypeError, ValueError):
        return ""


_CANONICAL_SIZES = re.compile(r"^\[(\[(-?\d+(,-?\d+)*)?\](,\[(-?\d+(,-?\d+)*)?\])*)?\]$")


def _sizes_column(values: list[Any]) -> list[str]:
    """``str()`` of a list of int lists without spaces equals ``trace.sizes_key`` and is
    several times faster; the few distinct results are checked, odd ones recomputed.
    Values the pickle shared (one object, many entries) are converted once, by ``id``:
    the objects stay alive for the whole call."""
    by_id: dict[int, str] = {}
    out = []
    for v in values:
        t = by_id.get(id(v))
        if t is None:
            t = str(v).replace(" ", "") if v.__class__ is list else _sizes(v)
            by_id[id(v)] = t
        out.append(t)
    bad = {t for t in set(out) if t and not _CANONICAL_SIZES.match(t)}
    if bad:
        out = [_sizes(v) if t in bad else t for t, v in zip(out, values, strict=True)]
    return out


def _dtypes_column(values: list[Any]) -> list[str]:
    try:
        return [",".join(v) if v.__class__ is list else _dtypes(v) for v in values]
    except TypeError:
        return [_dtypes(v) for v in values]


def _dtypes(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, (list, tuple)):
        return ""
    return ",".join(str(d) for d in v)


def _pg_status(
    raw: Any, pg_id_to_name: Mapping[str, str], replaced: Set[str] = frozenset()
) -> tuple[dict[str, dict[str, int]], str]:
    """pg_status is keyed by the group's *uid* (``pg_id``), not its name; values are ints
    (pickle), strings (JSON) or, in a few builds, a bare int (the last enqueued seq).
    ``replaced``: uids of destroyed instances whose name a later instance took (skipped)."""
    out: dict[str, dict[str, int]] = {}
    note = ""
    if not isinstance(raw, Mapping):
        return out, ("pg_status not a mapping; ignored" if raw is not None else "")
    named = set(pg_id_to_name.values())
    for key, status in raw.items():
        if str(key) in replaced:
            continue
        # A uid with no entry left in the buffer cannot be named in general (uids and names
        # are both small integers, so str(uid) would silently hit another group). Except
        # uid 0: the default group is every process's first group, uid 0 and name "0"
        # (NCCL and Gloo alike) — and its status is what tells where a rank stopped. Not
        # in a process that restarted (``replaced``): uid 0 was the first incarnation's.
        name = pg_id_to_name.get(str(key))
        if name is None:
            if str(key) == "0" and replaced:
                continue
            name = "0" if str(key) == "0" and "0" not in named else f"pg_id:{key}"
        counters: dict[str, int] = {}
        if isinstance(status, Mapping):
            for k in STATUS_KEYS:
                n = strict_int(status.get(k))
                if n is not None and n >= 0:
                    counters[k] = n
        else:
            n = strict_int(status)
            if n is not None and n >= 0:
                counters["last_enqueued_collective"] = n
            else:
                note = "some pg_status values unreadable; ignored"
        out[name] = counters
    return out, note


_FRAME_KEY = itemgetter("filename", "line", "name")
# (filename, line, name) per frame -> (call site, stack text), process-wide
_STACK_TEXTS: dict[tuple, tuple[str | None, str]] = {}
_STACK_TEXTS_MAX = 100_000
# caches that outlive a file keep only texts up to this long: a hostile file's huge values
# must not stay in memory once it is read
_CACHED_TEXT_MAX = 64 << 10


class _Stacks:
    """Distinct stacks of one file, interned: a job repeats a few dozen call paths."""

    def __init__(self) -> None:
        self.index: dict[tuple, int] = {}
        self.by_id: dict[int, int] = {}
        self.sites: list[str | None] = []
        self.texts: list[str] = []

    def intern(self, frames: Any) -> int | None:
        if not frames or frames.__class__ is not list:
            return None
        # a list the pickle shared between entries: same object, same stack (the caller
        # keeps every frames list alive while interning, so an id is not reused)
        i = self.by_id.get(id(frames))
        if i is not None:
            return i
        i = self._intern(frames)
        if i is not None:
            self.by_id[id(frames)] = i
        return i

    def _intern(self, frames: list) -> int | None:
        try:
            key = tuple(map(_FRAME_KEY, frames))
        except (KeyError, TypeError):
            try:
                key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in frames)
            except AttributeError:
                return None
        try:
            i = self.index.get(key)
        except TypeError:  # a frame field that is a list or dict: no stack to show
            return None
        if i is None:
            i = len(self.texts)
            self.index[key] = i
            # frames of plain str / int fields are their key: their texts are shared by
            # every file of the job (a 1,024-rank job has a few dozen distinct stacks)
            plain = all(
                f.__class__ is str and n.__class__ is int and m.__class__ is str for f, n, m in key
            )
            texts = _STACK_TEXTS.get(key) if plain else None
            if texts is None:
                texts = (call_site(frames), "\n".join(format_frame(f) for f in frames))
                if plain and len(texts[1]) <= _CACHED_TEXT_MAX:
                    if len(_STACK_TEXTS) >= _STACK_TEXTS_MAX:
                        _STACK_TEXTS.clear()
                    _STACK_TEXTS[key] = texts
            self.sites.append(texts[0])
            self.texts.append(texts[1])
        return i


@dataclass
class _TopLevel:
    """What a dump's top level says (everything but the entries' columns)."""

    dump: Mapping[str, Any]
    rank: int
    host: str | None
    version: str
    groups: dict[str, ProcessGroup]
    default_pg_all: bool
    notes: list[str]
    nameless: tuple[int, ...] = ()  # the members of Gloo's nameless pg_config entry


def normalize(dump: Any, name_rank: int | None = None, name_host: str | None = None) -> TorchDump:
    """One parsed dump -> ``TorchDump``; ``TorchDumpError`` when it is not one.

    ``name_rank`` / ``name_host``: what the file's name says, used where the dump has no
    ``rank`` / ``host`` of its own (PyTorch's never have a rank)."""
    if not isinstance(dump, Mapping):
        raise TorchDumpError(
            f"not a Flight Recorder dump: top level is {type(dump).__name__}, not a dict"
        )
    notes: list[str] = []
    if "entries" in dump:
        raw_entries = dump["entries"]
    elif "version" in dump and ("pg_status" in dump or "pg_config" in dump):
        # dumped with includeCollectives=False: no ops, but pg_status still says where
        # each group stopped
        raw_entries = []
        notes.append("dump without entries (includeCollectives=False); group status only")
    else:
        keys = ", ".join(sorted(map(str, dump))[:6])
        raise TorchDumpError(
            f"not a Flight Recorder dump: no 'entries' key (keys: {keys or 'none'})"
        )
    if not isinstance(raw_entries, list):
        raise TorchDumpError(f"'entries' is {type(raw_entries).__name__}, not a list")
    top = _top_level(encodable(dump, skip="entries"), name_rank, name_host, notes)
    cols, pg_id_to_name, pg_descs, unmapped, bad, replaced = _columns(raw_entries, top.groups)
    if bad:
        notes.append(f"{bad} malformed entr{'y' if bad == 1 else 'ies'} skipped")
    notes.extend(replaced.notes)
    cols["rank"] = [top.rank] * len(cols["op"])
    table = entries_table([EntryColumns(len(cols["op"]), cols, notes)])
    return _torch_dump(top, table, pg_id_to_name, pg_descs, unmapped, bad, replaced=replaced.uids)


def native_columns(
    top_dump: Mapping[str, Any],
    native: Mapping[str, Any],
    name_rank: int | None = None,
    name_host: str | None = None,
) -> tuple[TorchDump, EntryColumns]:
    """``normalize`` for a dump the native parser (``_frpickle.parse``) already turned into
    columns, with numpy over the few distinct values instead of a Python loop over every
    entry (not for one whose group names ``reuses_group_names``: ``normalize`` leaves the
    replaced instances out): the ``TorchDump`` (its ``entries`` None) and its entry columns, for
    ``entries_table`` to make into a table, alone or joined with other files' (a worker's
    chunk of files then costs one Arrow array per column, not ~30 per file)."""
    notes: list[str] = []
    # every text the parser read is valid UTF-8 unless it says some holds a surrogate
    clean = native.get("surrogates", True)
    top = _top_level(
        encodable(top_dump, skip="entries") if clean else top_dump, name_rank, name_host, notes
    )
    cols, pg_id_to_name, pg_descs, unmapped, bad = _native_columns(native, top.groups)
    if bad:
        notes.append(f"{bad} malformed entr{'y' if bad == 1 else 'ies'} skipped")
    n = native["n"]
    if clean:  # a text may hold a lone surrogate: as UTF-8 carries it, equal ones merged
        for name, col in cols.items():
            if col.__class__ is Coded:
                cols[name] = _dictionary(col.codes, [encodable_text(v) for v in col.values])
    if isinstance(cols["peer"], list):  # peers beyond int32: cleaned and noted, as by Python
        cols["peer"] = _array(ENTRY_SCHEMA.field("peer"), cols["peer"], n, notes)
    cols["rank"] = pa.array(np.full(n, top.rank, dtype=np.int32))
    dump = _torch_dump(top, None, pg_id_to_name, pg_descs, unmapped, bad, clean)
    return dump, EntryColumns(n, cols, notes)


def _top_level(
    dump: Mapping[str, Any], name_rank: int | None, host: str | None, notes: list[str]
) -> _TopLevel:
    """Version, rank, host and the process groups of ``pg_config``."""
    version = str(dump.get("version", "")) or "unversioned"

    # rank: from content where the dump has it (some builds write "rank"), else the name,
    # checked against the groups the file lists (below)
    rank = strict_int(dump.get("rank"))
    stated = rank is not None
    if rank is None:
        rank = name_rank
    if rank is not None and not valid_rank(rank):
        shown = str(rank) if len(str(rank)) <= 24 else str(rank)[:20] + "…"
        raise TorchDumpError(f"rank {shown} is out of range (0 … {MAX_WORLD_SIZE - 1})")
    if isinstance(dump.get("host"), str) and dump["host"]:
        host = dump["host"]

    # process groups this file knows
    groups: dict[str, ProcessGroup] = {}
    default_pg_all = False
    nameless: tuple[int, ...] = ()
    members = 0
    max_members = limits.current().members_per_file
    pg_config = dump.get("pg_config")
    if isinstance(pg_config, Mapping):
        for key, cfg in pg_config.items():
            if isinstance(cfg, Mapping):  # 2.0+: {name: {"name", "desc", "ranks": "[0, 1]"}}
                name = str(cfg.get("name", key) or key)
                ranks = parse_member_list(cfg.get("ranks"))
                desc = str(cfg.get("desc", "") or "")
            elif isinstance(cfg, (list, tuple, str)):  # 1.4: {pg_id: [0, 1]}
                name, ranks, desc = str(key), parse_member_list(cfg), ""
            else:
                continue
            if not name:
                # Gloo's one nameless entry: the world's members in a job of one group;
                # with subgroups '[]' (2.13) or the first subgroup's, on every rank (2.15)
                if isinstance(ranks, tuple):
                    nameless = ranks
                continue
            if ranks == "all":
                default_pg_all = default_pg_all or is_default(name, desc)
                ranks = ()
            members += len(ranks or ())
            if members > max_members:
                raise TorchDumpError(
                    str(
                        limits.exceeded(
                            f"pg_config lists more than {max_members:,} group members",
                            "members_per_file",
                            max_members,
                            unit="ranks",
                        )
                    )
                )
            groups[name] = ProcessGroup(name=name, desc=desc, ranks=ranks or ())
    if not stated:
        rank = _rank_of_groups(rank, groups, notes)
    if rank is None:
        raise TorchDumpError(
            "cannot tell which rank this dump belongs to: the dump has no 'rank', the file "
            "name carries none (expected e.g. rank_3.pkl) and its process groups do not "
            "single one out"
        )
    return _TopLevel(dump, rank, host, version, groups, default_pg_all, notes, nameless)


# groups up to this size check a file name's rank cheaply (a tuple scan each)
_CHECKED_GROUP_SIZE = 64


def _rank_of_groups(
    name_rank: int | None, groups: Mapping[str, ProcessGroup], notes: list[str]
) -> int | None:
    """The rank of a dump that states none, from its file name and its groups.

    PyTorch's NCCL recorder lists in ``pg_config`` only the groups its process is a member
    of, so their member lists meet in its rank alone (every file of the real Megatron jobs
    at hand). A file name is the writer's and may be wrong: PyTorch's writer takes the rank
    of the process's first group for good, which an in-process restart can renumber, and
    files get renamed. Where the groups single out another rank than the name, the groups
    win (noted); where they single out none, the name stands. The name is checked against
    the small groups only (a scan of a few members each); the intersection of all of them
    is taken only where one of those leaves the name out."""
    listed = [g.ranks for g in groups.values() if g.ranks]
    if not listed:
        return name_rank
    if name_rank is not None and all(
        name_rank in ranks for ranks in listed if len(ranks) <= _CHECKED_GROUP_SIZE
    ):
        return name_rank
    common = set(min(listed, key=len))
    for ranks in sorted(listed, key=len)[1:]:
        common.intersection_update(ranks)
        if not common:
            break
    if len(common) != 1 or name_rank in common:
        return name_rank
    (rank,) = common
    notes.append(
        f"rank {rank} from the process groups the dump lists (every one holds it, and no "
        "other rank)" + (f"; its file name says rank {name_rank}" if name_rank is not None else "")
    )
    return rank


def _nameless_is_world(
    top: _TopLevel, pg_id_to_name: Mapping[str, str], pg_status: Mapping[str, Any]
) -> bool:
    """Whether Gloo's nameless pg_config entry lists the world group: in a file that knows
    of no group but the world (no other group in its entries or pg_status), 0..n-1 holding
    this rank. (Seen on torch 2.13 and 2.15; with subgroups it lists '[]' or a subgroup;
    '[0, 1]' is also torch 2.15's placeholder, so a 2-rank list is not believed.)"""
    ranks = top.nameless
    if len(ranks) < 3 or ranks != tuple(range(len(ranks))) or not 0 <= top.rank < len(ranks):
        return False
    if set(pg_id_to_name.values()) - {"0"} or set(pg_status) - {"0"}:
        return False
    world = top.groups.get("0")
    return world is None or not world.ranks


def _torch_dump(
    top: _TopLevel,
    table: pa.Table | None,
    pg_id_to_name: dict[str, str],
    pg_descs: dict[str, str],
    unmapped: set[str],
    bad: int,
    clean: bool = True,
    replaced: Set[str] = frozenset(),
) -> TorchDump:
    groups, notes, dump = top.groups, top.notes, top.dump
    if clean:
        pg_id_to_name, pg_descs = encodable(pg_id_to_name), encodable(pg_descs)
    for name, desc in pg_descs.items():
        g = groups.get(name)
        if g is None:
            groups[name] = ProcessGroup(name=name, desc=desc, ranks=())
        elif not g.desc and desc:
            g.desc = desc

    pg_status, note = _pg_status(dump.get("pg_status"), pg_id_to_name, replaced)
    if note:
        notes.append(note)
    if _nameless_is_world(top, pg_id_to_name, pg_status):
        groups["0"] = ProcessGroup(name="0", desc=pg_descs.get("0") or "default_pg",
                                   ranks=top.nameless)  # fmt: skip
    comm = dump.get("comm_lib_version", dump.get("nccl_version"))
    return TorchDump(
        rank=top.rank,
        host=top.host,
        version=top.version,
        pid=strict_int(dump.get("pid")),
        comm_lib_version=str(comm) if comm not in (None, "") else None,
        pg_status=pg_status,
        process_groups=groups,
        default_pg_all=top.default_pg_all,
        entries=table,
        unmapped_peer_groups=unmapped,
        bad_entries=bad,
        notes=notes,
    )


# torch >= 2.15: c10d's FlightRecorderHook retires an op in its post-hook, at issue, on a
# backend without a completion hook (FlightRecorderHook.hpp): such an entry reads
# "scheduled" and retired whether or not it finished. Its completion is unknown.
HOOK_ENGINE = "c10d:"


def _retired_at_issue(table: pa.Table) -> pa.Table:
    if not table.num_rows:
        return table
    names = table["profiling_name"]
    if pa.types.is_dictionary(names.type):
        # no hooked engine among the few distinct names (an NCCL or Gloo dump): done, without
        # decoding two columns of every entry (the names as Python strings: a dump's dozen
        # take less than one compute call)
        distinct = (v for c in names.chunks for v in c.dictionary.to_pylist())
        if not any(v is not None and v.startswith(HOOK_ENGINE) for v in distinct):
            return table
        names = names.cast(names.type.value_type)
    states = table["state"]
    if pa.types.is_dictionary(states.type):
        states = states.cast(states.type.value_type)
    hooked = pc.and_(pc.starts_with(names, HOOK_ENGINE), pc.equal(states, "scheduled"))
    hooked = pc.fill_null(hooked, False)
    if not pc.any(hooked).as_py():
        return table
    i = table.schema.get_field_index("retired")
    retired = pc.if_else(hooked, pa.scalar(None, type=pa.bool_()), table["retired"])
    return table.set_column(i, table.schema.field(i), retired)


@dataclass
class Coded:
    """A dictionary column before Arrow: each row's int32 code into ``values`` (-1: null);
    the values are distinct and none is None."""

    codes: np.ndarray
    values: list[str]


@dataclass
class EntryColumns:
    """One dump's entry columns before Arrow (``ENTRY_SCHEMA`` names): an Arrow array, a
    ``Coded`` column, a list of Python values (cleaned as they become Arrow) or None (all
    null). ``notes``: the dump's notes, which cleaning adds to."""

    n: int
    columns: dict[str, Any]
    notes: list[str]


def entries_table(parts: Sequence[EntryColumns]) -> pa.Table:
    """Several dumps' entries as one Arrow table, one array per column: their rows in
    order, each dictionary column over the values of all of them (in order of first
    appearance, as Arrow's dictionary unification orders them). A column whose values do
    not fit its type is cleaned value by value (bad values become null, and the dump says
    so) instead of failing the file."""
    arrays = []
    for fld in ENTRY_SCHEMA:
        values = [p.columns.get(fld.name) for p in parts]
        if all(v is None for v in values):  # a column no file has (splits, errors)
            arrays.append(pa.nulls(sum(p.n for p in parts), type=fld.type))
            continue
        if fld.type == _DICT and all(v is None or v.__class__ is Coded for v in values):
            arrays.append(_joined_dictionary(values, [p.n for p in parts]))
            continue
        pieces = [_array(fld, v, p.n, p.notes) for p, v in zip(parts, values, strict=True)]
        arrays.append(pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces))
    return _retired_at_issue(pa.Table.from_arrays(arrays, schema=ENTRY_SCHEMA))


def _joined_dictionary(columns: Sequence[Coded | None], ns: Sequence[int]) -> pa.Array:
    parts = [
        (_NO_VALUES, np.full(n, -1, dtype=np.int32), None)
        if c is None
        else (c.values, c.codes, None)
        for c, n in zip(columns, ns, strict=True)
    ]
    return join_dictionaries(parts, _string_array)


_NO_VALUES: tuple[str, ...] = ()


def _array(fld: pa.Field, values: Any, n: int, notes: list[str]) -> pa.Array:
    """One dump's column as an Arrow array of the field's type."""
    if isinstance(values, pa.Array):
        return values if values.type == fld.type else values.cast(fld.type)
    if values is None:
        return pa.nulls(n, type=fld.type)
    if values.__class__ is Coded:
        return _joined_dictionary([values], [n])
    try:
        return pa.array(values, type=fld.type)
    except UnicodeEncodeError:  # lone surrogates: replaced, the rest kept
        return pa.array([_clean_str(v) for v in values], type=fld.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        clean = _CLEANERS.get(str(fld.type), _clean_str)
        notes.append(f"unreadable values in '{fld.name}' set to null")
        return pa.array([clean(v) for v in values], type=fld.type)


def _clean_float(v: Any) -> float | None:
    try:
        return float(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def _clean_bool(v: Any) -> bool | None:
    return bool(v) if isinstance(v, (bool, int)) else None


def _clean_str(v: Any) -> str | None:
    return None if v is None else encodable_text(str(v))


def encodable_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (``\\ud800``, which a pickle or a
    JSON escape may hold) becomes U+FFFD; a valid pair becomes its character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def encodable(value: Any, skip: str | None = None, depth: int = 0) -> Any:
    """``value`` with every text in it (keys too) made ``encodable_text``: what a dump holds
    besides its entries (``skip``), which every output writes as UTF-8 further on."""
    cls = value.__class__
    if cls in _SCALARS:  # most of a dump's top level: no call per number
        return value
    if isinstance(value, str):
        return encodable_text(value)
    if depth > 64:
        return value
    if isinstance(value, Mapping):
        return {
            encodable(k, None, depth + 1): v
            if k == skip or v.__class__ in _SCALARS
            else encodable(v, None, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        if all(v.__class__ in _SCALARS for v in value):
            return value if cls is tuple else list(value)
        return type(value)(encodable(v, None, depth + 1) for v in value)
    return value


_SCALARS = frozenset((int, float, bool, type(None)))


_CLEANERS = {
    "int64": strict_int,
    "int32": lambda v: strict_int(v, lo=-(2**31), hi=2**31 - 1),
    "double": _clean_float,
    "bool": _clean_bool,
    "string": _clean_str,
}


def _fetch(entries: list[dict]) -> dict[str, list[Any]]:
    """The columns every entry has, pulled with one ``itemgetter`` call per entry and
    transposed (several times faster than one ``dict.get`` per key and entry). Keys that
    only some entries carry (``duration_ms``) are left to the caller."""
    if not entries:
        return {}
    first = entries[0]
    # duration_ms is written only once a duration was measured: never in the common set
    keys = [k for k in READ_KEYS if k in first and k != "duration_ms"]
    if len(keys) < 2:
        return {}
    try:
        rows = list(map(itemgetter(*keys), entries))
    except KeyError:  # entries differ in their keys: find the ones all of them have
        keys = [k for k in keys if all(k in e for e in entries)]
        if len(keys) < 2:
            return {}
        rows = list(map(itemgetter(*keys), entries))
    return dict(zip(keys, map(list, zip(*rows, strict=True)), strict=True))


def _is_entry(e: Any) -> bool:
    return isinstance(e, dict) and isinstance(e.get("profiling_name"), str)


def _columns(
    raw_entries: list[Any], groups: dict[str, ProcessGroup]
) -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str], int, Replaced]:
    """Entries -> columns, column by column (list comprehensions and small caches over
    the few distinct values of a column: the hot path for thousands of files). The
    entries of a process-group instance that a later one replaced are left out
    (``Replaced``)."""
    entries = [e for e in raw_entries if _is_entry(e)]
    bad = len(raw_entries) - len(entries)
    cols, pg_id_to_name, pg_descs, unmapped, pg_cache = _entry_columns(entries, groups)
    replaced = Replaced()
    if reuses_group_names(pg_cache):
        replaced = replaced_instances(cols["pg_name"], [e.get("pg_id") for e in entries])
    if not replaced.uids:
        return cols, pg_id_to_name, pg_descs, unmapped, bad, replaced
    kept = [e for e, gone in zip(entries, replaced.rows, strict=True) if not gone]
    cols, pg_id_to_name, pg_descs, unmapped, _ = _entry_columns(kept, groups)
    return cols, pg_id_to_name, pg_descs, unmapped, bad, replaced


@dataclass
class Replaced:
    """Process-group instances whose name a later instance took, in one dump.

    A job that destroys its groups and initializes again in the same process (an in-process
    restart: NVIDIA's inprocess wrapper, torchft) gets the same group names again ("0",
    "1", ...: ``destroy_process_group`` restarts the count), while the Flight Recorder keeps
    one buffer for the process: it then holds the ops of the destroyed communicators under
    those names, with their own uid (``pg_id``) and seqs that start again at 1. Aligned with
    the new ones by name and seq, they would read as a mismatch or a hang of the first
    incarnation. An instance whose last op precedes the first op of another instance of its
    name was gone before that one began: its ops can block nothing now and are left out.
    Instances whose ops interleave (two backends of one group) are both kept."""

    rows: list[bool] = field(default_factory=list)  # per entry: it belongs to one of them
    uids: set[str] = field(default_factory=set)  # their uids
    notes: list[str] = field(default_factory=list)


def reuses_group_names(pairs: Iterable[Any]) -> bool:
    """Whether two distinct ``(process_group, pg_id)`` pairs name one group with two uids
    (cheap: over the distinct pairs, not the entries)."""
    seen: dict[str, str] = {}
    for pg, pg_id in pairs:
        if pg_id is not None and seen.setdefault(_pg_of(pg, pg_id)[0], str(pg_id)) != str(pg_id):
            return True
    return False


def replaced_instances(names: Sequence[str], pg_ids: Sequence[Any]) -> Replaced:
    """Which entries (group names and uids in buffer order) belong to a replaced instance."""
    first: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    for i, (name, uid) in enumerate(zip(names, pg_ids, strict=True)):
        if uid is not None:
            key = (name, str(uid))
            first.setdefault(key, i)
            last[key] = i
    by_name: dict[str, list[tuple[int, str]]] = {}  # name -> (where it began, uid), in order
    for (name, uid), i in first.items():
        by_name.setdefault(name, []).append((i, uid))
    gone = {
        (name, uid)
        for name, began in by_name.items()
        for _, uid in began
        if last[(name, uid)] < began[-1][0]
    }
    if not gone:
        return Replaced()
    ended, cut = _ended_with_restart(first, last, gone, by_name)
    dropped = gone | ended
    rows = [
        uid is not None and (name, str(uid)) in dropped
        for name, uid in zip(names, pg_ids, strict=True)
    ]
    left_out = Counter(
        name
        for name, uid, r in zip(names, pg_ids, rows, strict=True)
        if r and (name, str(uid)) in gone
    )
    notes = [
        replaced_instances_note(
            name,
            "pg_id",
            [uid for _, uid in by_name[name] if (name, uid) in gone],
            by_name[name][-1][1],
            left_out[name],
        )
        for name in sorted(left_out)[:MAX_REPLACED_NOTES]
    ]
    if ended:
        entries = sum(rows) - sum(left_out.values())
        notes.append(earlier_incarnation_note(sorted({n for n, _ in ended}), "pg_id", cut, entries))
    return Replaced(rows, {uid for _, uid in dropped}, notes)


def _ended_with_restart(
    first: dict[tuple[str, str], int],
    last: dict[tuple[str, str], int],
    gone: set[tuple[str, str]],
    by_name: dict[str, list[tuple[int, str]]],
) -> tuple[set[tuple[str, str]], str]:
    """The instances that ended at the restart without a later instance of their name on
    record (``model.trace.restart_cut``: uids grow in creation order), and the first uid
    after it; none where the uids are not all numbers or no uid splits the record."""
    if not all(uid.isdigit() and len(uid) < 19 for _, uid in first):
        return set(), ""
    spans = [(int(uid), i, last[(name, uid)]) for (name, uid), i in first.items()]
    low = max(int(uid) for _, uid in gone)
    high = min(int(by_name[name][-1][1]) for name, _ in gone)
    cut = restart_cut(spans, low, high)
    if cut is None:
        return set(), ""
    return {key for key in first if int(key[1]) < cut and key not in gone}, str(cut)


def _entry_columns(
    entries: list[Any], groups: dict[str, ProcessGroup]
) -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str], dict[Any, Any]]:
    """``_columns`` of well-formed entries, and the distinct (group, uid) pairs seen."""

    fetched = _fetch(entries)

    def col(key: str) -> list[Any]:
        got = fetched.get(key)
        return got if got is not None else [e.get(key) for e in entries]

    # process group: (name, desc) tuple (>= 1.x), JSON list, or only pg_id (oldest)
    pg_cache: dict[Any, tuple[str, str]] = {}
    pg_names: list[str] = []
    pg_desc_col: list[str] = []
    pg_id_to_name: dict[str, str] = {}
    for pg, pg_id in zip(col("process_group"), col("pg_id"), strict=True):
        key = (tuple(pg) if isinstance(pg, list) else pg, pg_id)
        try:
            hit = pg_cache.get(key)
        except TypeError:  # an unhashable oddity in the file: read it, do not cache it
            key, hit = None, None
        if hit is None:
            hit = _pg_of(pg, pg_id)
            if key is not None:
                pg_cache[key] = hit
            if pg_id is not None:
                pg_id_to_name.setdefault(str(pg_id), hit[0])
        pg_names.append(hit[0])
        pg_desc_col.append(hit[1])
    pg_descs = _pg_descs(pg_cache.values())

    # op name and group-local peer from profiling_name ("nccl:send 0->1")
    op_cache: dict[str, tuple[str, int | None]] = {}
    ops: list[str] = []
    local_peers: list[int | None] = []
    profiling = col("profiling_name")
    for pn in profiling:
        hit = op_cache.get(pn)
        if hit is None:
            hit = parse_profiling_name(pn)
            op_cache[pn] = hit
        ops.append(hit[0])
        local_peers.append(hit[1])

    is_p2p = col("is_p2p")
    is_p2p = [
        bool(v) if v is not None else (op in P2P_OPS) for v, op in zip(is_p2p, ops, strict=True)
    ]

    old_seq = bool(entries) and "seq_id" in entries[0] and "collective_seq_id" not in entries[0]
    if not old_seq:
        coll_seq = [v or 0 for v in col("collective_seq_id")]
        p2p_seq = [v or 0 for v in col("p2p_seq_id")]
    else:  # before 2.0 one counter ("seq_id") counted every op of the group
        seq = [v or 0 for v in col("seq_id")]
        coll_seq = [0 if p else s for s, p in zip(seq, is_p2p, strict=True)]
        p2p_seq = [s if p else 0 for s, p in zip(seq, is_p2p, strict=True)]

    peers: list[int | None] = local_peers
    unmapped: set[str] = set()
    if any(p is not None for p in local_peers):
        peers = [
            None if local is None else _global_peer(groups, name, local, unmapped)
            for local, name in zip(local_peers, pg_names, strict=True)
        ]

    interned = _Stacks()
    stack_ids = [interned.intern(f) for f in col("frames")]
    sites = [None if i is None else interned.sites[i] for i in stack_ids]
    stacks = pa.DictionaryArray.from_arrays(
        pa.array(stack_ids, type=pa.int32()), _strings(interned.texts)
    )

    duration = [
        v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        for v in col("duration_ms")
    ]
    thread_id = [None if v is None else str(v) for v in col("thread_id")]
    thread_name = [None if v is None else str(v) for v in col("thread_name")]
    cols: dict[str, list[Any]] = {
        "record_id": col("record_id"),
        "pg_name": pg_names,
        "pg_desc": pg_desc_col,
        "collective_seq_id": coll_seq,
        "p2p_seq_id": p2p_seq,
        "is_p2p": is_p2p,
        "op": ops,
        "profiling_name": profiling,
        "peer": peers,
        "input_sizes": _sizes_column(col("input_sizes")),
        "output_sizes": _sizes_column(col("output_sizes")),
        "input_dtypes": _dtypes_column(col("input_dtypes")),
        "output_dtypes": _dtypes_column(col("output_dtypes")),
        "state": [v if v.__class__ is str else str(v or "scheduled") for v in col("state")],
        "time_created_ns": col("time_created_ns"),
        # JSON writes 0 for "not yet discovered"
        "time_started_ns": [v or None for v in col("time_discovered_started_ns")],
        "time_completed_ns": [v or None for v in col("time_discovered_completed_ns")],
        "duration_ms": duration,
        "retired": col("retired"),
        "timeout_ms": col("timeout_ms"),
        "thread_id": thread_id,
        "thread_name": thread_name,
        "call_site": sites,
        "stack": stacks,
    }
    cols.update(_split_columns(entries))
    return cols, pg_id_to_name, pg_descs, unmapped, pg_cache


# all_to_all split sizes (elements per member, sent and received: pytorch#194559, dump 2.11)
SPLIT_KEYS = ("input_split_sizes", "output_split_sizes")
_SPLIT_SUFFIX = b"_split_sizes"
assert all(k.encode().endswith(_SPLIT_SUFFIX) for k in SPLIT_KEYS)
MAX_SPLIT_MEMBERS = 1 << 16


def _split_columns(entries: list[dict]) -> dict[str, list[Any]]:
    """The split-size columns where the dump has them (looked for on its first and last
    entries: a version writes the same keys on every entry); a value that is not a list of
    non-negative ints is null. An empty list is kept: the even split (NCCL writes none
    where every split is equal)."""
    if not entries or not any(k in e for e in (entries[0], entries[-1]) for k in SPLIT_KEYS):
        return {}
    return {key: [_split_list(e.get(key)) for e in entries] for key in SPLIT_KEYS}


def _split_list(v: Any) -> list[int] | None:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_SPLIT_MEMBERS:
        return None
    for x in v:
        if x.__class__ is not int or not 0 <= x < 2**63:
            return None
    return list(v)


def _global_peer(
    groups: Mapping[str, ProcessGroup], name: str, local: int, unmapped: set[str]
) -> int | None:
    """A group-local P2P peer as a global rank; left local (and the group noted in
    ``unmapped``, for the loader to map once membership is merged) where this file does
    not list the group's members."""
    g = groups.get(name)
    if g is not None and g.ranks:
        return g.ranks[local] if 0 <= local < len(g.ranks) else None
    unmapped.add(name)
    return local


def _pg_of(pg: Any, pg_id: Any) -> tuple[str, str]:
    if isinstance(pg, (list, tuple)) and len(pg) >= 1:
        desc = pg[1] if len(pg) > 1 and pg[1] is not None else ""
        return str(pg[0]), str(desc)
    if isinstance(pg, str):
        return pg, ""
    if pg_id is not None:
        return str(pg_id), ""
    return "0", ""


def _pg_descs(hits: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Group name -> description, the first non-empty one a file gives."""
    pg_descs: dict[str, str] = {}
    for name, desc in hits:
        if desc and not pg_descs.get(name):
            pg_descs[name] = desc
        else:
            pg_descs.setdefault(name, desc)
    return pg_descs


# --- columns from the native parser ------------------------------------------------------
#
# ``_frpickle.parse`` hands back, per entry key, either a numeric buffer or dictionary codes
# (int32, -1 for None) over the distinct values; the functions below apply ``_columns``'s
# rules to each distinct value once and spread the results with numpy.


def _dictionary(codes: np.ndarray, values: Sequence[Any], null_value: Any = None) -> Coded:
    """``values[code]`` per row (code -1: ``null_value``) as a ``Coded`` column: equal
    values share one code and None values are nulls, as ``pa.array(strings,
    type=dictionary)`` gives."""
    if null_value is None and None not in values:
        uniq = dict.fromkeys(values)
        if len(uniq) == len(values):  # already distinct: the codes are the indices
            return Coded(codes, list(values))
    uniq: dict[Any, int] = {}
    remap = np.empty(len(values) + 1, dtype=np.int32)
    for i, v in enumerate(values):
        remap[i] = -1 if v is None else uniq.setdefault(v, len(uniq))
    remap[-1] = -1 if null_value is None else uniq.setdefault(null_value, len(uniq))
    return Coded(remap[codes], list(uniq))


# distinct values -> their Arrow array: the ranks of a job repeat the same few lists
_STRING_ARRAYS: dict[tuple[str | None, ...], pa.Array] = {}


def _strings(values: Sequence[str | None]) -> pa.Array:
    """A string array of ``values``; one that UTF-8 cannot carry is made ``encodable_text``."""
    try:
        return pa.array(values, type=pa.string())
    except UnicodeEncodeError:
        return pa.array([_clean_str(v) for v in values], type=pa.string())


def _string_array(values: Sequence[str | None]) -> pa.Array:
    key = tuple(values)
    got = _STRING_ARRAYS.get(key)
    if got is None:
        got = _strings(values)
        if got.nbytes > _CACHED_TEXT_MAX:
            return got
        if len(_STRING_ARRAYS) >= 4096:
            _STRING_ARRAYS.clear()
        _STRING_ARRAYS[key] = got
    return got


def _numbers(native: Mapping[str, Any], key: str, n: int, type_: pa.DataType) -> pa.Array | None:
    got = native.get(key)
    if got is None:
        return None
    values, bitmap, nulls = got
    validity = None if bitmap is None else pa.py_buffer(bitmap)
    return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(values)], null_count=nulls)


def _ints_or_zero(native: Mapping[str, Any], key: str, n: int) -> np.ndarray:
    """``v or 0`` for every entry (the native parser stores 0 for None)."""
    got = native.get(key)
    return np.zeros(n, dtype=np.int64) if got is None else np.frombuffer(got[0], dtype=np.int64)


def _zero_is_null(native: Mapping[str, Any], key: str) -> pa.Array | None:
    """``v or None`` for every entry: JSON writes 0 for "not yet discovered"."""
    got = native.get(key)
    if got is None:
        return None
    values = np.frombuffer(got[0], dtype=np.int64)
    mask = values == 0
    return pa.array(values, mask=mask) if mask.any() else pa.array(values)


def _codes(native: Mapping[str, Any], key: str) -> tuple[np.ndarray, list[Any]]:
    codes, values = native[key]
    return np.frombuffer(codes, dtype=np.int32), values


def _native_columns(
    native: Mapping[str, Any], groups: dict[str, ProcessGroup]
) -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str], int]:
    """What ``_columns`` returns, from ``_frpickle.parse``'s columns."""
    n: int = native["n"]
    first_keys = native["first_keys"]

    # process group: the distinct (process_group, pg_id) pairs, in order of appearance
    pg_codes, pairs = _codes(native, "process_group")
    pg_cache: dict[Any, tuple[str, str]] = {}
    pg_id_to_name: dict[str, str] = {}
    pg_hits = []
    for pg, pg_id in pairs:
        key = (tuple(pg) if isinstance(pg, list) else pg, pg_id)
        hit = pg_cache.get(key)
        if hit is None:
            hit = _pg_of(pg, pg_id)
            pg_cache[key] = hit
            if pg_id is not None:
                pg_id_to_name.setdefault(str(pg_id), hit[0])
        pg_hits.append(hit)
    pg_descs = _pg_descs(pg_cache.values())

    pn_codes, pnames = _codes(native, "profiling_name")
    op_hits = [parse_profiling_name(pn) for pn in pnames]
    ops = [hit[0] for hit in op_hits]
    p2p_op = np.array([op in P2P_OPS for op in ops], dtype=bool)[pn_codes]
    flags = native.get("is_p2p")
    if flags is None:
        is_p2p = p2p_op
    else:
        flag = np.frombuffer(flags, dtype=np.int8)
        is_p2p = np.where(flag == 2, p2p_op, flag == 1)

    old_seq = n > 0 and "seq_id" in first_keys and "collective_seq_id" not in first_keys
    if not old_seq:
        coll_seq = _ints_or_zero(native, "collective_seq_id", n)
        p2p_seq = _ints_or_zero(native, "p2p_seq_id", n)
    else:  # before 2.0 one counter ("seq_id") counted every op of the group
        seq = _ints_or_zero(native, "seq_id", n)
        coll_seq = np.where(is_p2p, 0, seq)
        p2p_seq = np.where(is_p2p, seq, 0)

    peers, unmapped = _native_peers(pg_codes, pg_hits, pn_codes, op_hits, groups, n)

    frame_codes, frame_lists = _codes(native, "frames")
    interned = _Stacks()
    stack_of = [interned.intern(f) for f in frame_lists]
    stack_ids = np.array([-1 if i is None else i for i in stack_of] + [-1], dtype=np.int32)
    stack_ids = stack_ids[frame_codes]
    stacks = _dictionary(stack_ids, interned.texts)

    state_codes, states = _codes(native, "state")
    state_text = [v if v.__class__ is str else str(v or "scheduled") for v in states]
    retired = native.get("retired")
    if retired is not None:
        flag = np.frombuffer(retired, dtype=np.int8)
        retired = pa.array(flag == 1, mask=flag == 2)
    cols: dict[str, Any] = {
        "record_id": _numbers(native, "record_id", n, pa.int64()),
        "pg_name": _dictionary(pg_codes, [hit[0] for hit in pg_hits]),
        "pg_desc": _dictionary(pg_codes, [hit[1] for hit in pg_hits]),
        "collective_seq_id": pa.array(coll_seq),
        "p2p_seq_id": pa.array(p2p_seq),
        "is_p2p": pa.array(is_p2p),
        "op": _dictionary(pn_codes, ops),
        "profiling_name": _dictionary(pn_codes, pnames),
        "peer": peers,
        "state": _dictionary(state_codes, state_text, null_value="scheduled"),
        "time_created_ns": _numbers(native, "time_created_ns", n, pa.int64()),
        "time_started_ns": _zero_is_null(native, "time_discovered_started_ns"),
        "time_completed_ns": _zero_is_null(native, "time_discovered_completed_ns"),
        "duration_ms": _numbers(native, "duration_ms", n, pa.float64()),
        "retired": retired,
        "timeout_ms": _numbers(native, "timeout_ms", n, pa.int64()),
        "call_site": _dictionary(stack_ids, interned.sites),
        "stack": stacks,
    }
    for key in ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes"):
        cols[key] = _dictionary(*_codes(native, key))
    for key in ("thread_id", "thread_name"):
        codes, values = _codes(native, key)
        cols[key] = _dictionary(codes, [str(v) for v in values])
    # the native parser does not read the split keys: it leaves a dump that has them to the
    # Python path
    return cols, pg_id_to_name, pg_descs, unmapped, native["bad"]


def has_split_keys(data: bytes) -> bool:
    """The raw dump may name an all_to_all split key (a pickle writes a key's text once):
    one scan for what both keys end with (a false positive only costs the Python path)."""
    return _SPLIT_SUFFIX in data


def _native_peers(
    pg_codes: np.ndarray,
    pg_hits: list[tuple[str, str]],
    pn_codes: np.ndarray,
    op_hits: list[tuple[str, int | None]],
    groups: dict[str, ProcessGroup],
    n: int,
) -> tuple[Any, set[str]]:
    """Global P2P peers, mapped once per distinct (group, local peer) pair."""
    unmapped: set[str] = set()
    has_local = np.array([hit[1] is not None for hit in op_hits] + [False], dtype=bool)
    rows = np.flatnonzero(has_local[pn_codes])
    if not len(rows):
        return None, unmapped
    width = len(op_hits)
    pairs, inverse = np.unique(
        pg_codes[rows].astype(np.int64) * width + pn_codes[rows], return_inverse=True
    )
    mapped: list[int | None] = []
    for pair in pairs.tolist():
        name = pg_hits[pair // width][0]
        mapped.append(_global_peer(groups, name, op_hits[pair % width][1], unmapped))
    if not all(v is None or -(2**31) <= v < 2**31 for v in mapped):
        # out of int32: a plain list, cleaned (and noted) by native_columns as by Python
        peers: list[int | None] = [None] * n
        for row, i in zip(rows.tolist(), inverse.tolist(), strict=True):
            peers[row] = mapped[i]
        return peers, unmapped
    values = np.zeros(n, dtype=np.int32)
    mask = np.ones(n, dtype=bool)
    values[rows] = np.array([0 if v is None else v for v in mapped], dtype=np.int32)[inverse]
    mask[rows] = np.array([v is None for v in mapped], dtype=bool)[inverse]
    return pa.array(values, mask=mask), unmapped
