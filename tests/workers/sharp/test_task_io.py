"""A SHARP host draws a step's batch where a model's first and last shards run, as a
pipeline's first and last stages do: the executor neither makes it nor sends it through Ray
(at a GPU's batch sizes that was a large share of every step on the executor's one thread),
and the micro-batches are exactly those the executor would have sent."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shoal.workers.pipeline.batch_rows import Draws
from shoal.workers.pipeline.stage_types import StageSetup, StageStateError
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool
from shoal.workers.sharp.shard_types import Drawn
from shoal.workers.sharp.task_io import TaskIO
from shoal.workers.snapshot import RunStatus
from shoal.workers.wire import send
from shoal.workers.zoo.data import make_data
from tests.workers.sharp.test_sharp_runner import assert_alone, budget_for_shards, devices, model

CPU = torch.device("cpu")


def setup_of(tmp_path: Path) -> StageSetup:
    snap = model(tmp_path, "a")
    return StageSetup.of(snap, make_data(snap.data, snap.seed, snap.allowed_factories).meta)


@pytest.mark.unit
def test_a_drawn_batch_is_the_micro_batches_the_executor_would_have_sent(tmp_path: Path) -> None:
    setup, io = setup_of(tmp_path), TaskIO("cpu-0")
    io.learn("a", setup)
    xs, ys = io.take("a", Drawn(3, 4), CPU, Drawn(3, 4))
    inputs, targets = make_data(setup.data, setup.seed, setup.allowed).batch(3, setup.batch_size)
    rows = setup.batch_size // 4
    assert ys is not None and len(xs) == len(ys) == 4
    for j in range(4):
        sent_x, sent_y = (send(t[j * rows : (j + 1) * rows]) for t in (inputs, targets))
        assert torch.equal(xs[j], torch.from_numpy(np.asarray(sent_x))), j
        assert torch.equal(ys[j], torch.from_numpy(np.asarray(sent_y))), j
    other, _ = io.take("a", Drawn(4, 4), CPU)
    assert not torch.equal(torch.cat(other), inputs)  # each step its own batch


@pytest.mark.unit
def test_a_step_is_drawn_once_on_a_host_and_its_tasks_are_given_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's first and last shards on one CPU host take one draw of the step's batch
    (drawing is the device's cores' time there); a task that changes its inputs in place
    leaves the batch as drawn for the tasks after it, the step run again included."""
    setup, io, draws = setup_of(tmp_path), TaskIO("cpu-0"), []
    io.learn("a", setup)
    real = Draws.batch

    def counted(self: Draws, step: int) -> Any:
        draws.append(step)
        return real(self, step)

    monkeypatch.setattr(Draws, "batch", counted)
    inputs, targets = make_data(setup.data, setup.seed, setup.allowed).batch(2, setup.batch_size)
    xs, ys = io.take("a", Drawn(2, 4), CPU, Drawn(2, 4))  # a model of one shard
    assert ys is not None
    for x in xs:  # a model that changes its inputs in place
        assert x is not None
        x.mul_(0.0)
    for y in ys:
        y.add_(1.0)
    again, _ = io.take("a", Drawn(2, 4), CPU)  # the step's first shard run again
    last = io.targets("a", Drawn(2, 4), CPU)  # a last shard of several
    assert draws == [2]
    assert torch.equal(torch.cat([x for x in again if x is not None]), inputs)
    assert torch.equal(torch.cat(last), targets)
    io.take("a", Drawn(3, 4), CPU)
    io.take("a", Drawn(2, 4), CPU)  # a step out of turn (the model rolled back)
    assert draws == [2, 3, 2]


@pytest.mark.unit
def test_a_model_with_no_shard_on_the_host_cannot_draw_there(tmp_path: Path) -> None:
    io = TaskIO("cpu-0")
    with pytest.raises(StageStateError, match="model a holds no shard on cpu-0"):
        io.take("a", Drawn(0, 4), CPU)
    io.learn("a", setup_of(tmp_path))
    io.keep("a", 5, [torch.ones(2)])
    io.forget("a")  # its last shard left: its data and its stash go
    assert io.nbytes() == 0
    with pytest.raises(StageStateError, match="model a holds no shard"):
        io.take("a", Drawn(0, 4), CPU)


