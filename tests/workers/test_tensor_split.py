"""Tensor-parallel splits of a block (``workers.tensor_split``): the split block computes
what the whole one does (within float rounding: its sums over devices reorder additions),
converts to and from the whole block's state exactly, and trains as the whole one does."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.workers.snapshot import ModelRef
from shoal.workers.tensor_split import (
    SplitBlock,
    SplitSize,
    TensorSplitError,
    cuts,
    split_block,
    split_size,
    splittable,
)
from shoal.workers.zoo.models import build_blocks
from shoal.workers.zoo.registry import DataMeta
from tests.workers.test_factories import ResidualMLP, SplitResidualMLP

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _gpt(index: int) -> nn.Module:
    meta = DataMeta("lm", (16,), 50, vocab_size=50)
    ref = ModelRef(
        "gpt", None, {"vocab_size": 50, "seq_len": 16, "d_model": 24, "n_layers": 2, "n_heads": 6}
    )
    (block,) = build_blocks(ref, meta, 3, [index])
    return block


def _mlp(index: int) -> nn.Module:
    meta = DataMeta("regression", (12,), 5)
    ref = ModelRef("mlp", None, {"hidden": 20, "layers": 2, "out_features": 5})
    (block,) = build_blocks(ref, meta, 3, [index])
    return block


def _input(kind: str, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "mlp-first":
        return torch.randn(rows, 12, generator=g)
    if kind == "mlp":
        return torch.randn(rows, 20, generator=g)
    if kind == "declared":
        return torch.randn(rows, 8, generator=g)
    return torch.randn(rows, 16, 24, generator=g)


BLOCKS = {
    "gpt-layer": (lambda: _gpt(1), "gpt"),
    "gpt-head": (lambda: _gpt(3), "gpt"),
    "mlp-first": (lambda: _mlp(0), "mlp-first"),
    "mlp-hidden": (lambda: _mlp(1), "mlp"),
    "mlp-out": (lambda: _mlp(2), "mlp"),
    "declared": (lambda: _declared(), "declared"),
}


def _declared(cls: type[ResidualMLP] = ResidualMLP) -> ResidualMLP:
    """A block of a factory's own that declares its split (6 hidden features), the same
    values each time."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return cls(8, 6)


def test_cuts_cover_a_size_once() -> None:
    for size in (1, 5, 16):
        for parts in (1, 2, 3):
            ranges = cuts(size, parts)
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(BLOCKS)), ways=st.integers(2, 4))
def test_a_split_block_computes_and_learns_as_the_whole_one(name: str, ways: int) -> None:
    make, kind = BLOCKS[name]
    whole = make()
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    split = split_block(whole, [CPU] * ways)
    # The split holds the whole block's values exactly, and left the block as it was.
    state = split.whole_state()
    assert state.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(state[key], value), key
        assert torch.equal(whole.state_dict()[key], value), key
    x = _input(kind)
    ours, theirs = split(x), whole(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    grads = split.whole({n: p.grad for n, p in split.named_parameters() if p.grad is not None})
    for n, p in whole.named_parameters():
        assert p.grad is not None
        # Summed over more terms than the outputs: within their share of the largest.
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5 * scale)
    # The same split again gives the same bits.
    again = split_block(make(), [CPU] * ways)
    assert torch.equal(again(x), split(x))


def test_a_split_block_loads_a_whole_state_and_trains_as_the_whole_one() -> None:
    whole = _gpt(1)
    split = split_block(_gpt(2), [CPU, CPU, CPU])  # another layer's values, then loaded
    split.load_whole(whole.state_dict())
    steps: list[Any] = []
    for module in (whole, split):
        opt = torch.optim.Adam(module.parameters(), lr=0.01)
        for step in range(5):
            opt.zero_grad()
            module(_input("gpt") + step).square().mean().backward()
            opt.step()
        steps.append(module.state_dict() if module is whole else split.whole_state())
    for key, value in steps[0].items():
        torch.testing.assert_close(steps[1][key], value, rtol=1e-4, atol=1e-5)


