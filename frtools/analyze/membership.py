"""Who belongs to each process group: the one place that decides it, in three steps.

1. **Stated** (``stated``, run by the loader): a group a file lists keeps that list; where
   files disagree the most common list wins, and a list the records cannot support (a tiny
   file naming a million members) is not believed. A file that says "all ranks" for the
   default group states it too: ``with_world`` fills it from the world size.
2. **Recorded** (``stated`` for the Trace's groups, ``members`` for the alignment): a group
   no file lists (Gloo dumps list none) has as members the ranks that recorded ops on it or
   name it in their ``pg_status``; the default group holds every rank of the world.
3. **Inferred from siblings** (``from_siblings``, run by the diagnosis): an inferred group
   with fewer members than its siblings — the groups of the same description, pairwise
   disjoint, that every rank of a layout belongs to one of (tensor-parallel pairs,
   data-parallel groups) — is short of a member that left no record. The absent ranks are
   named when the arithmetic allows it — a gap in the file names, or, when the world size
   is not known, as many ranks above the highest file as the shortest family is short —
   and placed in a short group when exactly one completion of that group fits its
   siblings' shape; otherwise the group keeps an anonymous shortfall (``unseen``) and the
   verdict says what is missing instead of naming a rank.

Worked example of step 3: tensor-parallel groups ``tp0 = (0, 1)``, ``tp1 = (2, 3)``,
``tp2 = (4,)`` inferred from a Gloo job whose rank 5 left no record and whose world size no
file states. ``tp2`` lacks one member; the shortest family is short by one, so rank 5 (above
the highest file) is expected, and the one completion of ``tp2`` shaped like ``(0, 1)`` —
offsets ``(0, 1)`` from its first member — is ``(4, 5)``: ``added = {"tp2": (5,)}``.

Which group is the default one is ``frtools.model.trace.is_default``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from frtools.formats import limits
from frtools.model.trace import ProcessGroup, Trace, is_default

if TYPE_CHECKING:
    from frtools.analyze.readers.base import RankDump


@dataclass(frozen=True)
class Membership:
    """Every group's members after the three steps, and what each step found."""

    members: Mapping[str, tuple[int, ...]]  # global member ranks, inferred ones included
    listed: frozenset[str]  # groups whose members a file lists
    added: Mapping[str, tuple[int, ...]]  # absent ranks placed in a short group
    unseen: Mapping[str, int]  # members a short group lacks that cannot be named
    beyond: tuple[int, ...] = ()  # ranks above every file that short groups reveal
    short: Mapping[str, int] = field(default_factory=dict)  # group -> members it lacks
    # groups whose every member is known: listed, the default group of a job whose world
    # size is stated, or an inferred group as large as the largest of its siblings
    complete: frozenset[str] = frozenset()


@dataclass
class Stated:
    """Step 1's answer: the merged groups, the groups whose files disagree (their
    dissenters get a note: none to look for when empty), and the groups whose member lists
    the records cannot support, with why."""

    groups: dict[str, ProcessGroup]
    disputed: set[str]
    refused: dict[str, str]


def default_group(
    groups: Mapping[str, ProcessGroup], among: Iterable[str] | None = None
) -> str | None:
    """The default group's name among ``among`` (default: every group), if one is."""
    for name in groups if among is None else among:
        pg = groups.get(name)
        if is_default(name, pg.desc if pg is not None else None):
            return name
    return None


# --- 1. stated (and, for groups no file lists, recorded) ---------------------------------


