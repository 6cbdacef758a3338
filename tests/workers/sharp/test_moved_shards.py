"""A SHARP shard's stage is built in host memory and computes on its device, on a GPU
moving between the two: what it runs is timed where it runs, and a forward run again (in a
recomputing backward) draws the random numbers its first run drew there."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.sharp.shard_host import ShardHost
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.wire import Wire, receive_tree, send
from shoal.workers.zoo.data import make_data

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KINDS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
MICRO_BATCHES = 2
Case = tuple[ModelRef, DataRef]
DROPOUT: Case = (
    ModelRef(None, "tests.workers.test_factories:dropout_mlp", {"hidden": 64}),
    DataRef("synthetic-regression", None, {"features": 32, "outputs": 4}),
)


def _device(kind: str) -> Device:
    return Device(f"{kind}-0", "node-0", 0, kind, 40960, gpu=kind == "cuda")


def _setup(case: Case, blocks: int, seed: int, recompute: bool) -> StageSetup:
    model, data = case
    return StageSetup(
        model=model,
        meta=make_data(data, 0).meta,
        optimizer=OptimizerConf("sgd", 0.1),
        seed=seed,
        num_blocks=blocks,
        recompute=recompute,
        allowed=("tests.workers.test_factories",),
    )


def _batch(case: Case, step: int, rows: int) -> tuple[list[Wire], list[Wire]]:
    """Step ``step``'s micro-batches of inputs and of targets, in wire form."""
    x, y = make_data(case[1], 0).batch(step, rows)
    part = rows // MICRO_BATCHES
    parts = [slice(j * part, (j + 1) * part) for j in range(MICRO_BATCHES)]
    return [send(x[p]) for p in parts], [send(y[p]) for p in parts]


def _alternate(kind: str, recompute: bool) -> tuple[list[float], dict[str, Any]]:
    """Two models' shards (each a whole dropout model) take turns on one host with room
    for one at a time, task by task, for two steps: on a GPU each shard is demoted between
    its forward and its backward. The losses, and each model's states after."""
    sizing = ShardHost(_device("cpu"), 2**40)
    size = sizing.add(("x", 0), _setup(DROPOUT, 3, 0, recompute), (0, 3), 0)
    host = ShardHost(_device(kind), size * 3 // 2)
    for seed, name in enumerate("ab"):
        host.add((name, 0), _setup(DROPOUT, 3, seed, recompute), (0, 3), 0)
    torch.manual_seed(7)  # the dropout masks: CPU and every GPU's generators
    losses: list[float] = []
    for step in range(2):
        xs, ys = _batch(DROPOUT, step, 16)
        for name in "ab":
            _, result = host.forward((name, 0), xs, ys, 1.0 / MICRO_BATCHES)
            losses += result.losses
        for name in "ab":
            host.backward((name, 0), [None] * MICRO_BATCHES)
    states = {}
    for name in "ab":
        host.copy((name, 0), 2, 1)
        copied, _, _ = host.copied((name, 0), 1, 60.0)
        states[name] = {i: receive_tree(s, torch.device("cpu")) for i, s in copied.items()}
    return losses, states


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
def test_a_recomputed_forward_draws_the_random_numbers_its_first_run_drew(kind: str) -> None:
    """With recompute each backward runs its forward again, after the other model's
    forward has drawn from the same generators (on a GPU, the shard gone to host memory
    and back meanwhile): it must draw the same dropout masks, so both models train as
    they do keeping their graphs."""
    kept_losses, kept = _alternate(kind, recompute=False)
    losses, redone = _alternate(kind, recompute=True)
    assert losses == pytest.approx(kept_losses, rel=1e-5)
    for name, blocks in kept.items():
        for index, block in blocks.items():
            for param, want in block["module"].items():
                got = redone[name][index]["module"][param]
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (name, index, param)


@pytest.mark.gpu
@CUDA
def test_a_task_on_the_gpu_is_timed_as_the_gpu_computes() -> None:
    """The stage is built in host memory, and its tasks' compute seconds are still the
    GPU's (CUDA events), not the host's time launching kernels: tasks that keep the GPU
    busy for tens of milliseconds each are timed at most of their wall time."""
    case = (
        ModelRef("mlp", None, {"hidden": 4096, "layers": 8}),
        DataRef("synthetic-regression", None, {"features": 1024, "outputs": 16}),
    )
    host, key, rows = ShardHost(_device("cuda"), 2**40), ("a", 0), 4096
    host.add(key, _setup(case, 9, 0, recompute=False), (0, 9), 0)
    timed = []
    for step in range(2):  # the first brings the shard onto the GPU and starts cuBLAS
        xs, ys = _batch(case, step, rows)
        for task in ("forward", "backward"):
            torch.cuda.synchronize()
            started = time.perf_counter()
            if task == "forward":
                _, result = host.forward(key, xs, ys, 1.0 / MICRO_BATCHES)
            else:
                _, result = host.backward(key, [None] * MICRO_BATCHES)
            torch.cuda.synchronize()
            timed.append((task, result.compute_s, time.perf_counter() - started))
    for task, compute_s, wall_s in timed[2:]:
        assert compute_s >= 0.5 * wall_s, f"{task}: compute {compute_s:.4f} s of {wall_s:.4f} s"
