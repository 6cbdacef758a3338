"""Block states from saved pieces: sharded replicas' copies of their slices make the whole
block's state again, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.workers.blocks import Block, map_tensors
from shoal.workers.pipeline.pieces import piece_of, whole_states
from shoal.workers.pipeline.sharding import BlockShard
from shoal.workers.pipeline.stage_types import StageStateError
from shoal.workers.snapshot import OptimizerConf
from tests.factories import ADAM, SGD
from tests.workers.runs import assert_same_state

pytestmark = pytest.mark.unit


def _trained(conf: OptimizerConf, steps: int) -> Block:
    torch.manual_seed(0)
    layers = [nn.Linear(13, 7), nn.LayerNorm(7), nn.BatchNorm1d(7), nn.Linear(7, 2)]
    block = Block(3, nn.Sequential(*layers), conf)
    for step in range(steps):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(step))
        block.module(x).square().sum().backward()
        block.step()
    return block


def _saved(shard: BlockShard) -> dict[str, object]:
    """A copy of the share as the copier makes it: every tensor copied."""
    saved: dict[str, object] = map_tensors(shard.live_state(), lambda t: t.detach().clone())
    return saved


@settings(max_examples=12, deadline=None)
@given(
    world=st.integers(1, 5),
    conf=st.sampled_from([ADAM, SGD, OptimizerConf("adamw", 0.01, {"weight_decay": 0.1})]),
    steps=st.integers(0, 3),
    order=st.permutations(range(5)),
)
def test_every_ranks_slice_makes_the_block_whole_as_it_was(
    world: int, conf: OptimizerConf, steps: int, order: list[int]
) -> None:
    """A block trained ``steps`` steps, sharded over ``world`` replicas: their saved slices,
    in any order, give back the block's parameters and optimizer state bit for bit."""
    block = _trained(conf, steps)
    expected = block.state()
    pieces = [
        {block.index: _saved(BlockShard(copy.deepcopy(block), rank, world))}
        for rank in range(world)
    ]
    assert [piece_of(p[block.index]) for p in pieces] == [(r, world) for r in range(world)]
    shuffled = [pieces[r] for r in order if r < world]
    (index, state), *_ = whole_states(shuffled).items()
    assert index == block.index
    assert_same_state(state, expected)
    fresh = _trained(conf, 0)
    fresh.load(state)  # it loads as the block's own state
    assert_same_state(fresh.state(), expected)


def test_slices_of_a_trained_block_keep_training_as_the_whole_block() -> None:
    """One more step after the merge equals one more step of the block never sharded."""
    block = _trained(ADAM, 2)
    pieces = [{3: _saved(BlockShard(copy.deepcopy(block), r, 3))} for r in range(3)]
    merged = _trained(ADAM, 0)
    merged.load(whole_states(pieces)[3])
    for b in (block, merged):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(9))
        b.module(x).square().sum().backward()
        b.step()
    assert_same_state(merged.state(), block.state())


def test_a_whole_state_is_taken_as_it_is_and_a_missing_slice_is_named() -> None:
    block = _trained(ADAM, 1)
    whole = block.state()
    first = _saved(BlockShard(copy.deepcopy(block), 0, 2))
    assert whole_states([{3: first}, {3: whole}])[3] is whole
    with pytest.raises(StageStateError, match=r"block 3: the saved slices \[\(0, 2\)\]"):
        whole_states([{3: first}])
