"""Response models of the REST API (requests are ``service.specs.JobSpec`` and
``service.sweepspec.SweepSpec``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, Field

from shoal.service.db.models import Checkpoint, DeviceRow, JobEvent, JobMetric, Sweep, Trial
from shoal.service.layouts import PipelineSchedule
from shoal.service.lifecycle import JobState
from shoal.service.sweeps import PRUNED, ranked, trial_state


class StageOut(BaseModel):
    stage: int
    replica: int = 0  # data-parallel replica; jobs placed before replicas existed have none
    device_id: str
    blocks: tuple[int, int]
    tensor_devices: list[str] = []
    """The rest of the stage's tensor-parallel group (``parallelism.tensor``), on one node."""


class StageTimingOut(BaseModel):
    stage: int
    replica: int = 0
    device_id: str
    compute_s: float
    idle_s: float
    allreduce_s: float = 0.0
    transfer_s: float = 0.0
    copy_s: float = 0.0
    tensor_devices: list[str] = []
    """The rest of the stage's tensor-parallel group, beside ``device_id``."""


class JobOut(BaseModel):
    id: str
    name: str
    owner: str
    state: str
    step: int
    steps: int
    last_loss: float | None
    samples_per_s: float | None = Field(description="the latest step's throughput")
    mfu: float | None = Field(
        default=None,
        description="the latest step's model FLOPs utilization: the model's FLOPs over its"
        " devices' peak; None where a device's peak or the model's FLOPs are unknown",
    )
    devices: list[str]
    partition: list[StageOut]
    stage_times: list[StageTimingOut] | None  # the latest step's; None before the first
    error: str | None
    cancel_requested: bool
    attempt: int
    priority: int
    num_blocks: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]

    @classmethod
    def of(cls, job: sa.Row[Any]) -> JobOut:
        """From a row of ``jobs.show_job`` or ``jobs.list_jobs``."""
        return cls(
            id=job.id,
            name=job.name,
            owner=job.owner_name,
            state=job.state,
            step=job.step,
            steps=job.steps,
            last_loss=job.last_loss,
            samples_per_s=job.last_samples_per_s,
            mfu=job.last_mfu,
            devices=list(job.devices),
            partition=[StageOut.model_validate(p) for p in job.partition],
            stage_times=(
                None
                if job.stage_times is None
                else [StageTimingOut.model_validate(s) for s in job.stage_times]
            ),
            error=job.error,
            cancel_requested=job.cancel_requested,
            attempt=job.attempt,
            priority=job.priority,
            num_blocks=job.num_blocks,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            spec=job.spec,
        )


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class MetricOut(BaseModel):
    step: int
    time: datetime
    loss: float
    samples_per_s: float
    step_time_s: float
    stages: list[StageTimingOut]
    grad_norm: float | None = Field(
        default=None, description="the L2 norm of the step's whole-model gradient, before clipping"
    )
    mfu: float | None = Field(
        default=None,
        description="model FLOPs utilization: the step's traced model FLOPs over its seconds"
        " times its devices' peak FLOP/s; None where unknown",
    )

    @classmethod
    def of(cls, row: JobMetric) -> MetricOut:
        return cls(
            step=row.step,
            time=row.time,
            loss=row.loss,
            samples_per_s=row.samples_per_s,
            step_time_s=row.step_time_s,
            stages=[StageTimingOut.model_validate(s) for s in row.stages],
            grad_norm=row.grad_norm,
            mfu=row.mfu,
        )


class MetricList(BaseModel):
    items: list[MetricOut]


class EventOut(BaseModel):
    id: int
    time: datetime
    kind: str
    message: str
    data: dict[str, Any]

    @classmethod
    def of(cls, row: JobEvent) -> EventOut:
        return cls(id=row.id, time=row.time, kind=row.kind, message=row.message, data=row.data)


class EventList(BaseModel):
    items: list[EventOut]


class CheckpointOut(BaseModel):
    step: int
    name: str = Field(
        description="its directory under the job's in the checkpoint store (step-00000042);"
        " where the store is on the server is not told"
    )
    nbytes: int
    created_at: datetime

    @classmethod
    def of(cls, row: Checkpoint) -> CheckpointOut:
        name = PurePosixPath(row.path).name
        return cls(step=row.step, name=name, nbytes=row.nbytes, created_at=row.created_at)


class CheckpointList(BaseModel):
    items: list[CheckpointOut]


