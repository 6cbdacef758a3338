"""A plain single-process run of a job: the yardstick for exactness.

This is THE contract the pipeline engine must reproduce (DESIGN invariant 1); parameters
after any number of steps must equal this run's, whatever the partition, the stages, the
repartitions and the recoveries. One training step ``s`` is:

1. ``inputs, targets = data.batch(s, batch_size)``; the data cursor is the step.
2. Split the mini-batch into ``micro_batches`` micro-batches of ``mb = batch_size //
   micro_batches`` rows: micro-batch ``j`` is rows ``[j * mb, (j + 1) * mb)`` (GPipe).
3. For each micro-batch, in order: run it through all blocks, ``loss_j = loss_fn(out_j,
   targets_j) * (mb / batch_size)`` with the task's mean-reduced loss, and
   ``loss_j.backward()``: gradients accumulate, scaled so their sum is the gradient of the
   mean loss over the whole mini-batch. With ``precision="bf16"`` the blocks and the loss
   run under ``torch.autocast("cpu", dtype=torch.bfloat16)``; the backward does not.
4. After the last micro-batch, ``torch.nn.utils.clip_grad_norm_`` over every parameter of
   the model, with ``optimizer.clip_grad_norm`` as ``max_norm`` (infinite when None: for
   a finite norm, a multiplication by exactly one, so it only measures the norm).
5. Every block's optimizer steps once and drops its gradients.
6. The step's reported loss is ``sum_j loss_j.item()``; its gradient norm, the norm
   ``clip_grad_norm_`` returned (before clipping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.workers.blocks import Block
from shoal.workers.precision import autocast, autocast_dtype
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks, count_blocks


@dataclass(frozen=True)
class ReferenceResult:
    """The loss and gradient norm of every step run, and the blocks after the last one."""

    losses: list[float]
    blocks: list[Block]
    grad_norms: list[float]


def _check_shape(batch_size: int, micro_batches: int, start_step: int, steps: int) -> None:
    if micro_batches < 1 or batch_size < 1 or batch_size % micro_batches:
        raise ValueError(
            f"batch_size ({batch_size}) must be a positive multiple of micro_batches"
            f" ({micro_batches}); change one of them"
        )
    if not 0 <= start_step <= steps:
        raise ValueError(f"start_step ({start_step}) must be between 0 and steps ({steps})")


def train_reference(
    model: ModelRef,
    data: DataRef,
    optimizer: OptimizerConf,
    *,
    batch_size: int,
    micro_batches: int,
    steps: int,
    seed: int,
    allowed: Sequence[str] = (),
    start_blocks: dict[int, dict[str, Any]] | None = None,
    start_step: int = 0,
    precision: str = "fp32",
) -> ReferenceResult:
    """Train steps ``start_step .. steps - 1`` in one process, as the module docstring says.

    ``start_blocks`` (block index -> ``Block.state()``, every block) resumes a run; without
    it the blocks are freshly initialized from ``seed``.
    """
    _check_shape(batch_size, micro_batches, start_step, steps)
    source = make_data(data, seed, allowed)
    count = count_blocks(model, source.meta, allowed)
    modules = build_blocks(model, source.meta, seed, range(count), allowed)
    blocks = [Block(i, module, optimizer) for i, module in enumerate(modules)]
    if start_blocks is not None:
        if set(start_blocks) != set(range(count)):
            raise ValueError(
                f"start_blocks holds the states of blocks {sorted(start_blocks)}; the model has"
                f" blocks 0..{count - 1} and a resumed run needs every one of them"
            )
        for block in blocks:
            block.load(start_blocks[block.index])
    loss = loss_fn(source.meta.task)
    amp = autocast_dtype(precision)
    params = [p for block in blocks for p in block.module.parameters()]
    max_norm = math.inf if optimizer.clip_grad_norm is None else optimizer.clip_grad_norm
    mb = batch_size // micro_batches
    losses, norms = [], []
    for step in range(start_step, steps):
        inputs, targets = source.batch(step, batch_size)
        total = 0.0
        for j in range(micro_batches):
            with autocast(amp, inputs.device):
                out = inputs[j * mb : (j + 1) * mb]
                for block in blocks:
                    out = block.module(out)
                loss_j = loss(out, targets[j * mb : (j + 1) * mb]) * (mb / batch_size)
            loss_j.backward()  # type: ignore[no-untyped-call]
            total += loss_j.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        for block in blocks:
            block.step()
        losses.append(total)
    return ReferenceResult(losses, blocks, norms)
