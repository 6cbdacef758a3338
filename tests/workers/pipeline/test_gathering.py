"""ZeRO-3 (``shard: full``): each replica keeps 1/R of every block's parameters, gradients
and optimizer state, gathering a block's parameters whole only while it runs; the replicas
train as whole ones do, within the stated tolerance, and bitwise as the same run again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.workers.blocks import Block
from shoal.workers.pipeline.collective import GlooCollective
from shoal.workers.pipeline.local_ranks import run_ranks
from shoal.workers.pipeline.replicas import Replicas
from shoal.workers.pipeline.sharding import ShardingError, StageShards
from shoal.workers.pipeline.timing import StepClock, StepTimer
from shoal.workers.pipeline.transport import LinkError
from shoal.workers.snapshot import OptimizerConf
from tests.factories import ADAM, SGD

WIDTH = 16


def _blocks(conf: OptimizerConf) -> list[Block]:
    torch.manual_seed(0)  # identical parameters on every replica, as in training
    modules = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.0), nn.ReLU()),
        nn.Linear(WIDTH, 3),
    ]
    return [Block(i, m, conf) for i, m in enumerate(modules)]


def _input(rank: int, step: int, mb: int) -> torch.Tensor:
    return torch.randn(
        4, WIDTH, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + mb)
    )


def _one_f_one_b(micro_batches: int, lead: int) -> list[tuple[str, int]]:
    """A stage's order of forwards and backwards: ``lead`` forwards ahead, then one of each."""
    order, done = [], 0
    for mb in range(micro_batches):
        order.append(("f", mb))
        if mb + 1 >= lead:
            order.append(("b", done))
            done += 1
    order.extend(("b", mb) for mb in range(done, micro_batches))
    return order


def _train(blocks: list[Block], rank: int, step: int, order: list[tuple[str, int]]) -> None:
    losses: dict[int, torch.Tensor] = {}
    for kind, mb in order:
        if kind == "f":
            x = _input(rank, step, mb)
            for block in blocks:
                x = block.module(x)
            losses[mb] = x.square().mean()
        else:
            losses.pop(mb).backward()


def _ranks(world: int, body: Callable[[GlooCollective, int], Any]) -> list[Any]:
    results = run_ranks(world, body, timeout_s=30, name="stage-0")
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results


def _run_full(world: int, conf: OptimizerConf, micro_batches: int, lead: int) -> list[Any]:
    """Four steps of ZeRO-3 and of plain data parallelism on each rank: per rank, the whole
    replicas' final state, the sharded ones' (unsharded at the end), and the bytes the
    sharded rank held at rest and at most during a step."""
    built = [(_blocks(conf), _blocks(conf)) for _ in range(world)]
    order = _one_f_one_b(micro_batches, lead)

    def body(collective: GlooCollective, rank: int) -> Any:
        whole, full = built[rank]
        shards = StageShards(full, "full", collective)
        peak = [0]

        def measure(*_: Any) -> None:
            peak[0] = max(peak[0], shards.held_bytes())

        for block in full:  # after the gather's own hook: inside each block's forward
            block.module.register_forward_pre_hook(measure)

        rest = []
        for step in range(4):
            _train(whole, rank, step, order)
            collective.all_reduce(whole)
            for block in whole:
                block.step()
            _train(full, rank, step, order)
            shards.settle()
            shards.update(None)
            shards.gather(collective)
            rest.append(shards.held_bytes())
        rest.append(sum(b.nbytes() for b in whole))  # a whole replica's, to compare
        shards.unshard(collective)
        return [b.state() for b in whole], [b.state() for b in full], rest, peak[0]

    return _ranks(world, body)