class DeviceOut(BaseModel):
    id: str
    node_id: str
    kind: str
    memory_mb: int
    gpu: bool
    spot: bool
    state: str
    speed_gflops: float | None
    overhead_mb: int | None = Field(
        default=None,
        description="what the device held for a worker before its stage (CUDA context,"
        " kernels, library workspaces), as the last worker on it measured; stages are planned"
        " in memory_mb less this. None until measured (CPU devices: never)",
    )
    job_id: str | None
    draining: bool = False
    drain_reason: str | None = Field(
        default=None,
        description="why it is draining: an admin drained it, its node had a preemption"
        " notice, or a worker failed on it (set aside by a sweep's executor); None if not",
    )
    memory_used_bytes: int | None = Field(
        default=None,
        description="what the stage placed on it is planned to hold at its peak (parameters,"
        " gradients, optimizer state, activations); None when nothing is placed there",
    )

    @classmethod
    def of(cls, row: DeviceRow, memory_used_bytes: int | None = None) -> DeviceOut:
        return cls(
            id=row.id,
            node_id=row.node_id,
            kind=row.kind,
            memory_mb=row.memory_mb,
            gpu=row.gpu,
            spot=row.spot,
            state=row.state,
            speed_gflops=row.speed_gflops,
            overhead_mb=row.overhead_mb,
            job_id=row.job_id,
            draining=row.draining,
            drain_reason=row.drain_reason,
            memory_used_bytes=memory_used_bytes,
        )


class ScheduleOut(BaseModel):
    """A job's pipeline schedule as its stages run it each mini-batch."""

    name: Literal["gpipe", "1f1b"]
    stages: int
    micro_batches: int = Field(description="per replica (the first replica's share)")
    grid: list[list[str | None]] = Field(
        description="one row per stage, one cell per time slot: F3 / B1, null when idle"
    )
    bubble: float = Field(description="the idle share of the stages' time slots")

    @classmethod
    def of(cls, schedule: PipelineSchedule) -> ScheduleOut:
        return cls(
            name=schedule.name,
            stages=schedule.stages,
            micro_batches=schedule.micro_batches,
            grid=[[None if a is None else str(a) for a in row] for row in schedule.timeline],
            bubble=schedule.bubble,
        )


class DeviceList(BaseModel):
    items: list[DeviceOut]


class IntermediateOut(BaseModel):
    step: int
    value: float


class TrialOut(BaseModel):
    number: int
    job_id: str
    state: str = Field(description="its job's state, or PRUNED once early stopping ended it")
    params: dict[str, Any]
    objective: float | None = Field(description="the final objective of a completed trial")
    intermediate: list[IntermediateOut] = Field(
        description="the objective as reported to the pruner, by step"
    )
    checkpoints_kept: bool = Field(
        description="false once retention deleted its checkpoints (not among the best)"
    )

    @classmethod
    def of(cls, trial: Trial) -> TrialOut:
        steps = sorted((int(step), float(value)) for step, value in trial.intermediate.items())
        return cls(
            number=trial.number,
            job_id=trial.job_id,
            state=trial_state(trial),
            params=trial.params,
            objective=trial.objective,
            intermediate=[IntermediateOut(step=s, value=v) for s, v in steps],
            checkpoints_kept=not trial.checkpoints_dropped,
        )


class ObjectiveOut(BaseModel):
    metric: str
    direction: Literal["minimize", "maximize"]


TRIAL_STATES = (*(s.value for s in JobState), PRUNED)


def _sweep_fields(sweep: Sweep, trials: Sequence[Trial]) -> dict[str, Any]:
    objective = ObjectiveOut.model_validate(sweep.spec["objective"])
    counts = dict.fromkeys(TRIAL_STATES, 0)
    for trial in trials:
        state = trial_state(trial)
        counts[state] = counts.get(state, 0) + 1
    best = ranked(trials, objective.direction)
    return {
        "id": sweep.id,
        "name": sweep.name,
        "owner": sweep.owner.name,
        "state": sweep.state,
        "cancel_requested": sweep.cancel_requested,
        "max_trials": sweep.max_trials,
        "error": sweep.error,
        "created_at": sweep.created_at,
        "updated_at": sweep.updated_at,
        "finished_at": sweep.finished_at,
        "objective": objective,
        "trial_counts": counts,
        "best": TrialOut.of(best[0]) if best else None,
    }


class SweepSummaryOut(BaseModel):
    """A sweep as listed: its state and progress, without its spec and trials."""

    id: str
    name: str
    owner: str
    state: str
    cancel_requested: bool
    max_trials: int = Field(description="how many trials it runs (fewer for a small grid)")
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    objective: ObjectiveOut
    trial_counts: dict[str, int] = Field(
        description="started trials by state (the job states and PRUNED), zeros included"
    )
    best: TrialOut | None = Field(description="the best completed trial; None before one ends")

    @classmethod
    def of(cls, sweep: Sweep, trials: Sequence[Trial]) -> SweepSummaryOut:
        return cls(**_sweep_fields(sweep, trials))


class SweepOut(SweepSummaryOut):
    """One sweep in full: its spec and every trial started so far, by number."""

    spec: dict[str, Any]
    trials: list[TrialOut]

    @classmethod
    def of(cls, sweep: Sweep, trials: Sequence[Trial]) -> SweepOut:
        shown = [TrialOut.of(t) for t in trials]
        return cls(**_sweep_fields(sweep, trials), spec=sweep.spec, trials=shown)


class SweepPage(BaseModel):
    items: list[SweepSummaryOut]
    total: int
    limit: int
    offset: int


class FieldError(BaseModel):
    field: str
    message: str


class ErrorOut(BaseModel):
    detail: str
    errors: list[FieldError] = []


class ReadyOut(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, str] = Field(
        description="the database's and (where one runs) the controller's: ok, or why not"
    )
