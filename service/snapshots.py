"""Turns job rows into the plain inputs of the scheduler (requests) and of runners (snapshots)."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.scheduler.devices import Device
from shoal.scheduler.elastic import ElasticConfig
from shoal.scheduler.placement import JobRequest
from shoal.scheduler.profile import BlockCost, uniform_costs
from shoal.scheduler.types import BlockRange
from shoal.service.db.models import Job
from shoal.service.specs import JobSpec
from shoal.workers.snapshot import DataRef, JobSnapshot, ModelRef, OptimizerConf, stage_plans
from shoal.workers.uploaded_code import JobCode


def build_snapshot(
    job: Job,
    devices: Sequence[Device],
    ranges: Sequence[BlockRange],
    *,
    checkpoint_root: str,
    allowed_factories: Sequence[str],
    replicas: int = 1,
    replica_micro_batches: Sequence[int] = (),
    transfer_bytes_per_s: float = 0.7e9,
    code: JobCode | None = None,
    shard: str | None = None,
) -> JobSnapshot:
    """The runner's snapshot; ``devices`` are replica-major (``devices[r * p + s]`` runs stage
    s of replica r) and ``ranges`` are the p stages' block ranges; ``code``: the job's
    uploaded code; ``shard``: how the layout's replicas split their state (None: as the
    spec says, ``auto`` then meaning whole)."""
    spec = JobSpec.model_validate(job.spec)
    depth, tensor = len(ranges), spec.parallelism.tensor
    if len(devices) != depth * replicas * tensor:
        raise ValueError(
            f"{len(devices)} devices for {depth} stages x {replicas} replicas x {tensor}"
            " devices each; a placement bug"
        )
    return JobSnapshot(
        job_id=job.id,
        attempt=job.attempt,
        model=ModelRef(spec.model.builtin, spec.model.factory, dict(spec.model.config)),
        data=DataRef(spec.data.builtin, spec.data.factory, dict(spec.data.config)),
        optimizer=OptimizerConf(
            spec.optimizer.name,
            spec.optimizer.lr,
            spec.optimizer.params(),
            clip_grad_norm=spec.optimizer.clip_grad_norm,
        ),
        batch_size=spec.batch_size,
        micro_batches=spec.micro_batches,
        steps=spec.steps,
        seed=spec.seed,
        schedule=spec.parallelism.schedule,
        recompute=spec.parallelism.recompute,
        precision=spec.precision,
        shard=shard or ("none" if spec.parallelism.shard == "auto" else spec.parallelism.shard),
        stages=stage_plans(devices, ranges, tensor),
        replicas=replicas,
        replica_micro_batches=tuple(replica_micro_batches),
        num_blocks=job.num_blocks,
        checkpoint_root=checkpoint_root,
        checkpoint_every=spec.checkpoint.every_steps,
        checkpoint_keep=spec.checkpoint.keep,
        allowed_factories=tuple(allowed_factories),
        code=code,
        block_costs=block_costs(job),
        keep_copies=spec.elastic.keep_copies,
        copy_budget=spec.elastic.copy_budget,
        min_devices=spec.resources.min_devices,
        elastic=(
            ElasticConfig(
                window_steps=spec.elastic.check_every_steps,
                min_gain=spec.elastic.min_gain,
                horizon_steps=spec.elastic.horizon_steps,
                transfer_bytes_per_s=transfer_bytes_per_s,
            )
            if spec.elastic.repartition
            else None
        ),
    )


def job_request(job: Job) -> JobRequest:
    spec = JobSpec.model_validate(job.spec)
    stages, replicas = spec.parallelism.stages, spec.parallelism.replicas
    return JobRequest(
        job_id=job.id,
        priority=job.priority,
        min_devices=spec.resources.min_devices,
        max_devices=spec.resources.max_devices,
        stages=stages if isinstance(stages, int) else None,
        num_blocks=job.num_blocks,
        device_kind=spec.resources.device_kind,
        spot_ok=spec.resources.spot_ok,
        replicas=replicas if isinstance(replicas, int) else None,
        owner=job.owner.name,
        tensor=spec.parallelism.tensor,
    )


def block_costs(job: Job) -> tuple[BlockCost, ...]:
    """The job's traced block costs, or equal ones when its model did not trace."""
    if job.block_costs is None:
        return uniform_costs(job.num_blocks)
    return tuple(BlockCost(**cost) for cost in job.block_costs)
