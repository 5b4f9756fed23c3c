"""model.codes.dense_unique: np.unique's answer, by a look-up table, where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from frtools.model.codes import dense_unique


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