def stated(
    dumps: Sequence[RankDump],
    groups_recorded: Callable[[RankDump], Iterable[str | None]],
    lists_all_groups: Callable[[RankDump], bool],
) -> Stated:
    """Membership from the files that list it (the most common list where they disagree);
    where none does, from which ranks recorded ops on the group (``inferred``).
    ``groups_recorded(d)``: the groups ``d`` has entries on; ``lists_all_groups(d)``:
    whether ``d``'s format records ops only on the groups it lists (a reader capability).

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
    # the ranks of a host (of a partial) share their ProcessGroup objects: each distinct
    # (object, name, "all ranks") is looked at once, with how many dumps name it
    pgs: dict[int, ProcessGroup] = {}
    uses = Counter(
        (id(pgs.setdefault(id(g), g)), name, d.default_pg_all)
        for d in dumps
        for name, g in d.process_groups.items()
    )
    for (gid, name, all_ranks), n in uses.items():
        g = pgs[gid]
        dc = descs.get(name)
        if dc is None:
            dc = descs[name] = {}
            listed[name] = {}
        if g.desc:
            dc[g.desc] = dc.get(g.desc, 0) + n
        if g.ranks:
            same = seen.get(id(g.ranks))
            if same is None:
                same = seen[id(g.ranks)] = canonical.setdefault(g.ranks, g.ranks)
                by_id[id(same)] = same
            g.ranks = same
            lc = listed[name]
            lc[id(same)] = lc.get(id(same), 0) + n
        elif all_ranks and g.is_default:
            everyone.add(name)

    # a member list the records cannot support (a tiny file naming a million members) is
    # not believed: the group is inferred as if no file listed it
    lim = limits.current()
    cap = lim.ranks_supported(len(dumps))
    for name, lc in listed.items():
        for rid in [rid for rid in lc if _claimed(by_id[rid]) > cap]:
            refused[name] = (
                lim.unsupported_ranks(
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
            if lists_all_groups(d) and unlisted.isdisjoint(d.process_groups):
                continue
            for name in unlisted.intersection(n for n in groups_recorded(d) if n is not None):
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
    return Stated(groups, disputed, refused)


def _claimed(ranks: tuple[int, ...]) -> int:
    """How many ranks a member list makes the analysis expect (its highest rank + 1)."""
    return max(len(ranks), max(ranks) + 1) if ranks else 0


def _pg_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def world_size(
    dumps: Sequence[RankDump], groups: Mapping[str, ProcessGroup], unusable: set[int]
) -> tuple[int | None, bool]:
    """The job's world size and whether a file states it (``False``: only the highest
    rank seen + 1, which a manifest may still correct): a listed default group states it,
    so does a file's header."""
    name = default_group(groups)
    default = groups[name] if name is not None else None
    if default is not None and default.ranks and not default.inferred:
        return max(default.ranks) + 1, True
    told = [d.rank_info.world_size for d in dumps if d.rank_info.world_size]
    if told:
        return max(told), True
    known = {d.rank_info.rank for d in dumps} | unusable
    for g in groups.values():
        known.update(g.ranks)
    return (max(known) + 1 if known else None), False


def with_world(groups: dict[str, ProcessGroup], world: int | None, all_ranks: bool) -> None:
    """The default group holds every rank: files that say "all ranks" (big frtools
    snapshots, a ranks string "all") know it; Gloo dumps leave it to be inferred. Fills it
    in ``groups`` from the world size."""
    name = default_group(groups)
    default = groups.get(name) if name is not None else None
    if default is not None and (default.inferred or not default.ranks) and world:
        groups[default.name] = ProcessGroup(
            default.name,
            default.desc,
            tuple(range(world)),
            inferred=default.inferred and not all_ranks,
        )


# --- 2. recorded, for the alignment -----------------------------------------------------


def members(
    trace: Trace,
    used: Iterable[str],
    recorded_on: Callable[[set[str]], Mapping[str, Iterable[int]]],
) -> dict[str, tuple[int, ...]]:
    """Global member ranks of every group: the readers' membership, else who recorded on
    it or names it in its ``pg_status``; the default group of a known world holds every
    rank. ``used``: the groups some entry is on; ``recorded_on(names)``: for those of them
    no file lists, the ranks with entries on each (asked once, only when there are any)."""
    listed = {n for n, pg in trace.process_groups.items() if pg.ranks}
    found: dict[str, set[int]] = {name: set() for name in used}
    unknown = {name for name in found if name not in listed}
    if unknown:
        for name, ranks in recorded_on(unknown).items():
            found[name] = set(ranks)
    # the groups a rank's counters name: who names them counts only where no file lists them
    for info in trace.ranks.values():
        for pg_name in info.pg_status:
            got = found.get(pg_name)
            if got is None:
                got = found[pg_name] = set()
            if pg_name not in listed:
                got.add(info.rank)
    result: dict[str, tuple[int, ...]] = {}
    for pg_name, ranks in found.items():
        pg = trace.process_groups.get(pg_name)
        if pg is not None and pg.ranks:
            result[pg_name] = tuple(sorted(pg.ranks))
        elif pg is not None and pg.is_default and trace.world_size:
            result[pg_name] = tuple(range(trace.world_size))
        else:
            result[pg_name] = tuple(sorted(ranks))
    for pg_name, pg in trace.process_groups.items():
        if pg_name not in result and pg.ranks:
            result[pg_name] = tuple(sorted(pg.ranks))
    return result


# --- 3. inferred from siblings, for the diagnosis ---------------------------------------


