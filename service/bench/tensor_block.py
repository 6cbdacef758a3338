"""``shoal bench shard``'s tensor-parallel part: TP 2 against TP 1 on one block.

The bench model's first hidden layer (``hidden`` x ``hidden``, Adam) is trained whole on one
device and split over two (``workers.tensor_split``, as a stage of ``parallelism.tensor: 2``
splits it) on the same micro-batches: samples/s (the median step after the warm-up), the
most state one device of the split keeps (its parameters and their optimizer state) against
the partitioner's prediction (``scheduler.tensor.per_device``), and how far the split's
losses are from the whole block's. The devices are this process's CPU (one thread): both
pieces run on the same core, so the split shows what it costs, not a speed-up; on GPUs the
pieces' kernels run at once.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from shoal.scheduler.profile import BlockCost
from shoal.scheduler.tensor import per_device
from shoal.service.bench.pipeline import threads
from shoal.workers.blocks import Block
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.tensor_split import TensorBlock
from shoal.workers.zoo.data import make_data
from shoal.workers.zoo.models import build_blocks

WAYS = 2
BLOCK = 1
"""The first hidden layer: the bench model's widest block."""


def _train(
    block: Block, inputs: Sequence[Sequence[torch.Tensor]]
) -> tuple[list[float], list[float]]:
    """Each step's seconds and loss: every micro-batch's forward and backward, one update."""
    times, losses = [], []
    for micro in inputs:
        started = time.perf_counter()
        total = 0.0
        for x in micro:
            loss = block.module(x).square().mean() / len(micro)
            loss.backward()
            total += loss.item()
        block.step()
        times.append(time.perf_counter() - started)
        losses.append(total)
    return times, losses


def _state_bytes_per_device(block: TensorBlock) -> list[int]:
    """Per device of the split: its parameters' bytes and their optimizer state's."""
    held = [0] * len(block.module.devices)
    for name, param in block.module.named_parameters():
        entries = block.optimizer.state.get(param, {})
        state = sum(t.nbytes for t in entries.values() if isinstance(t, torch.Tensor) and t.dim())
        held[block.module.device_index(name)] += param.nbytes + state
    return held


def tensor_block(
    refs: tuple[ModelRef, DataRef, OptimizerConf],
    costs: Sequence[BlockCost],
    *,
    hidden: int,
    batch_size: int,
    micro_batches: int,
    steps: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """The TP 2 against TP 1 figures (module docstring)."""
    model, data, opt = refs
    meta = make_data(data, seed, ()).meta
    rows = batch_size // micro_batches
    g = torch.Generator().manual_seed(seed)
    inputs = [[torch.randn(rows, hidden, generator=g) for _ in range(micro_batches)]]
    inputs *= steps  # the same batch each step: what differs is only where it runs

    def block() -> Block:
        (module,) = build_blocks(model, meta, seed, [BLOCK])
        return Block(BLOCK, module, opt)

    with threads(1):
        split = TensorBlock(block(), [torch.device("cpu")] * WAYS)
        runs = {1: _train(block(), inputs), WAYS: _train(split, inputs)}
    held = max(_state_bytes_per_device(split))
    share = per_device([costs[BLOCK]], WAYS)[0]
    predicted = share.param_bytes + share.optim_bytes

    def rate(ways: int) -> float:
        return batch_size / statistics.median(runs[ways][0][warmup:])

    return {
        "block": BLOCK,
        "ways": WAYS,
        "parameters": costs[BLOCK].param_bytes // 4,
        "tp1_samples_per_s": rate(1),
        "tp2_samples_per_s": rate(WAYS),
        "tp2_vs_tp1": rate(WAYS) / rate(1),
        "whole_state_bytes": costs[BLOCK].param_bytes + costs[BLOCK].optim_bytes,
        "tp2_state_bytes_per_device": held,
        "predicted_tp2_state_bytes_per_device": predicted,
        "prediction_error": predicted / held - 1,
        "loss_max_rel_diff": max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs[WAYS][1], runs[1][1], strict=True)
        ),
        "devices": f"{WAYS} on this process's CPU, one thread",
    }
