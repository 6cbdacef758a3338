"""Plain, frozen snapshots exchanged between the control plane and the actors.

The controller turns a validated JobSpec and a placement into a ``JobSnapshot`` and hands it
to the runner; the runner answers ``poll`` with a ``RunnerReport``. Nothing here is an ORM
object or a pydantic model, so actors never touch the database or the settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shoal.scheduler.copies import DEFAULT_BUDGET
from shoal.scheduler.devices import Device
from shoal.scheduler.elastic import ElasticConfig
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.types import BlockRange, JobId
from shoal.scheduler.workload import Workload
from shoal.workers.uploaded_code import JobCode


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
    """``name`` is sgd, adam or adamw; ``params`` are its keyword arguments besides ``lr``.
    ``clip_grad_norm`` clips the L2 norm of the whole model's gradient before every step
    (``workers.pipeline.clipping``); None: no clipping."""

    name: str
    lr: float
    params: dict[str, Any] = field(default_factory=dict)
    clip_grad_norm: float | None = None


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (or one data-parallel replica of it): a contiguous block range on
    one device. Replicas of a stage share ``index`` and ``blocks``; ``replica`` tells them
    apart."""

    index: int
    blocks: BlockRange
    device: Device
    replica: int = 0
    tensor_devices: tuple[Device, ...] = ()
    """The other devices of the stage's tensor-parallel group, on ``device``'s node: each
    block is split over ``device`` and these (``workers.tensor_split``)."""

    @property
    def group(self) -> tuple[Device, ...]:
        """Every device the stage holds: ``device``, then its tensor group's others."""
        return (self.device, *self.tensor_devices)


def stage_plans(
    devices: Sequence[Device], ranges: Sequence[BlockRange], tensor: int = 1
) -> tuple[StagePlan, ...]:
    """Replica-major plans: ``devices[r * p + s]`` runs stage s (``ranges[s]``) of replica r;
    with ``tensor`` N, ``devices[(r * p + s) * N :][:N]`` is that stage's tensor group."""
    depth = len(ranges)
    groups = [devices[i : i + tensor] for i in range(0, len(devices), tensor)]
    return tuple(
        StagePlan(
            index=i % depth,
            blocks=ranges[i % depth],
            device=group[0],
            replica=i // depth,
            tensor_devices=tuple(group[1:]),
        )
        for i, group in enumerate(groups)
    )


def partition_rows(plans: Sequence[StagePlan]) -> list[dict[str, Any]]:
    """The partition as the job row and the API keep it: stage, replica, device and blocks
    per worker, and the rest of its tensor group (none: empty)."""
    return [
        {
            "stage": p.index,
            "replica": p.replica,
            "device_id": p.device.id,
            "blocks": list(p.blocks),
            "tensor_devices": [d.id for d in p.tensor_devices],
        }
        for p in plans
    ]


