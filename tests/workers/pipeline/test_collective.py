"""The replica gradient sum: one fixed order, the same in-process and over gloo."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from shoal.workers.pipeline.collective import (
    GlooCollective,
    flatten_grads,
    ordered_sum,
    sum_in_process,
    unflatten_grads,
)
from shoal.workers.pipeline.local_ranks import run_ranks


@dataclass
class _Block:
    module: nn.Module


class _Replica:
    """Stand-in for a Stage: blocks whose gradients are random, as after a backward."""

    def __init__(self, seed: int, with_grads: bool = True) -> None:
        torch.manual_seed(0)  # identical parameters on every replica, as in training
        self.blocks = [_Block(nn.Linear(5, 3)), _Block(nn.Sequential(nn.Linear(3, 2)))]
        generator = torch.Generator().manual_seed(seed)
        for block in self.blocks:
            for p in block.module.parameters():
                if with_grads:
                    p.grad = torch.randn(p.shape, generator=generator)


def grads(replica: _Replica) -> list[torch.Tensor]:
    return [p.grad.clone() for b in replica.blocks for p in b.module.parameters()]


def _run_ranks(replicas: list[_Replica]) -> list[BaseException]:
    """Every replica joins one gloo group (one thread per rank) and all-reduces once."""

    def body(collective: GlooCollective, r: int) -> None:
        collective.all_reduce(replicas[r].blocks)

    results = run_ranks(len(replicas), body, timeout_s=30, name="stage-0")
    return [r for r in results if isinstance(r, BaseException)]


@pytest.mark.unit
def test_flat_buffer_round_trips_and_skips_parameters_without_gradients() -> None:
    replica = _Replica(1)
    before = grads(replica)
    flat = flatten_grads(replica.blocks)
    assert flat.numel() == 5 * 3 + 3 + 3 * 2 + 2
    unflatten_grads(replica.blocks, flat * 2)
    assert all(torch.equal(a, 2 * b) for a, b in zip(grads(replica), before, strict=True))
    bare = _Replica(1, with_grads=False)
    assert flatten_grads(bare.blocks).numel() == 0
    with pytest.raises(ValueError, match="a gradient buffer of 3 values for 26"):
        unflatten_grads(replica.blocks, torch.zeros(3))


@pytest.mark.unit
@pytest.mark.parametrize("count", [1, 2, 3])
def test_in_process_sum_is_the_replica_order_fold(count: int) -> None:
    replicas = [_Replica(seed) for seed in range(count)]
    expected = ordered_sum([flatten_grads(r.blocks) for r in replicas])
    manual = flatten_grads(replicas[0].blocks).clone()
    for r in replicas[1:]:
        manual += flatten_grads(r.blocks)
    assert torch.equal(expected, manual)
    sum_in_process(replicas)
    for r in replicas:  # every replica now holds the same, bitwise
        assert torch.equal(flatten_grads(r.blocks), expected)


@pytest.mark.unit
@pytest.mark.parametrize("count", [2, 3, 4, 5])  # 26 values: uneven R-ths from 3 on
def test_gloo_sum_equals_the_in_process_sum_bitwise(count: int) -> None:
    local = [_Replica(seed) for seed in range(count)]
    distributed = [_Replica(seed) for seed in range(count)]
    sum_in_process(local)
    assert _run_ranks(distributed) == []
    for a, b in zip(local, distributed, strict=True):
        assert torch.equal(flatten_grads(a.blocks), flatten_grads(b.blocks))


@pytest.mark.unit
@pytest.mark.parametrize("count", [2, 3, 4])
def test_all_gathers_give_every_rank_every_slice_in_rank_order(count: int) -> None:
    sizes = [3, 0, 2, 1][:count]  # uneven, one rank with nothing
    slices = [torch.arange(n, dtype=torch.float32) + 10 * q for q, n in enumerate(sizes)]
    whole = torch.cat(slices)

    def rank(collective: GlooCollective, r: int) -> tuple[list[Tensor], Tensor]:
        listed = collective.all_gather(slices[r], sizes)
        out = torch.full((sum(sizes),), -1.0)
        collective.all_gather_into(out, slices[r], sizes)
        return listed, out

    for r, result in enumerate(run_ranks(count, rank, timeout_s=30, name="gather")):
        assert not isinstance(result, BaseException), (r, result)
        listed, out = result
        assert [t.tolist() for t in listed] == [t.tolist() for t in slices], r
        assert torch.equal(out, whole), (r, out)


@pytest.mark.unit
def test_all_reduce_before_join_is_refused() -> None:
    with pytest.raises(RuntimeError, match="has not joined its group"):
        GlooCollective(torch.device("cpu")).all_reduce(_Replica(0).blocks)


@pytest.mark.unit
def test_gloo_all_reduce_cost_of_one_million_floats(capsys: Any) -> None:
    """Not a timing assertion: prints what one step's gradient sum costs (see DESIGN)."""

    class _Big:
        def __init__(self) -> None:
            module = nn.Linear(1000, 1000, bias=False)
            module.weight.grad = torch.ones_like(module.weight)
            self.blocks = [_Block(module)]

    replicas = [_Big(), _Big()]

    def rank(collective: GlooCollective, r: int) -> float:
        collective.all_reduce(replicas[r].blocks)  # warm-up
        start = time.perf_counter()
        for _ in range(5):
            collective.all_reduce(replicas[r].blocks)
        return (time.perf_counter() - start) / 5

    results = run_ranks(2, rank, timeout_s=30, name="bench")
    spent = [s for s in results if isinstance(s, float)]
    assert len(spent) == 2, results
    weight: Any = replicas[0].blocks[0].module.weight
    assert torch.equal(weight.grad, torch.full_like(weight, 2.0**6))  # 1 doubled six times
    with capsys.disabled():
        print(f"\ngloo all-reduce, 1M floats, 2 ranks (threads): {max(spent) * 1e3:.1f} ms")