def test_blocks_that_cannot_split_say_why() -> None:
    with pytest.raises(TensorSplitError, match="Embedding"):
        split_block(_gpt(0), [CPU, CPU])
    with pytest.raises(TensorSplitError, match="6 heads"):
        split_block(_gpt(1), [CPU] * 7)
    with pytest.raises(TensorSplitError, match="2 or more devices"):
        split_block(_gpt(1), [CPU])
    normed = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert not splittable(normed)  # the layer norm would run on each device's columns
    with pytest.raises(TensorSplitError, match="no tensor-parallel split"):
        split_block(normed, [CPU, CPU])


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_what_a_split_divides_is_what_the_partitioner_counts_divided(name: str) -> None:
    """``split_size`` (a traced block's ``split_bytes`` and ``split_ways``): its ``numel``
    is the parameters whose pieces are spread over the devices, the rest whole on the first
    device; its ``ways`` the most devices the block splits over."""
    build, _ = BLOCKS[name]
    block = build()
    split = split_block(block, [CPU, CPU])
    whole = dict(block.named_parameters())
    spread = sum(whole[key].numel() for key, piece in split.pieces.items() if len(piece.names) > 1)
    size = split_size(block)
    assert size.numel == spread > 0
    split_block(block, [CPU] * size.ways)
    with pytest.raises(TensorSplitError, match=f"parallelism.tensor <= {size.ways}"):
        split_block(block, [CPU] * (size.ways + 1))
    assert split_size(_gpt(0)) == SplitSize(0, 0)  # the embedding stays whole


@pytest.mark.parametrize("name", sorted(set(BLOCKS) - {"declared"}))
def test_a_split_says_which_device_holds_each_parameter(name: str) -> None:
    """``device_index`` (what a device's share of the state is counted by) names the device
    each parameter was put on: checked with a second device of another kind (meta). A
    declared split is checked so when it is made (on devices that hold values)."""
    build, _ = BLOCKS[name]
    devices = [CPU, torch.device("meta"), torch.device("meta")]
    split = split_block(build(), devices)
    where = {n: split.devices[split.device_index(n)] for n, _ in split.named_parameters()}
    assert where == {n: p.device for n, p in split.named_parameters()}
    assert set(where.values()) == {CPU, torch.device("meta")}


class _NotASplit(ResidualMLP):
    def tensor_split(self, devices: Sequence[torch.device]) -> SplitBlock:
        return nn.Identity()  # type: ignore[return-value]


class _PieceLeftOut(ResidualMLP):
    def tensor_split(self, devices: Sequence[torch.device]) -> SplitBlock:
        split = SplitResidualMLP(self, devices)
        del split.pieces["norm.bias"]
        return split


class _WrongDim(ResidualMLP):
    def tensor_split(self, devices: Sequence[torch.device]) -> SplitBlock:
        split = SplitResidualMLP(self, devices)
        split.pieces["fc2.weight"] = replace(split.pieces["fc2.weight"], dim=0)
        return split


class _WaysUnsaid(ResidualMLP):
    tensor_ways = "many"  # type: ignore[assignment]

    def __init__(self, width: int, hidden: int) -> None:
        nn.Module.__init__(self)


@pytest.mark.parametrize(
    ("cls", "ways", "message"),
    [
        (ResidualMLP, 7, r"splits over 2 to 6 devices, not 7; use parallelism.tensor <= 6"),
        (_NotASplit, 2, r"returned Identity, not a SplitBlock"),
        (_PieceLeftOut, 2, r"must name every entry .* \['norm.bias'\]"),
        (_WrongDim, 2, r"pieces of \['fc2.weight'\] do not concatenate"),
        (_WaysUnsaid, 2, r"its tensor_ways is 'many'"),
    ],
)
def test_a_declared_split_is_checked_when_it_is_made(
    cls: type[ResidualMLP], ways: int, message: str
) -> None:
    with pytest.raises(TensorSplitError, match=message):
        split_block(_declared(cls), [CPU] * ways)
    if cls is _WaysUnsaid:  # counted as no split: the model's trace does not fail on it
        assert split_size(_declared(cls)) == SplitSize(0, 0)


def test_splitting_draws_nothing_from_the_random_generator() -> None:
    block = _gpt(1)
    torch.manual_seed(11)
    split_block(block, [CPU, CPU])
    drawn = torch.rand(1)
    torch.manual_seed(11)
    assert torch.equal(torch.rand(1), drawn)
