"""model.codes: np.unique's and np.isin's answers, by a look-up table, where it applies;
several files' dictionary columns joined as Arrow would join them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from frtools.model.codes import among, dense_unique, join_dictionaries, ranges


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


def _arrow_join(parts: list) -> pa.ChunkedArray:
    """What Arrow makes of the same parts: one dictionary array each, then unified."""
    arrays = []
    for values, indices, valid in parts:
        null = np.asarray(indices) < 0
        if valid is not None:
            null |= ~valid
        rows = [None if n else values[i] for i, n in zip(indices, null, strict=True)]
        arrays.append(pa.array(rows, type=pa.string()).dictionary_encode())
    return pa.chunked_array(arrays).unify_dictionaries()


def test_ranges_are_the_aranges_laid_end_to_end() -> None:
    starts, counts = np.array([5, 0, 9, 2]), np.array([3, 0, 1, 2])
    expected = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts, strict=True)])
    assert ranges(starts, counts).tolist() == expected.tolist() == [5, 6, 7, 9, 2, 3]
    assert ranges(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).tolist() == []


def test_joined_dictionaries_decode_as_arrows_join_in_its_order() -> None:
    """Rows decode to their file's values (None values, code -1 and invalid rows are null),
    the dictionary is distinct, in order of first appearance file after file, and a list
    of values that several files share (one mapping, cached) maps the same each time."""
    ops = ["all_reduce", "broadcast", "send"]
    parts = [
        (ops, np.array([0, 1, 0, 2], dtype=np.int32), None),  # identity: codes kept
        (["send", "recv", "all_reduce"], np.array([2, 1, -1, 0], dtype=np.int32), None),
        (ops, np.array([2, 2, 1], dtype=np.int32), None),  # the first file's list again
        (["x", None, "x", ""], np.array([0, 1, 2, 3], dtype=np.int32), None),  # None, repeat
        (ops, np.array([0, 1, 2], dtype=np.int32), np.array([True, False, True])),
        ((), np.full(2, -1, dtype=np.int32), None),  # a file without the column
    ]
    got = join_dictionaries(parts)
    want = _arrow_join(parts)
    assert got.to_pylist() == want.to_pylist()
    assert got.to_pylist()[:8] == [
        "all_reduce", "broadcast", "all_reduce", "send", "all_reduce", "recv", None, "send"
    ]  # fmt: skip
    assert got.null_count == 1 + 1 + 1 + 2
    values = got.dictionary.to_pylist()
    assert len(values) == len(set(values)) and None not in values
    assert values == ["all_reduce", "broadcast", "send", "recv", "x", ""]  # "" for the None
    assert got.type == pa.dictionary(pa.int32(), pa.string())
    single = join_dictionaries([(["a", "b"], np.array([1, 0, -1], dtype=np.int32), None)])
    assert single.to_pylist() == ["b", "a", None]
    assert join_dictionaries([]).to_pylist() == []