def row_devices(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every device a partition's rows hold: each worker's, then its tensor group's."""
    return [i for row in rows for i in (row["device_id"], *row.get("tensor_devices", ()))]


def split_micro_batches(micro_batches: int, replicas: int) -> tuple[int, ...]:
    """The default split of a mini-batch's micro-batches over replicas: equal shares, the
    remainder to the first replicas (``split_micro_batches(5, 2) == (3, 2)``)."""
    if replicas < 1 or micro_batches < replicas:
        raise ValueError(
            f"{micro_batches} micro-batches cannot be split over {replicas} replicas; every"
            " replica needs at least one (raise micro_batches or lower replicas)"
        )
    share, rest = divmod(micro_batches, replicas)
    return tuple(share + (1 if r < rest else 0) for r in range(replicas))


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
    code: JobCode | None = None
    """The job's uploaded code: its runner and workers run with it (``workers.uploaded_code``)."""
    replicas: int = 1
    replica_micro_batches: tuple[int, ...] = ()
    """Micro-batches per replica, summing to ``micro_batches`` (a faster device may take
    more); empty means ``split_micro_batches``. Replica r trains the consecutive micro-batches
    after those of replicas 0..r-1."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: forward and loss under bfloat16 autocast (``workers.precision``)."""
    shard: str = "none"
    """``none``, or how the replicas of a stage split its optimizer state (``optimizer``),
    summed gradients too (``gradients``) and parameters too (``full``):
    ``workers.pipeline.sharding``."""
    block_costs: tuple[BlockCost, ...] = ()
    """Each block's cost (``scheduler.profile``): what the elastic policy weighs measured
    times against; empty means equal blocks."""
    elastic: ElasticConfig | None = None
    """Runtime repartitioning (``scheduler.elastic``); None: the layout never changes."""
    keep_copies: bool = False
    """Keep every worker's state of the last steps in host memory on another node, so that
    a lost device is recovered in the runner (``workers.pipeline.recovery``)."""
    copy_budget: float = DEFAULT_BUDGET
    """The most of the training time those copies may cost (``scheduler.copies``)."""
    min_devices: int = 1
    """The fewest devices the job may run on (a recovery with fewer gives the job back)."""

    @property
    def tensor(self) -> int:
        """Devices per stage (``parallelism.tensor``): its plans' tensor groups' size."""
        return 1 + len(self.stages[0].tensor_devices) if self.stages else 1

    def workload(self) -> Workload:
        """How a mini-batch of this job runs, as the partitioner plans it."""
        return Workload(
            micro_batches=self.micro_batches,
            micro_batch_size=self.batch_size // self.micro_batches,
            schedule=self.schedule,
            recompute=self.recompute,
            precision=self.precision,
            shard=self.shard,
            tensor=self.tensor,
        )

    def micro_batch_split(self) -> tuple[int, ...]:
        """Micro-batches per replica, checked (``full``: the same for every replica, whose
        gathers go in lockstep, ``workers.pipeline.gathering``)."""
        split = self.replica_micro_batches or split_micro_batches(self.micro_batches, self.replicas)
        if len(split) != self.replicas or sum(split) != self.micro_batches or min(split) < 1:
            raise ValueError(
                f"replica_micro_batches {list(split)} must give each of the {self.replicas}"
                f" replicas at least one micro-batch and sum to {self.micro_batches}"
            )
        if self.shard == "full" and len(set(split)) > 1:
            raise ValueError(
                f"shard full runs every replica in lockstep: micro-batches per replica"
                f" {list(split)} must be equal (micro_batches a multiple of replicas)"
            )
        return split


class RunStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    """A stage's device (or its worker) is gone: the job can resume elsewhere."""
    SUSPENDED = "suspended"
    """Stopped on request at a step boundary, that step checkpointed: the job resumes from
    it elsewhere with no step replayed (a drain it could not move away from)."""

    @property
    def is_final(self) -> bool:
        return self is not RunStatus.RUNNING


@dataclass(frozen=True)
class StageTiming:
    """Seconds one stage (replica) spent in one step computing, all-reducing gradients,
    moving activations and gradients (``transfer_s``), and waiting (``idle_s``: the rest)."""

    stage: int
    device_id: str
    compute_s: float
    idle_s: float
    replica: int = 0
    allreduce_s: float = 0.0
    transfer_s: float = 0.0
    copy_s: float = 0.0
    """Seconds its in-memory copies (``workers.pipeline.recovery``) took just before this step."""
    tensor_devices: tuple[str, ...] = ()
    """The rest of the stage's tensor-parallel group (``StagePlan.tensor_devices``)."""


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    samples_per_s: float
    step_time_s: float
    stages: tuple[StageTiming, ...]
    grad_norm: float | None = None
    """The L2 norm of the mini-batch gradient over the whole model, before any clipping."""


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
    lost_devices: tuple[str, ...] = ()
    """With ``LOST``: the devices whose workers are gone."""
