"""A device runs a model's consecutive tasks there as one call of its worker (a *run*:
``ModelPlan.run_at``, ``ShardWorker.run``, ``HostPool.submit_run``): each task's value comes
back as its own call's, and a task that raises fails itself and the tasks after it, not
those before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from shoal.scheduler.sharp import (
    IdleDevice,
    ModelPlan,
    Policy,
    Shard,
    ShardTask,
    assign_run,
    progress,
)
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.sharp.shard_pool import RayPool, await_all
from shoal.workers.sharp.shard_types import TaskResult
from shoal.workers.sharp.shard_worker import ShardFailed, ShardWorker
from shoal.workers.wire import send
from shoal.workers.zoo.data import make_data
from tests.workers.sharp.test_sharp_runner import devices, model

KEY = ("a", 0)


def _shards(k: int) -> tuple[Shard, ...]:
    return tuple(Shard(i, (i, i + 1), 1.0, 2.0, 1, 1) for i in range(k))


@pytest.mark.unit
def test_a_run_is_the_tasks_from_a_position_on_one_device_up_to_the_step_s_end() -> None:
    plan = ModelPlan("m", _shards(4), steps=2)  # F0 F1 F2 F3 B3 B2 B1 B0, twice
    split = [0, 0, 1, 1]
    assert [plan.run_at(p, split) for p in (0, 1, 2, 4, 6, 7, 8)] == [2, 1, 4, 2, 2, 1, 2]
    whole = [1, 1, 1, 1]
    assert [plan.run_at(p, whole) for p in (0, 3, 8, 15)] == [8, 5, 8, 1]
    alternating = [0, 1, 0, 1]  # F3 B3 is one shard's pair: the only run longer than one
    assert [plan.run_at(p, alternating) for p in range(8)] == [1, 1, 1, 2, 1, 1, 1, 1]


@pytest.mark.unit
def test_a_run_prefetches_each_next_task_s_shard_and_after_its_last_only_one_living_there() -> None:
    plan = ModelPlan("m", _shards(2), steps=2)
    device = IdleDevice("d", 1.0, 10**9)

    def prefetched(homes: list[int], done: int) -> list[tuple[ShardTask, ShardTask | None]]:
        runnable = [progress(plan, done)]
        run = assign_run(Policy.LRTF, device, runnable, {"m": plan}, {"m": homes}, 0)
        assert run is not None
        return [(a.task, a.prefetch) for a in run]

    f0, f1, b1, b0, f0_next = (plan.task(p) for p in range(5))
    # A step whole on the device: each task's next, then the next step's first.
    assert prefetched([0, 0], 0) == [(f0, f1), (f1, b1), (b1, b0), (b0, f0_next)]
    assert prefetched([0, 0], 4)[-1] == (plan.task(7), None)  # the model's last: nothing after
    assert prefetched([0, 1], 0) == [(f0, None)]  # its next shard lives on another device


class _OneShard:
    """A model held whole as one shard by a worker, and the calls of one of its steps."""

    def __init__(self, root: Path) -> None:
        self.snap = model(root, "a")
        self.worker = ShardWorker(devices()[0], 2**40)
        data = make_data(self.snap.data, self.snap.seed)
        setup = StageSetup.of(self.snap, data.meta)
        self.add = (KEY, setup, (0, self.snap.num_blocks), 0, None, False, 0.0)
        self.worker.call("add", *self.add)
        rows = self.snap.batch_size // self.snap.micro_batches
        x, y = data.batch(0, self.snap.batch_size)
        cut = [slice(j * rows, (j + 1) * rows) for j in range(self.snap.micro_batches)]
        xs, ys = [send(x[c]) for c in cut], [send(y[c]) for c in cut]
        self.forward = ("forward", (KEY, xs, ys, 0.5, None, None, False))
        self.backward = ("backward", (KEY, [None] * self.snap.micro_batches, None, None, None))

    def run(self, *tasks: tuple[str, tuple[Any, ...]]) -> tuple[Any, ...]:
        arity = [(method, len(args)) for method, args in tasks]
        return self.worker.run(arity, *[a for _, args in tasks for a in args])

    def parameters(self) -> list[torch.Tensor]:
        stage = self.worker.host._shards[KEY]
        return [p.detach().clone() for b in stage.blocks for p in b.module.parameters()]


@pytest.mark.unit
def test_a_run_returns_each_task_s_pair_as_its_calls_would(tmp_path: Path) -> None:
    run, calls = _OneShard(tmp_path / "run"), _OneShard(tmp_path / "calls")
    values = run.run(run.forward, run.backward)
    one = calls.worker.call(*calls.forward[:1], *calls.forward[1])
    two = calls.worker.call(*calls.backward[:1], *calls.backward[1])
    assert len(values) == 4 and all(isinstance(v, TaskResult) for v in values[1::2])
    assert values[1].losses == one[1].losses and values[3].losses == two[1].losses == []
    for a, b in zip(run.parameters(), calls.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.unit
def test_a_task_that_raises_fails_itself_and_those_after_it_in_its_run(tmp_path: Path) -> None:
    """The forward's pair stands; the backward of a shard the worker does not hold raises,
    and the backward after it does not run (the parameters are the forward's)."""
    run, alone = _OneShard(tmp_path / "run"), _OneShard(tmp_path / "alone")
    missing = ("backward", (("b", 0), *run.backward[1][1:]))
    values = run.run(run.forward, missing, run.backward)
    assert isinstance(values[1], TaskResult)
    assert values[2] is None and values[4] is None
    failed = values[3]
    assert isinstance(failed, ShardFailed) and failed.method == "backward", failed
    assert values[5] is failed
    alone.worker.call(*alone.forward[:1], *alone.forward[1])
    for a, b in zip(run.parameters(), alone.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.integration
def test_a_ray_run_s_tasks_end_as_calls_of_their_own(ray_address: str, tmp_path: Path) -> None:
    """Through Ray: each task of a run is a call of its own, whose result reads as a lone
    call's; a failed task's result raises its ``ShardFailed``, the task before it stands."""
    node = ray.get_runtime_context().get_node_id()
    pool_devices = devices(node)
    pool = RayPool(pool_devices, {d.id: 2**40 for d in pool_devices})
    one = _OneShard(tmp_path)
    try:
        await_all(pool, [pool.submit(0, "add", *one.add)], 60.0)
        missing = ("backward", (("b", 0), *one.backward[1][1:]))
        forward, failed, after = pool.submit_run(0, [one.forward, missing, one.backward])
        (result,) = await_all(pool, [forward], 60.0)
        assert isinstance(result, TaskResult) and len(result.losses) == one.snap.micro_batches
        for call in (failed, after):
            assert pool.wait([call], 60.0) == [call]
            with pytest.raises(ShardFailed, match="backward"):
                pool.result(call)
    finally:
        pool.shutdown()
