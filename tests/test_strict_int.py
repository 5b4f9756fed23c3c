"""One rule turns a value read from a file into an int (``formats.limits.strict_int``): every
reader uses it, so a hostile value means the same thing in every format."""

from __future__ import annotations

import numpy as np
import pytest

from frtools.formats.limits import INT64_MAX, INT64_MIN, strict_int

TABLE = [
    # (value, bounds, expected)
    (0, {}, 0),
    (-1, {}, -1),
    (INT64_MAX, {}, INT64_MAX),
    (INT64_MIN, {}, INT64_MIN),
    (INT64_MAX + 1, {}, None),
    (INT64_MIN - 1, {}, None),
    (True, {}, None),
    (False, {}, None),
    (3.0, {}, 3),
    (-2.0, {}, -2),
    (1.5, {}, None),
    (float("nan"), {}, None),
    (float("inf"), {}, None),
    (1e300, {}, None),
    ("7", {}, 7),
    (" -1 ", {}, -1),
    ("+4", {}, 4),
    ("", {}, None),
    ("-", {}, None),
    ("1_000", {}, None),
    ("0x10", {}, None),
    ("1.0", {}, None),
    ("\u0663", {}, None),  # an Arabic-Indic digit: str.isdigit says yes, the rule says no
    ("9" * 20, {}, None),
    ("9" * 5000, {}, None),
    (b"7", {}, None),
    (None, {}, None),
    ([1], {}, None),
    ({"a": 1}, {}, None),
    (np.int64(5), {}, 5),
    (np.uint64(2**64 - 1), {}, None),
    (np.bool_(True), {}, None),
    (np.float64(2.0), {}, 2),
    (5, {"lo": 0, "hi": 4}, None),
    (-1, {"lo": 0}, None),
    ("-1", {"lo": 0}, None),
    (4, {"lo": 0, "hi": 4}, 4),
    (0, {"lo": 0, "hi": 4}, 0),
]


@pytest.mark.parametrize(
    ("value", "bounds", "expected"), TABLE, ids=[repr(r[0])[:30] for r in TABLE]
)
def test_strict_int_rule(value: object, bounds: dict, expected: int | None) -> None:
    got = strict_int(value, **bounds)
    assert got == expected
    assert got is None or type(got) is int


def test_a_flag_is_not_a_rank_in_any_bounds() -> None:
    assert strict_int(True, lo=0, hi=1) is None
