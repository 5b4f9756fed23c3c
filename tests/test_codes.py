"""model.codes: np.unique's and np.isin's answers, by a look-up table, where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from frtools.model.codes import among, dense_unique


@pytest.mark.parametrize("dtype", [np.uint32, np.int16, np.int64])
def test_dense_unique_is_np_unique(dtype: type) -> None:
    rng = np.random.default_rng(3)
    for size in (1, 7, 2000):
        values = rng.integers(0, 50, size).astype(dtype)
        uniq, inverse = dense_unique(values, 64)
        want_uniq, want_inverse = np.unique(values, return_inverse=True)
        assert uniq.tolist() == want_uniq.tolist()
        assert inverse.tolist() == want_inverse.tolist()


def test_values_it_cannot_number_are_left_to_the_caller() -> None:
    assert dense_unique(np.array([3, 64]), 64) is None  # at the bound
    assert dense_unique(np.array([-1, 2]), 64) is None  # negative
    uniq, inverse = dense_unique(np.zeros(0, dtype=np.int64), 64)
    assert len(uniq) == 0 and len(inverse) == 0


@pytest.mark.parametrize(
    ("values", "wanted"),
    [
        ([5, 1, 9, 1, 0], [1, 9, 42]),  # a table: small non-negative ints
        ([5, -1, 9, 1], [1, -1]),  # negative: np.isin
        ([3, 2**40, 7], [2**40, 3]),  # far beyond the rows: np.isin
        ([4, 4, 4], []),  # nothing wanted
        ([], [1, 2]),  # no values
    ],
)
def test_among_is_np_isin(values: list[int], wanted: list[int]) -> None:
    v, w = np.array(values, dtype=np.int64), np.array(wanted, dtype=np.int64)
    assert among(v, w).tolist() == np.isin(v, w).tolist()
    assert among(v.astype(np.int32) if v.max(initial=0) < 2**31 else v, w).tolist() == (
        np.isin(v, w).tolist()
    )
