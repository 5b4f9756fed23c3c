"""Rank-range text: one grammar, one parser, one formatter.

Grammar (the black box's group table, ``--fault-ranks``, every report)::

    ranks := term ("," term)*        term := N | A "-" B | A "-" B ":" STEP

``0-3,8,16-30:2`` is ranks 0, 1, 2, 3, 8, 16, 18, …, 30. ``format_ranks`` writes runs of
consecutive ranks (``0-3,5``); with ``strides=True`` also arithmetic runs (``3-2043:8``),
the compact form the black box stores. PyTorch's own member lists (``"[0, 1, 2]"``) are
PyTorch's format and are read in ``frtools.formats.torch_fr``.

A rank text is hostile data: ``parse_ranks`` refuses ranks at or beyond ``MAX_WORLD_SIZE``
and texts that expand to more than that many ranks, instead of building the set. Every
rank and world size read from a file goes through ``valid_rank`` / ``valid_world_size``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

# The largest world size frtools accepts from any input (2^20 ranks: 8x today's largest jobs).
MAX_WORLD_SIZE = 1 << 20


def valid_rank(value: object) -> bool:
    """A global rank frtools accepts from a file: an int in ``0 … MAX_WORLD_SIZE-1``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_WORLD_SIZE


def valid_world_size(value: object) -> bool:
    """A world size frtools accepts from a file or the command line: ``1 … MAX_WORLD_SIZE``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_WORLD_SIZE


class MemberCache:
    """Parsed member lists by their text, least recently used first out, holding at most
    ``max_members`` ranks in all: thousands of files repeat the same groups, but a hostile
    file's many distinct million-rank texts must not stay in memory after it is refused.
    A value that is not a tuple (a refusal, ``None``) counts as one member."""

    def __init__(self, max_members: int = 1 << 22, max_entries: int = 4096) -> None:
        self.max_members = max_members
        self.max_entries = max_entries
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._members = 0

    @staticmethod
    def _size(value: Any) -> int:
        return len(value) if isinstance(value, tuple) else 1

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        try:
            value = self._items[key]
        except KeyError:
            pass
        else:
            self._items.move_to_end(key)
            return value
        value = compute()
        size = self._size(value)
        if size <= self.max_members // 4:
            self._items[key] = value
            self._members += size
            while self._members > self.max_members or len(self._items) > self.max_entries:
                _, old = self._items.popitem(last=False)
                self._members -= self._size(old)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._members = 0


class RankTextError(ValueError):
    """A rank-range text that does not follow the grammar or exceeds the limits."""


_PARSED = MemberCache()


def parse_ranks(text: str, limit: int = MAX_WORLD_SIZE) -> tuple[int, ...]:
    """Sorted distinct ranks of ``text``; raises ``RankTextError``. Cached (``MemberCache``):
    thousands of files repeat the same groups."""
    return _PARSED.get((text, limit), lambda: _parse_ranks(text, limit))


def _parse_ranks(text: str, limit: int) -> tuple[int, ...]:
    if text.count(",") >= limit:
        raise RankTextError(f"more than {limit} terms")
    ranks: set[int] = set()
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        span, colon, step_text = term.partition(":")
        first_text, dash, last_text = span.partition("-")
        if max(len(first_text), len(last_text), len(step_text)) > 12:
            raise RankTextError(f"not a rank range: {term[:40]!r}")
        try:
            first = int(first_text)
            last = int(last_text) if dash else first
            step = int(step_text) if colon else 1
        except ValueError:
            raise RankTextError(f"not a rank range: {term[:40]!r}") from None
        if first < 0 or last < first or step < 1 or (colon and not dash):
            raise RankTextError(f"not a rank range: {term[:40]!r}")
        if last >= limit:
            raise RankTextError(f"rank {last} is beyond the limit of {limit} ranks")
        if len(ranks) + (last - first) // step + 1 > limit:
            raise RankTextError(f"more than {limit} ranks")
        ranks.update(range(first, last + 1, step))
    return tuple(sorted(ranks))


def format_ranks(ranks: Iterable[int], limit: int | None = None, *, strides: bool = False) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"``; ``"-"`` when empty.

    ``strides=True`` also folds arithmetic runs of 3+ ranks (``0-6:2``). With ``limit``, a
    longer text is cut at a comma and ends with ``… (N ranks)``.
    """
    values = sorted({int(r) for r in ranks})
    if not values:
        return "-"
    text = ",".join(_runs(values, strides))
    if limit is None or len(text) <= limit:
        return text
    cut = text.rfind(",", 0, max(1, limit - 12))
    head = text[:cut] if cut > 0 else text[: max(1, limit - 12)]
    return f"{head},… ({len(values)} ranks)"


def _runs(values: list[int], strides: bool) -> list[str]:
    parts: list[str] = []
    i, n = 0, len(values)
    while i < n:
        j = i
        if j + 1 < n:
            step = values[j + 1] - values[j]
            if step == 1 or (strides and j + 2 < n and values[j + 2] - values[j + 1] == step):
                while j + 1 < n and values[j + 1] - values[j] == step:
                    j += 1
                suffix = f":{step}" if step != 1 else ""
                parts.append(f"{values[i]}-{values[j]}{suffix}")
                i = j + 1
                continue
        parts.append(str(values[i]))
        i += 1
    return parts
