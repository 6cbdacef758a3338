"""The values a pipeline stage is built from and answers with, shared by the engines that
build stages (the pipeline's workers, the SHARP executor's shard hosts): the job's
``StageSetup``, a step's ``StepOutcome``, the torch device a ``Device`` names, and the error
of a stage driven out of order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.scheduler.devices import Device
from shoal.workers.pipeline.timing import StepClock
from shoal.workers.snapshot import DataRef, JobSnapshot, ModelRef, OptimizerConf
from shoal.workers.wire import Wire
from shoal.workers.zoo.registry import DataMeta


class StageStateError(RuntimeError):
    """A stage was driven out of order (a schedule or runner bug, never user input)."""


@dataclass(frozen=True)
class StageSetup:
    """What every stage of a job is built from; the plan says which blocks and where."""

    model: ModelRef
    meta: DataMeta
    optimizer: OptimizerConf
    seed: int
    num_blocks: int
    recompute: bool = False
    allowed: tuple[str, ...] = ()
    precision: str = "fp32"
    shard: str = "none"
    """How replicas split the stage's optimizer work (``workers.pipeline.sharding``)."""
    data: DataRef | None = None
    """What the first and last stages draw their batches from (``workers.pipeline.batch_rows``),
    ``batch_size`` rows a step."""
    batch_size: int = 0

    @classmethod
    def of(cls, snapshot: JobSnapshot, meta: DataMeta) -> StageSetup:
        return cls(
            model=snapshot.model,
            meta=meta,
            optimizer=snapshot.optimizer,
            seed=snapshot.seed,
            num_blocks=snapshot.num_blocks,
            recompute=snapshot.recompute,
            allowed=snapshot.allowed_factories,
            precision=snapshot.precision,
            shard=snapshot.shard,
            data=snapshot.data,
            batch_size=snapshot.batch_size,
        )


@dataclass(frozen=True)
class StepOutcome:
    """What one stage's ``step`` returns: the last stage's micro-batch losses (empty
    elsewhere), its gradients' norms (``workers.pipeline.clipping``), where its time went, and the
    step's wall seconds on this stage (from its call to its end, waits included)."""

    losses: tuple[float, ...]
    norms: Wire
    clock: StepClock
    seconds: float = 0.0


def torch_device(device: Device) -> torch.device:
    if device.gpu and torch.cuda.is_available():
        # A Ray actor sees only its own GPU, as index 0; a single process sees all of them.
        return torch.device("cuda", device.index % torch.cuda.device_count())
    return torch.device("cpu")
