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
