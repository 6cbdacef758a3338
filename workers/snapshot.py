"""Plain, frozen snapshots exchanged between the control plane and the actors.

The controller turns a validated JobSpec and a placement into a ``JobSnapshot`` and hands it
to the runner; the runner answers ``poll`` with a ``RunnerReport``. Nothing here is an ORM
object or a pydantic model, so actors never touch the database or the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from scheduler.devices import Device
from scheduler.types import BlockRange, JobId


@dataclass(frozen=True)
class ModelRef:
    """A built-in model (``builtin``) or an allowed factory ``pkg.mod:fn`` and its config."""

    builtin: str | None
    factory: str | None
    config: dict[str, Any]


@dataclass(frozen=True)
class DataRef:
    builtin: str | None
    factory: str | None
    config: dict[str, Any]


@dataclass(frozen=True)
class OptimizerConf:
    """``name`` is sgd, adam or adamw; ``params`` are its keyword arguments besides ``lr``."""

    name: str
    lr: float
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous block range on one device."""

    index: int
    blocks: BlockRange
    device: Device


@dataclass(frozen=True)
class JobSnapshot:
    """Everything a runner needs to train a job, and nothing that needs the control plane."""

    job_id: JobId
    attempt: int
    model: ModelRef
    data: DataRef
    optimizer: OptimizerConf
    batch_size: int
    micro_batches: int
    steps: int
    seed: int
    schedule: str  # "gpipe" | "1f1b"
    recompute: bool
    stages: tuple[StagePlan, ...]
    num_blocks: int
    checkpoint_root: str
    checkpoint_every: int
    checkpoint_keep: int
    allowed_factories: tuple[str, ...] = ()


class RunStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self is not RunStatus.RUNNING


@dataclass(frozen=True)
class StageTiming:
    """Seconds one stage spent computing and waiting in one step."""

    stage: int
    device_id: str
    compute_s: float
    idle_s: float


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    samples_per_s: float
    step_time_s: float
    stages: tuple[StageTiming, ...]


@dataclass(frozen=True)
class RunnerEvent:
    """Something the runner did: ``kind`` is placement, checkpoint, resumed, device_speed, ..."""

    kind: str
    step: int
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerReport:
    """The answer to ``poll(cursor)``: what happened since the cursor, and the run's status."""

    status: RunStatus
    cursor: int
    step: int
    metrics: tuple[StepMetrics, ...]
    events: tuple[RunnerEvent, ...]
    error: str | None = None
