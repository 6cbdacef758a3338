"""What a runner reports, stored: metrics, events, checkpoints, the partition and devices it
moved to, and the job's progress; the control plane is the only database writer, and the
controller calls these once per poll of a job's runner."""

from __future__ import annotations

from dataclasses import asdict

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.db.models import Checkpoint, DeviceRow, Job, JobMetric
from shoal.service.holdings import drain
from shoal.service.jobs import add_event, transition
from shoal.service.lifecycle import JobState
from shoal.service.utilization import step_mfus
from shoal.workers.snapshot import RunnerReport, RunStatus, row_devices


def persist_report(session: Session, job: Job, report: RunnerReport) -> None:
    """Store what the runner reported since the job's cursor, and advance the cursor."""
    # Events first: a device's speed measured in this report counts in its steps' MFU.
    for event in report.events:
        data = {"step": event.step, **event.data}
        if event.kind == "resumed":
            # job.step is still the progress before this report: what the resume repeats.
            data["steps_replayed"] = max(0, job.step - event.step)
        add_event(session, job.id, event.kind, event.message, data)
        if event.kind == "checkpoint":
            _record_checkpoint(session, job.id, event.step, event.data)
        elif event.kind == "repartition":
            job.partition = list(event.data["to"])
        elif event.kind in ("relayout", "recovered"):
            job.partition = list(event.data["to"])
            job.devices = row_devices(event.data["to"])
        elif event.kind == "device_speed" and "device_id" in event.data:
            row = session.get(DeviceRow, event.data["device_id"])
            if row is not None:
                row.speed_gflops = float(event.data.get("gflops", 0.0))
        elif event.kind == "device_set_aside" and "device_id" in event.data:
            # A worker that fails on a device (a failing GPU) would fail the next job there too.
            row = session.get(DeviceRow, event.data["device_id"])
            if row is not None:
                drain(row, event.message)
        elif event.kind == "device_memory" and "device_id" in event.data:
            row = session.get(DeviceRow, event.data["device_id"])
            if row is not None:
                row.overhead_mb = -(-int(event.data.get("overhead_bytes", 0)) // 2**20)
    if report.metrics:
        first = min(m.step for m in report.metrics)
        # A resumed run replays the steps after its checkpoint: newer numbers replace older.
        session.execute(
            sa.delete(JobMetric).where(JobMetric.job_id == job.id, JobMetric.step >= first)
        )
        by_step = {m.step: m for m in report.metrics}  # a step replayed in the batch: its rerun
        mfus = dict(zip(by_step, step_mfus(session, job, list(by_step.values())), strict=True))
        for m in by_step.values():
            session.add(
                JobMetric(
                    job_id=job.id,
                    step=m.step,
                    loss=m.loss,
                    samples_per_s=m.samples_per_s,
                    step_time_s=m.step_time_s,
                    stages=[asdict(s) for s in m.stages],
                    grad_norm=m.grad_norm,
                    mfu=mfus[m.step],
                )
            )
        job.last_loss = report.metrics[-1].loss
        job.last_samples_per_s = report.metrics[-1].samples_per_s
        job.last_mfu = mfus[report.metrics[-1].step]
        job.stage_times = [asdict(s) for s in report.metrics[-1].stages]
    if report.metrics or report.status is RunStatus.SUCCEEDED:
        # Not otherwise: a new attempt reports step 0 until it has restored.
        job.step = report.step
    job.runner_cursor = report.cursor


def _record_checkpoint(session: Session, job_id: str, step: int, data: dict[str, object]) -> None:
    session.merge(
        Checkpoint(
            job_id=job_id,
            step=step,
            path=str(data.get("path", "")),
            nbytes=int(str(data.get("bytes", 0))),
        )
    )
    deleted = data.get("deleted") or []
    if isinstance(deleted, list) and deleted:
        session.execute(
            sa.delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.in_(deleted))
        )


def follow_recovery(session: Session, job: Job, report: RunnerReport) -> None:
    """A runner that recovers in place reports ``device_lost`` then ``recovered``: the job
    is RECOVERING in between."""
    for event in report.events:
        if event.kind == "device_lost" and job.state == JobState.RUNNING.value:
            transition(session, job, JobState.RECOVERING, event.message)
        elif event.kind == "recovered" and job.state == JobState.RECOVERING.value:
            transition(session, job, JobState.RUNNING, f"recovered in place: {event.message}")
