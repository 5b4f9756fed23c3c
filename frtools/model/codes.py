"""Integer codes of a column: its distinct values and each row's index among them; and
several files' dictionary columns joined into one Arrow array (``join_dictionaries``).

Where the values are small non-negative ints (string ids, group codes, packed keys), a
look-up table numbers them in a few passes; ``np.unique`` sorts and ``pd.factorize`` hashes,
which costs several times more on millions of rows and has fixed costs a reader pays per
file (16,384 snapshots)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa


def dense_unique(values: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.unique(values, return_inverse=True)`` (the distinct values in order, each row's
    index among them) for non-negative ints below ``most``; None where they are not."""
    if not len(values):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    top = int(values.max())
    if values.min() < 0 or top >= most:
        return None
    seen = np.zeros(top + 1, dtype=bool)
    seen[values] = True
    uniq = np.flatnonzero(seen)
    number = np.zeros(len(seen), dtype=np.int32 if len(seen) < 2**31 else np.intp)
    number[uniq] = np.arange(len(uniq))
    return uniq, number[values]


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[j] .. starts[j] + counts[j] - 1`` for every ``j``, one after another, as one
    int64 array (one repeat and one add, not an ``arange`` per range)."""
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts  # where each range starts in the result
    return np.repeat(np.asarray(starts, dtype=np.int64) - before, counts) + np.arange(
        int(counts.sum())
    )


def among(values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``np.isin(values, wanted)`` for ints: a flag per value where they are non-negative
    and below ``4 * len(values) + 1024`` (one gather over millions of rows), else np.isin."""
    if not len(values) or not len(wanted):
        return np.zeros(len(values), dtype=bool)
    low = min(int(values.min()), int(wanted.min()))
    top = max(int(values.max()), int(wanted.max()))
    if low < 0 or top >= 4 * len(values) + 1024:
        return np.isin(values, wanted)
    flag = np.zeros(top + 1, dtype=bool)
    flag[wanted] = True
    return flag[values]


# one file's dictionary column before Arrow: its values (None: a null value; repeats
# allowed), each row's int32 index into them (-1: null) and which rows are valid (None: all)
DictionaryPart = tuple[Sequence["str | None"], np.ndarray, "np.ndarray | None"]
_STRING_DICTIONARY = pa.dictionary(pa.int32(), pa.string())


def join_dictionaries(
    parts: Sequence[DictionaryPart],
    strings: Callable[[list[str]], pa.Array] = lambda values: pa.array(values, type=pa.string()),
) -> pa.DictionaryArray:
    """Several files' dictionary columns as one Arrow array, their rows in order: the rows
    keep int32 codes into the distinct values of all of them, in order of first appearance
    file after file (as Arrow's dictionary unification orders them); a None value is a null
    row (Arrow cannot unify a null in a dictionary) and repeated values are merged (pandas'
    categories must be distinct). Files of one job repeat the same few value lists (ops,
    sizes, states): each distinct list is mapped once. ``strings``: the values' Arrow
    array (a reader's own), which must keep distinct values distinct."""
    slot: dict[str, int] = {}
    # values -> (their codes' remapping, None where it is the identity; which are None)
    seen: dict[tuple, tuple[np.ndarray | None, np.ndarray | None]] = {}
    codes: list[np.ndarray] = []
    nulls: list[np.ndarray | None] = []
    for values, indices, valid in parts:
        key = tuple(values)
        got = seen.get(key)
        if got is None:
            at = [slot.setdefault("" if v is None else v, len(slot)) for v in key]
            remap = None if at == list(range(len(at))) else np.array([*at, -1], dtype=np.int32)
            none = np.array([v is None for v in key] + [False]) if None in key else None
            got = seen[key] = (remap, none)
        remap, none = got
        codes.append(indices if remap is None else remap[indices])
        null = None if none is None else none[indices]
        if valid is not None:
            null = ~valid if null is None else null | ~valid
        nulls.append(null)
    joined = (np.concatenate(codes) if len(codes) > 1 else codes[0]) if codes else np.zeros(0)
    joined = joined.astype(np.int32, copy=False)
    if any(n is not None for n in nulls):
        mask = np.concatenate(
            [
                np.zeros(len(c), dtype=bool) if n is None else n
                for c, n in zip(codes, nulls, strict=True)
            ]
        )
        joined = np.where(mask, np.int32(-1), joined)
    null_rows = joined < 0
    null_count = int(np.count_nonzero(null_rows))
    validity = pa.py_buffer(np.packbits(~null_rows, bitorder="little")) if null_count else None
    return pa.DictionaryArray.from_buffers(
        _STRING_DICTIONARY,
        len(joined),
        [validity, pa.py_buffer(np.ascontiguousarray(joined))],
        strings(list(slot)),
        null_count=null_count,
    )
