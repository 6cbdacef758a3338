"""Which saved pieces of a block make its state whole again (in-memory copies, recovery).

A copy holds each of its worker's blocks whole, or, from a replica of a sharded stage
(``parallelism.shard``), one slice of the block's parameters and of their optimizer state:
piece ``rank`` of ``world`` (a whole block is piece 0 of 1). A block's state can be rebuilt from
a set of pieces when one of them is whole, or when every rank of one world is there: the
slices of a single sharding, cut the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

Piece = tuple[int, int, int]
"""A saved piece: block index, rank, world."""

WHOLE = (0, 1)
"""The (rank, world) of a block saved whole."""

S = TypeVar("S", bound=Hashable)


def pieces_for(offers: Sequence[tuple[int, int]]) -> list[int] | None:
    """Positions in ``offers`` (each a piece's ``(rank, world)``, in order of preference)
    whose pieces together make a block whole: the first whole one, else the first offer of
    each rank of the first world all of whose ranks are offered. None when none does."""
    for position, piece in enumerate(offers):
        if piece == WHOLE:
            return [position]
    ranks_by_world: dict[int, dict[int, int]] = {}
    for position, (rank, world) in enumerate(offers):
        ranks_by_world.setdefault(world, {}).setdefault(rank, position)
    for world, ranks in ranks_by_world.items():
        if set(ranks) == set(range(world)):
            return [ranks[rank] for rank in range(world)]
    return None


def whole_blocks(pieces: Iterable[Piece]) -> set[int]:
    """The blocks whose state ``pieces`` can rebuild (``pieces_for``)."""
    by_block: dict[int, list[tuple[int, int]]] = {}
    for block, rank, world in pieces:
        by_block.setdefault(block, []).append((rank, world))
    return {block for block, offers in by_block.items() if pieces_for(offers) is not None}


def fetch_plan(
    saved: Sequence[tuple[S, Piece]], blocks: Iterable[int], first: S | None = None
) -> dict[S, list[int]]:
    """Which blocks to fetch from which source so that each of ``blocks`` is whole, given
    every ``saved`` piece with its source; the pieces of ``first`` (the asking worker's
    own) are preferred and left out, since it has them. Raises ``ValueError`` for a block
    no pieces make whole."""
    wanted: dict[S, list[int]] = {}
    for block in blocks:
        offers = sorted(
            ((where, (rank, world)) for where, (b, rank, world) in saved if b == block),
            key=lambda offer: offer[0] != first,
        )
        chosen = pieces_for([piece for _, piece in offers])
        if chosen is None:
            raise ValueError(f"no saved pieces make block {block} whole")
        for position in chosen:
            if offers[position][0] != first:
                wanted.setdefault(offers[position][0], []).append(block)
    return wanted