@pytest.mark.unit
@settings(max_examples=3, deadline=None)
@given(
    world=st.integers(2, 3),
    conf=st.sampled_from([ADAM, SGD, OptimizerConf("adamw", 0.02, {"weight_decay": 0.1})]),
    micro_batches=st.integers(1, 4),
    lead=st.integers(1, 3),
)
def test_zero3_replicas_train_as_whole_ones_holding_a_share_of_everything(
    world: int, conf: OptimizerConf, micro_batches: int, lead: int
) -> None:
    """Micro-batches in 1F1B order (forwards ahead of their backwards, so a block's
    parameters are gathered again for a backward after other micro-batches ran): every
    replica ends with plain data parallelism's parameters within rtol 1e-5 (the sums group
    by micro-batch, then replica), holds 1/R of the state between steps and at most one
    block's parameters whole during one; the same run again is bitwise the same."""
    first = _run_full(world, conf, micro_batches, lead)
    for whole, full, (*rest, unsharded), peak in first:
        for a, b in zip(whole, full, strict=True):
            for name, tensor in a["module"].items():
                torch.testing.assert_close(b["module"][name], tensor, rtol=1e-5, atol=1e-6)
        largest = max(
            sum(p.numel() * p.element_size() for p in b.module.parameters()) for b in _blocks(conf)
        )
        # Slices round up by at most one value per block for each kind of state; a whole
        # replica counts Adam's step once per parameter, a slice once per block.
        assert rest == [rest[0]] * 4, rest
        assert rest[0] == pytest.approx(unsharded / world, abs=3 * 4 * 3 + 6 * 4), rest
        assert rest[0] < peak <= rest[0] + largest, (peak, rest, largest)
    again = _run_full(world, conf, micro_batches, lead)
    for (_, ours, _, _), (_, theirs, _, _) in zip(first, again, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            for name, tensor in a["module"].items():
                assert torch.equal(b["module"][name], tensor)


@pytest.mark.unit
def test_a_zero3_parameter_left_without_gradient_is_named() -> None:
    """A parameter the forward does not use never gets its gradient summed: the step is
    refused naming the block, on every replica alike (none waits on the others)."""

    def body(collective: GlooCollective, rank: int) -> str:
        torch.manual_seed(0)
        unused = nn.ModuleDict({"used": nn.Linear(4, 4), "spare": nn.Linear(4, 4)})
        block = Block(0, unused, SGD)
        unused.forward = lambda x: unused["used"](x)  # type: ignore[method-assign]
        shards = StageShards([block], "full", collective)
        block.module(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ShardingError) as info:
            shards.settle()
        return str(info.value)

    for message in _ranks(2, body):
        assert "blocks [0]" in message and "parallelism.shard: none" in message


@pytest.mark.unit
def test_zero3_exchanges_inside_a_forward_and_backward_are_timed_as_all_reduce() -> None:
    """The gathers and reduce-scatters run inside the stage's compute: the step's timings
    book them as all-reduce time, which the compute time leaves out."""
    gathers = [0, 0]

    def body(collective: GlooCollective, rank: int) -> StepClock:
        timer = StepTimer(torch.device("cpu"))
        blocks = _blocks(SGD)
        shards = StageShards(blocks, "full", collective, timer.span)
        real = collective.all_gather_into

        def slow_gather(*args: Any) -> None:
            gathers[rank] += 1
            time.sleep(0.01)  # an exchange slower than these tiny blocks' compute
            real(*args)

        collective.all_gather_into = slow_gather  # type: ignore[method-assign]
        with timer.span("compute"):
            _train(blocks, rank, 0, _one_f_one_b(2, 1))
        shards.settle()
        return timer.lap()

    for rank, clock in enumerate(_ranks(2, body)):
        assert gathers[rank] >= len(_blocks(SGD)), gathers
        assert clock.allreduce_s >= 0.01 * gathers[rank], clock
        assert clock.compute_s < 0.01 * gathers[rank], clock


@pytest.mark.unit
def test_a_replica_gone_mid_gather_is_a_lost_link() -> None:
    """The other replica leaves the group: the gather before the next forward fails as a
    ``LinkError`` (recovered in place), not as a failed job."""

    def body(collective: GlooCollective, rank: int) -> str:
        blocks = _blocks(SGD)
        StageShards(blocks, "full", collective)
        if rank == 1:
            collective.close()
            return "left"
        with pytest.raises(LinkError):
            blocks[0].module(torch.randn(2, WIDTH))
        return "lost"

    assert sorted(run_ranks(2, body, timeout_s=10, name="stage-0")) == ["left", "lost"]


@pytest.mark.unit
def test_relayed_steps_shard_full_replicas_as_optimizer() -> None:
    """A relayed step (a call per forward and backward, the runner ordering them) cannot
    gather in lockstep: its replicas of a ``full`` job shard the optimizer state only, the
    parameters whole, and the update still equals plain data parallelism's."""
    replicas = [Replicas(torch.device("cpu"), "full") for _ in range(2)]
    address, port = replicas[0].host()
    built = [(_blocks(ADAM), _blocks(ADAM)) for _ in range(2)]
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            replicas[r].join(address, port, r, 2, "stage-0")
            relayed = built[r][0]
            _train(relayed, r, 0, _one_f_one_b(2, 1))
            replicas[r].reduce(relayed, scatter=False)
            shares = replicas[r].shares(relayed)
            assert shares is not None
            shares.update(None)
            replicas[r].gather()
            replicas[r].unshard()
            replicas[r].leave()
            results[r] = shares.mode, [b.state() for b in relayed]
        except BaseException as exc:  # read below
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, tuple) for r in results), results
    # The whole replicas' update, for comparison: summed the same way, stepped whole.
    for r in range(2):
        _train(built[r][1], r, 0, _one_f_one_b(2, 1))
    for p, q in zip(built[0][1], built[1][1], strict=True):
        for a, b in zip(p.module.parameters(), q.module.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            total = a.grad + b.grad
            a.grad, b.grad = total.clone(), total.clone()
    for block in built[0][1]:
        block.step()
    for mode, states in results:
        assert mode == "optimizer"
        for state, block in zip(states, built[0][1], strict=True):
            for name, value in block.module.state_dict().items():
                assert torch.equal(state["module"][name], value), name