class ArgumentsWatchingPool(LocalPool):
    """A LocalPool that notes each shard task's inputs and targets as the executor sends
    them."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.sent: list[tuple[str, Any, Any]] = []

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method in ("forward", "backward"):
            key, inputs, *rest = args
            targets = rest[0] if method == "forward" else None
            self.sent.append((f"{method} {key[1]}", inputs, targets))
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_the_executor_sends_no_batch_and_the_models_train_exactly_as_alone(
    tmp_path: Path,
) -> None:
    snaps = [model(tmp_path, "a", steps=3), model(tmp_path, "b", seed=9, steps=3)]
    pools: list[ArgumentsWatchingPool] = []

    def watched(devs: Any, budgets: Any) -> ArgumentsWatchingPool:
        pools.append(ArgumentsWatchingPool(devs, budgets))
        return pools[-1]

    on, budget = devices(), budget_for_shards(snaps[0], 3)
    trainer = SharpTrainer(snaps, on, watched, budgets={d.id: budget for d in on})
    assert trainer.run() == {s.job_id: RunStatus.SUCCEEDED for s in snaps}
    (pool,) = pools
    firsts = [inputs for task, inputs, _ in pool.sent if task == "forward 0"]
    assert firsts and all(isinstance(x, Drawn) for x in firsts), firsts
    assert sorted(x.step for x in firsts) == sorted(list(range(3)) * 2)
    targets = [t for _, _, t in pool.sent if t is not None]
    assert targets and all(isinstance(t, Drawn) and t.micro_batches == 4 for t in targets)
    for snap in snaps:
        assert_alone(snap, [m.loss for m in trainer.report(snap.job_id, 0).metrics])


@pytest.mark.unit
def test_a_gpu_hosts_next_batch_is_drawn_ahead_by_a_thread_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drawing ahead (a GPU host's): each batch is drawn once, by the drawing thread, the
    step after it as soon as it is taken; a batch asked for again in its step (the model's
    last shard on the host too) is the one drawn, and a step out of turn is drawn anew."""
    setup, io = setup_of(tmp_path), TaskIO("cuda-0", ahead=True)
    io.learn("a", setup)
    draws: list[tuple[int, str]] = []
    real = Draws.batch

    def watched(self: Draws, step: int) -> Any:
        draws.append((step, threading.current_thread().name))
        return real(self, step)

    monkeypatch.setattr(Draws, "batch", watched)
    source = make_data(setup.data, setup.seed, setup.allowed)
    for step in (0, 1, 2):
        xs, _ = io.take("a", Drawn(step, 4), CPU)
        ys = io.targets("a", Drawn(step, 4), CPU)  # the last shard, on the same host
        inputs, targets = source.batch(step, setup.batch_size)
        assert torch.equal(torch.cat([x for x in xs if x is not None]), inputs), step
        assert torch.equal(torch.cat(ys), targets), step
    io.take("a", Drawn(7, 4), CPU)  # a step out of turn (the model rolled back or resumed)
    steps = [step for step, _ in draws]
    assert steps == [0, 1, 2, 3, 7, 8], steps
    assert all(name.startswith("shoal-draw") for _, name in draws), draws


@pytest.mark.unit
def test_a_draw_that_fails_fails_its_task_and_is_tried_again_when_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = TaskIO("cuda-0", ahead=True)
    io.learn("a", setup_of(tmp_path))
    real, failing = Draws.batch, [False, True]  # the first draw of step 0 fails, not the next

    def flaky(self: Draws, step: int) -> Any:
        if step == 0 and failing.pop():
            raise OSError("the dataset's file went away")
        return real(self, step)

    monkeypatch.setattr(Draws, "batch", flaky)
    with pytest.raises(OSError, match="went away"):
        io.take("a", Drawn(0, 4), CPU)
    xs, _ = io.take("a", Drawn(0, 4), CPU)
    assert len(xs) == 4
