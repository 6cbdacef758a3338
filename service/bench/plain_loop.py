"""The plain PyTorch loop the step benches measure against: the ``workers.reference`` step
exactly, in this process on one device, micro-batches summed into the gradient, the loss
read once per step, the gradient norm measured, every block's optimizer stepped."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shoal.service.bench.step_settings import StepSettings
from shoal.workers.blocks import Block
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks


def refs(s: StepSettings) -> tuple[ModelRef, DataRef, OptimizerConf]:
    model = ModelRef(s.model, None, dict(s.shape.model))
    data = DataRef(s.dataset, None, dict(s.shape.data))
    return model, data, OptimizerConf(s.optimizer, s.lr)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA clock read before it would time launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """``s``'s model on ``s.device``, stepped as the reference steps it."""

    def __init__(self, s: StepSettings) -> None:
        model, data, opt = refs(s)
        self._source = make_data(data, s.seed)
        modules = build_blocks(model, self._source.meta, s.seed, range(s.num_blocks))
        self.device = torch.device(s.device)
        self.blocks = [Block(i, m, opt) for i, m in enumerate(modules)]
        for block in self.blocks:
            block.to(self.device)
        self._params = [p for block in self.blocks for p in block.module.parameters()]
        self._loss = loss_fn(self._source.meta.task)
        self._batch, self._micro_batches = s.shape.batch, s.shape.micro_batches

    def step(self, step: int, guard: Callable[[int], None] | None = None) -> float:
        """Train on batch ``step``; its loss. ``guard(i)`` runs before block ``i``'s optimizer
        step (where an in-memory copy orders the block's change after itself)."""
        device, batch = self.device, self._batch
        rows = batch // self._micro_batches
        inputs, targets = self._source.batch(step, batch)
        inputs, targets = inputs.to(device), targets.to(device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(self._micro_batches):
            out = inputs[j * rows : (j + 1) * rows]
            for block in self.blocks:
                out = block.module(out)
            part = self._loss(out, targets[j * rows : (j + 1) * rows]) * (rows / batch)
            part.backward()  # type: ignore[no-untyped-call]
            total += part.detach().double()  # read once per step: a read syncs a GPU
        torch.nn.utils.clip_grad_norm_(self._params, math.inf)
        for block in self.blocks:
            if guard is not None:
                guard(block.index)
            block.step()
        return float(total)
