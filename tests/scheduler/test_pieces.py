"""Which saved pieces of a block make it whole: whole copies and sharded replicas' slices."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.scheduler.pieces import fetch_plan, pieces_for, whole_blocks

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


def test_a_survivor_fetches_only_the_slices_it_lacks_from_whoever_has_them() -> None:
    """Three replicas of blocks 0-1; replica 1 lost, its copy held by replica 2. Replica 0
    keeps its own slices and fetches rank 1's from the held copy, rank 2's from replica 2's
    own copy; a whole copy elsewhere wins over slices."""
    own0, own2, held1 = (0, None), (2, None), (2, "dev-1")
    saved = [
        (own0, (0, 0, 3)),
        (own0, (1, 0, 3)),
        (own2, (0, 2, 3)),
        (own2, (1, 2, 3)),
        (held1, (0, 1, 3)),
        (held1, (1, 1, 3)),
    ]
    assert fetch_plan(saved, [0, 1], own0) == {held1: [0, 1], own2: [0, 1]}
    assert fetch_plan(saved, [0], own2) == {own0: [0], held1: [0]}
    assert fetch_plan([*saved, ((1, "dev-9"), (1, 0, 1))], [0, 1], own0) == {
        held1: [0],
        own2: [0],
        (1, "dev-9"): [1],
    }
    assert fetch_plan([(own0, (0, 0, 1))], [0], own0) == {}  # whole already
    with pytest.raises(ValueError, match="no saved pieces make block 1 whole"):
        fetch_plan(saved[:4], [1], own0)
