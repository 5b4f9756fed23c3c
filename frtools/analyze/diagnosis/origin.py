"""One error, one root: when several ranks ended with the same error, where it started.

Libraries gather one rank's failure and raise it on every rank:
``torch.distributed.checkpoint`` catches a rank's write error, gathers every rank's result
and raises the same ``CheckpointException`` on all of them, naming the failing ranks
(``CheckpointException ranks:dict_keys([2])`` … ``(RANK 2)``); a propagated NCCL error
names the rank it came from. The records then show every rank dying of one error. The
root is the rank the text names; the others re-raised it: casualties, not causes.

Worked example (a real FSDP2 job, rank 2's disk full)::

    rank 0: CheckpointException: CheckpointException ranks:dict_keys([2]) ... (RANK 2) OSError
    rank 1: the same text          rank 2: the same text          rank 3: the same text
    -> root [2]; casualties [0, 1, 3]
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .facts import Ending

# Rank lists and single ranks as error texts name them.
_LIST = re.compile(
    r"\branks?\s*[:=]?\s*(?:dict_keys\()?[\[{(]\s*(\d+(?:\s*,\s*\d+)*)\s*[\]})]", re.I
)
_ONE = re.compile(r"\(\s*rank\s+(\d+)\s*\)|\bfrom rank\s+(\d+)\b|\bon rank\s+(\d+)\b", re.I)
# Named ranks read from one text at most (a hostile text may list millions).
MAX_NAMED = 1024
# Only the head of a text is searched (bounded work on hostile text).
TEXT_HEAD = 16_384


@dataclass(frozen=True, kw_only=True)
class SharedError:
    """``ranks`` ended with one error text; ``roots`` are the ranks it names."""

    text: str
    ranks: tuple[int, ...]
    roots: tuple[int, ...]

    @property
    def casualties(self) -> tuple[int, ...]:
        return tuple(r for r in self.ranks if r not in self.roots)


def named_ranks(text: str, job: Collection[int]) -> tuple[int, ...]:
    """The ranks of ``job`` an error text names as where it failed."""
    head = text[:TEXT_HEAD]
    found: set[int] = set()
    for m in _LIST.finditer(head):
        for part in m.group(1).split(","):
            if len(found) >= MAX_NAMED:
                break
            found.add(int(part))
    for m in _ONE.finditer(head):
        value = next(g for g in m.groups() if g is not None)
        found.add(int(value))
    return tuple(sorted(r for r in found if r in job))


def shared_errors(endings: Mapping[int, Ending], job: Collection[int]) -> list[SharedError]:
    """Errors that ended two or more ranks with one text and name their root among the
    job's ranks (a re-raised error), largest first."""
    by_text: dict[str, list[int]] = defaultdict(list)
    for r, e in endings.items():
        if e.kind == "exception" and e.detail:
            by_text[e.detail.strip()].append(r)
    out = []
    for text, ranks in by_text.items():
        if len(ranks) < 2:
            continue
        roots = named_ranks(text, job)
        if roots and set(roots) != set(ranks):
            out.append(SharedError(text=text, ranks=tuple(sorted(ranks)), roots=roots))
    return sorted(out, key=lambda s: (-len(s.ranks), s.roots))
