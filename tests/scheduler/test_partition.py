"""The exact balanced contiguous partition, checked against exhaustive search."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.partition import balanced_partition, even_partition
from scheduler.types import BlockRange

pytestmark = pytest.mark.unit


def heaviest(weights: list[float], ranges: list[BlockRange]) -> float:
    return max(sum(weights[a:b]) for a, b in ranges)


def brute_force(weights: list[float], stages: int) -> float:
    n = len(weights)
    return min(
        heaviest(weights, list(zip((0, *cuts), (*cuts, n), strict=True)))
        for cuts in combinations(range(1, n), stages - 1)
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[float], int]:
    weights = draw(
        st.lists(
            st.one_of(st.integers(0, 9).map(float), st.floats(0, 100, allow_nan=False)),
            min_size=1,
            max_size=10,
        )
    )
    return weights, draw(st.integers(1, len(weights)))


@given(cases())
def test_balanced_partition_is_optimal(case: tuple[list[float], int]) -> None:
    weights, stages = case
    ranges = balanced_partition(weights, stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == len(weights)
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(stages - 1))
    assert math.isclose(heaviest(weights, ranges), brute_force(weights, stages), abs_tol=1e-9)


def test_even_partition_spreads_the_remainder() -> None:
    assert even_partition(5, 1) == [(0, 5)]
    assert even_partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert sorted(b - a for a, b in even_partition(10, 4)) == [2, 2, 3, 3]


def test_a_heavy_block_gets_a_stage_of_its_own() -> None:
    assert balanced_partition([1, 1, 8, 1, 1], 3) == [(0, 2), (2, 3), (3, 5)]


def test_large_inputs_are_fast() -> None:
    ranges = balanced_partition([float(i % 7) for i in range(2_000)], 64)
    assert len(ranges) == 64


@pytest.mark.parametrize(
    ("weights", "stages", "message"),
    [
        ([1.0, 1.0], 3, "cannot cut 2 blocks into 3 non-empty stages"),
        ([1.0], 0, "at least 1 stage"),
        ([1.0, -1.0], 1, "finite and >= 0, got -1.0"),
        ([1.0, math.nan], 1, "finite and >= 0, got nan"),
    ],
)
def test_bad_requests_say_why(weights: list[float], stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_partition(weights, stages)
