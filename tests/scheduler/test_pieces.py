"""Which saved pieces of a block make it whole: whole copies and sharded replicas' slices."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.scheduler.pieces import pieces_for, whole_blocks

pytestmark = pytest.mark.unit


def test_a_whole_copy_is_enough_and_is_preferred_to_slices() -> None:
    assert pieces_for([(0, 1)]) == [0]
    assert pieces_for([(0, 2), (1, 2), (0, 1)]) == [2]


def test_slices_make_a_block_whole_only_with_every_rank_of_one_world() -> None:
    assert pieces_for([(1, 2), (0, 2)]) == [1, 0]  # in rank order
    assert pieces_for([(0, 2)]) is None
    assert pieces_for([(0, 2), (1, 3), (2, 3)]) is None  # two cuts do not mix
    assert pieces_for([(0, 3), (0, 2), (1, 3), (2, 3)]) == [0, 2, 3]
    assert pieces_for([]) is None


def test_the_first_offer_of_a_rank_is_taken() -> None:
    """The asking worker puts its own copy first: its own slice is the one used."""
    assert pieces_for([(1, 2), (1, 2), (0, 2)]) == [2, 0]


def test_whole_blocks_are_those_some_pieces_complete() -> None:
    pieces = [(0, 0, 1), (1, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 3), (3, 0, 3)]
    assert whole_blocks(pieces) == {0, 1}


@given(
    world=st.integers(1, 6),
    missing=st.integers(0, 5),
    order=st.randoms(use_true_random=False),
)
def test_a_sharded_block_is_whole_exactly_when_no_rank_is_missing(
    world: int, missing: int, order: random.Random
) -> None:
    offers = [(rank, world) for rank in range(world) if rank != missing]
    order.shuffle(offers)
    chosen = pieces_for(offers)
    if missing >= world:
        assert chosen is not None
        assert [offers[p] for p in chosen] == [(r, world) for r in range(world)]
    else:
        assert chosen is None
