"""What the control plane knows about its work, read for ``GET /metrics``: counts anyone may
see (``read_telemetry``) apart from the running jobs' own figures (``read_running``).

Every figure is bounded in cardinality: states and event kinds are fixed sets, device kinds
are the cluster's configuration, and per-job figures cover RUNNING jobs only, of which there
are never more than devices.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.db.models import DeviceRow, Job, JobEvent, JobMetric, Sweep
from shoal.service.lifecycle import JobState


@dataclass(frozen=True)
class RunningJob:
    """A RUNNING job's latest step: its loss, throughput, MFU and per-stage seconds."""

    id: str
    step: int
    steps: int
    loss: float | None
    samples_per_s: float | None
    step_time_s: float | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    mfu: float | None = None


@dataclass(frozen=True)
class Telemetry:
    jobs: dict[str, int]
    """Jobs by state (every state, zeros included)."""
    sweeps: dict[str, int]
    devices: dict[tuple[str, str], int]
    """Devices by (kind, state): state ``alive``, ``draining`` (alive, being left) or ``lost``."""
    events: dict[str, int]
    """Job events by kind since the database began (repartitions, recoveries, ...)."""


def read_telemetry(session: Session) -> Telemetry:
    """The counts, in a handful of queries: nothing in them names a job or its owner."""
    states = [s.value for s in JobState]
    jobs = dict.fromkeys(states, 0) | _count(session, Job.state)
    sweeps = dict.fromkeys(states, 0) | _count(session, Sweep.state)
    devices: Counter[tuple[str, str]] = Counter()
    for kind, state, draining, count in session.execute(
        sa.select(DeviceRow.kind, DeviceRow.state, DeviceRow.draining, sa.func.count()).group_by(
            DeviceRow.kind, DeviceRow.state, DeviceRow.draining
        )
    ):
        devices[(kind, "draining" if draining and state == "alive" else state)] += count
    events = _count(session, JobEvent.kind)
    return Telemetry(jobs=jobs, sweeps=sweeps, devices=dict(devices), events=events)


def read_running(session: Session) -> list[RunningJob]:
    """Each RUNNING job's latest figures, by job id (for scrapers trusted with them)."""
    running = session.scalars(sa.select(Job).where(Job.state == JobState.RUNNING.value)).all()
    latest = _latest_metrics(session, [j.id for j in running])
    return [
        RunningJob(
            id=job.id,
            step=job.step,
            steps=job.steps,
            loss=job.last_loss,
            samples_per_s=latest[job.id].samples_per_s if job.id in latest else None,
            step_time_s=latest[job.id].step_time_s if job.id in latest else None,
            stages=list(job.stage_times or []),
            mfu=latest[job.id].mfu if job.id in latest else None,
        )
        for job in running
    ]


def _count(session: Session, column: sa.orm.InstrumentedAttribute[str]) -> dict[str, int]:
    rows = session.execute(sa.select(column, sa.func.count()).group_by(column))
    return {value: count for value, count in rows}


def _latest_metrics(session: Session, job_ids: list[str]) -> dict[str, JobMetric]:
    if not job_ids:
        return {}
    last = (
        sa.select(JobMetric.job_id, sa.func.max(JobMetric.step).label("step"))
        .where(JobMetric.job_id.in_(job_ids))
        .group_by(JobMetric.job_id)
        .subquery()
    )
    rows = session.scalars(
        sa.select(JobMetric).join(
            last, sa.and_(JobMetric.job_id == last.c.job_id, JobMetric.step == last.c.step)
        )
    )
    return {m.job_id: m for m in rows}