def from_siblings(
    trace: Trace,
    aligned: Mapping[str, tuple[int, ...]],
    present: set[int],
    listed: frozenset[str],
    world_certain: bool,
) -> tuple[Membership, set[int]]:
    """Step 3 over the alignment's members (``aligned``): the membership and the ranks
    the job is expected to have."""
    found = {name: tuple(ranks) for name, ranks in aligned.items()}
    expected = set(trace.expected_ranks) | present
    for ranks in found.values():
        expected |= set(ranks)
    short = _families(trace, found, listed)["short"]
    needed = max((sum(lacking.values()) for _, lacking in short.values()), default=0)
    absent = expected - present
    extra: set[int] = set()
    if needed > len(absent) and not world_certain:
        # a Gloo dump states no world size: the files cannot show missing top ranks, the
        # short sibling groups can
        top = max(expected) + 1 if expected else 0
        extra = set(range(top, top + needed - len(absent)))
        expected |= extra
        absent |= extra
        default = default_group(trace.process_groups, found)
        if default is not None:
            found[default] = tuple(sorted(set(found[default]) | extra))
    beyond = tuple(sorted(extra))
    added: dict[str, tuple[int, ...]] = {}
    unseen: dict[str, int] = {}
    for siblings, lacking in short.values():
        for name, lack in lacking.items():
            fit = _completion_of(name, lack, found, siblings, absent)
            if fit:
                added[name] = fit
                found[name] = tuple(sorted(set(found[name]) | set(fit)))
            else:
                unseen[name] = lack
    lacking = {name: lack for _, family in short.values() for name, lack in family.items()}
    complete = set(listed) | set(_families(trace, found, listed)["full"])
    default = default_group(trace.process_groups, found)
    if default is not None and world_certain:
        complete.add(default)
    complete |= set(added) - set(unseen)
    return (
        Membership(found, listed, added, unseen, beyond, lacking, frozenset(complete)),
        expected,
    )


def _families(
    trace: Trace, found: Mapping[str, tuple[int, ...]], listed: frozenset[str]
) -> dict[str, dict]:
    """Sibling families of inferred groups (same description, pairwise disjoint, at least
    two): ``short`` (desc -> (its groups, those with fewer members than the largest, by how
    many)) and ``full`` (groups as large as the largest of their family)."""
    families: dict[str, list[str]] = {}
    for name in found:
        pg = trace.process_groups.get(name)
        desc = pg.desc if pg is not None else ""
        if name in listed or is_default(name, desc):
            continue
        families.setdefault(desc, []).append(name)
    short: dict[str, tuple[list[str], dict[str, int]]] = {}
    full: list[str] = []
    for desc, names in families.items():
        if len(names) < 2:
            continue
        sizes = [len(found[n]) for n in names]
        seen: set[int] = set()
        disjoint = True
        for n in names:
            if seen & set(found[n]):
                disjoint = False
                break
            seen |= set(found[n])
        top = max(sizes)
        if not disjoint or top < 2:
            continue
        if desc in ("", "undefined") and top - min(sizes) > 1:
            continue  # undescribed groups of different kinds are no family
        lacking = {n: top - len(found[n]) for n in names if len(found[n]) < top}
        if len(lacking) < len(names):
            full += [n for n in names if n not in lacking]
            if lacking:
                short[desc] = (names, lacking)
    return {"short": short, "full": full}


def _completion_of(
    name: str,
    lack: int,
    found: Mapping[str, tuple[int, ...]],
    siblings: list[str],
    absent: set[int],
) -> tuple[int, ...]:
    """The absent ranks that complete group ``name`` the way its full siblings are shaped
    (the same offsets from their first member), when exactly one completion fits."""
    have = set(found[name])
    shapes = set()
    for other in siblings:
        ranks = found[other]
        if len(ranks) == len(have) + lack:
            shapes.add(tuple(r - ranks[0] for r in ranks))
    if not shapes or not have:
        # no full sibling to copy the shape from: a single absent rank still fits
        return tuple(sorted(absent)) if len(absent) == lack == 1 else ()
    fits: set[tuple[int, ...]] = set()
    for shape in shapes:
        for r in have:
            for offset in shape:
                base = r - offset
                group = {base + o for o in shape}
                if base < 0 or not have <= group:
                    continue
                extra = group - have
                if len(extra) == lack and extra <= absent:
                    fits.add(tuple(sorted(extra)))
    return next(iter(fits)) if len(fits) == 1 else ()
