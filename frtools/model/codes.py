"""Integer codes of a column: its distinct values and each row's index among them.

Where the values are small non-negative ints (string ids, group codes, packed keys), a
look-up table numbers them in a few passes; ``np.unique`` sorts and ``pd.factorize`` hashes,
which costs several times more on millions of rows and has fixed costs a reader pays per
file (16,384 snapshots)."""

from __future__ import annotations

import numpy as np


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
