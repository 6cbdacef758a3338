"""A SHARP device's accounting against what it holds: two models' shards alternating on one
``ShardHost``, as the executor dispatches them (each model's forwards, then its backwards,
the models taking turns task by task, the next task's shard prefetched).

``alternate`` runs it and returns the most the host accounted for at once (its resident
shards: the running task's at all it was planned to need, the others at their state and
what their micro-batches in flight keep; and the kept tensors of shards demoted between a
forward and a backward) and the number of tasks run; the GPU test compares that with the
allocator's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from shoal.scheduler.devices import Device
from shoal.scheduler.memory import in_flight, stage_memory
from shoal.scheduler.sharp import Shard, shard_model
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.profiler import trace_costs
from shoal.workers.sharp.shard_host import ShardHost
from shoal.workers.sharp.shard_types import ShardKey
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.wire import Wire, send
from shoal.workers.zoo.data import make_data
from tests.workers.memory_cases import MICRO_BATCHES

Case: TypeAlias = tuple[ModelRef, DataRef, int]
GPT: Case = (
    ModelRef("gpt", None, {"d_model": 512, "n_layers": 8, "n_heads": 8}),
    DataRef("synthetic-lm", None, {"vocab_size": 256, "seq_len": 128}),
    32,
)
MODELS = {"a": 1, "b": 2}
"""The two models (same shape, different seeds) and their seeds."""


def shards_for(precision: str, recompute: bool, case: Case = GPT) -> tuple[tuple[Shard, ...], int]:
    """The model's shards under a device budget of 3/4 of what the whole model needs on
    one device (so it takes several), and that budget."""
    model, data, batch = case
    rows = batch // MICRO_BATCHES
    costs = trace_costs(model, data, micro_batch_size=rows, optimizer="adamw", precision=precision)
    whole = stage_memory(
        costs,
        (0, len(costs)),
        micro_batch_size=rows,
        in_flight=in_flight("gpipe", 1, 0, MICRO_BATCHES),
        recompute=recompute,
        precision=precision,
    ).total
    budget = whole * 3 // 4
    shards = shard_model(
        costs,
        budget,
        rows,
        micro_batches=MICRO_BATCHES,
        recompute=recompute,
        precision=precision,
    )
    return shards, budget


def alternate(
    device: Device,
    precision: str,
    recompute: bool,
    steps: int = 2,
    probe: Callable[[ShardKey, dict[str, Any]], None] | None = None,
    case: Case = GPT,
) -> tuple[ShardHost, int, int]:
    """Train both models ``steps`` steps on one host; the host, the most it accounted for
    at once (after each task: what it held through that task) and the tasks run. ``probe``
    is called after each task with its shard and what the host holds then (``held``); ``case``
    the model, its data and the batch size."""
    model, data, batch = case
    rows = batch // MICRO_BATCHES
    shards, budget = shards_for(precision, recompute, case)
    host = ShardHost(device, budget)
    source = make_data(data, 0)
    for name, seed in MODELS.items():
        setup = StageSetup(
            model=model,
            meta=source.meta,
            optimizer=OptimizerConf("adamw", 3e-4),
            seed=seed,
            num_blocks=shards[-1].blocks[1],
            recompute=recompute,
            precision=precision,
        )
        for shard in shards:
            key, kept, work = (name, shard.index), shard.kept_bytes, shard.work_bytes
            host.add(key, setup, shard.blocks, shard.bytes, kept=kept, work=work)
    count = len(shards)
    order = [(name, t) for t in range(2 * count) for name in MODELS]
    accounted, tasks = 0, 0
    for step in range(steps):
        x, y = source.batch(step, batch)
        parts = [slice(j * rows, (j + 1) * rows) for j in range(MICRO_BATCHES)]
        carried: dict[str, list[Wire | None]] = {n: [send(x[p]) for p in parts] for n in MODELS}
        for position, (name, t) in enumerate(order):
            after = order[position + 1] if position + 1 < len(order) else None
            prefetch: ShardKey | None = (
                (after[0], _shard_of(after[1], count)) if after is not None else None
            )
            key = (name, _shard_of(t, count))
            if t < count:
                targets = [send(y[p]) for p in parts] if t == count - 1 else None
                inputs = [w for w in carried[name] if w is not None]
                carried[name], _ = host.forward(key, inputs, targets, rows / batch, prefetch)
                if t == count - 1:
                    carried[name] = [None] * MICRO_BATCHES
            else:
                carried[name], _ = host.backward(key, carried[name], prefetch)
            held = host.held()
            now = held["resident_bytes"] + held["residue_bytes"]
            accounted = max(accounted, now)
            tasks += 1
            if probe is not None:
                probe(key, held)
    if device.gpu:
        torch.cuda.synchronize()
    return host, accounted, tasks


def _shard_of(task: int, count: int) -> int:
    """The shard of a model's ``task``-th task in a step: forwards up, backwards down."""
    return task if task < count else 2 * count - 1 - task
