"""A stage that takes copies makes their host memory ready in the step that makes its
optimizer's state, so no later copy pays for it (``Stage._update``, ``Copier.reserve``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.workers.pipeline.batch_rows import Rows
from shoal.workers.pipeline.copier import Copier, Copyable
from shoal.workers.pipeline.stage import Stage
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.profiler import trace_costs
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf, StagePlan
from shoal.workers.zoo.data import make_data

MODEL = ModelRef("mlp", None, {"hidden": 64, "layers": 2})
DATA = DataRef("synthetic-regression", None, {"features": 8, "outputs": 4})
BATCH, MICRO_BATCHES = 8, 2


def stage_on(device: Device, optimizer: str = "adamw") -> tuple[Stage, Callable[[int], None]]:
    """A one-stage job of an MLP with ``optimizer`` on ``device``, and its step ``n``."""
    blocks = len(trace_costs(MODEL, DATA, micro_batch_size=BATCH, optimizer=optimizer))
    meta = make_data(DATA, 0).meta
    opt = OptimizerConf(optimizer, 1e-3)
    setup = StageSetup(MODEL, meta, opt, 0, blocks, data=DATA, batch_size=BATCH)
    stage = Stage(StagePlan(0, (0, blocks), device), setup)

    def step(n: int) -> None:
        stage.step("1f1b", 1, MICRO_BATCHES, Rows(n, 0, BATCH), 1.0, True)

    return stage, step


def test_the_step_that_makes_the_optimizers_state_reserves_for_it_only_when_copying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reserved: list[int] = []
    real = Copier.reserve

    def record(copier: Copier, blocks: Sequence[Copyable]) -> None:
        reserved.append(len(blocks))
        real(copier, blocks)

    monkeypatch.setattr(Copier, "reserve", record)
    cpu = Device("cpu-0", "node-0", 0, "cpu", 4096, gpu=False)
    stage, step = stage_on(cpu)
    for n in range(3):  # no copies: nothing to make ready
        step(n)
    assert reserved == []

    stage, step = stage_on(cpu)
    stage.snapshot(0, 1)  # the first copy, before AdamW has any state
    assert len(reserved) == 1
    step(0)  # AdamW's moments appear: made ready here
    assert len(reserved) == 2
    step(1)  # nothing new
    assert len(reserved) == 2
    stage.snapshot(2, 2)
    assert len(reserved) == 3

    reserved.clear()
    stage, step = stage_on(cpu, "sgd")  # plain SGD keeps no state: nothing new to reserve
    stage.snapshot(0, 1)
    step(0)
    step(1)
    assert len(reserved) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_no_copy_after_the_first_step_pins_host_memory() -> None:
    stage, step = stage_on(Device("gpu-0", "node-0", 0, "h100", 81920, gpu=True))

    def pinned_allocations() -> int:
        return int(torch.cuda.host_memory_stats()["num_host_alloc"])

    stage.snapshot(0, 1)
    step(0)  # pins for AdamW's moments: the copies after pin nothing
    settled = pinned_allocations()
    for n in range(1, 6):
        stage.snapshot(n, n + 1)
        step(n)
    stage.shipment(6, timeout=30.0)  # the last copy, complete
    assert pinned_allocations() == settled
