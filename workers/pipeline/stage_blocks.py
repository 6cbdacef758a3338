"""A stage's blocks, built on its devices: whole on one, or each block split over the
stage's tensor-parallel group (``workers.tensor_split``), the blocks without a split whole
on the group's first device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.workers.blocks import Block
from shoal.workers.pipeline.stage_types import StageSetup, torch_device
from shoal.workers.snapshot import StagePlan
from shoal.workers.tensor_split import TensorBlock, splittable
from shoal.workers.zoo.models import build_blocks


def stage_devices(plan: StagePlan) -> list[torch.device]:
    """The devices a worker for ``plan`` computes on: its own, then its tensor group's."""
    group = plan.group
    if plan.device.gpu and torch.cuda.is_available() and torch.cuda.device_count() == len(group):
        # A Ray actor sees only its group's GPUs, as 0..N-1 in the order it was given them.
        return [torch.device("cuda", k) for k in range(len(group))]
    return [torch_device(d) for d in group]


def build_stage_blocks(
    setup: StageSetup, indices: Sequence[int], devices: Sequence[torch.device]
) -> list[Block]:
    """Blocks ``indices`` of the job's model, as built for every stage (the same initial
    values wherever they are built), on ``devices``."""
    modules = build_blocks(setup.model, setup.meta, setup.seed, indices, setup.allowed)
    blocks = []
    for i, module in zip(indices, modules, strict=True):
        block = Block(i, module, setup.optimizer)
        block.to(devices[0])
        if len(devices) > 1 and splittable(module):
            block = TensorBlock(block, devices)
        blocks.append(block)
    return blocks
