"""Which devices are taken: by active jobs, by sweeps' SHARP executors, or being drained."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.models import DeviceRow, Job, Sweep
from service.lifecycle import JobState

ACTIVE_JOBS = (JobState.RUNNING.value, JobState.RECOVERING.value)
ACTIVE_SWEEPS = (JobState.QUEUED.value, JobState.RUNNING.value)


def held_devices(session: Session, *, exclude: str | None = None) -> set[str]:
    """Devices held by active jobs (other than ``exclude``) and by active sweeps' executors."""
    query = sa.select(Job.devices).where(Job.state.in_(ACTIVE_JOBS))
    if exclude is not None:
        query = query.where(Job.id != exclude)
    held = {d for devs in session.scalars(query) for d in devs}
    pools = sa.select(Sweep.devices).where(Sweep.state.in_(ACTIVE_SWEEPS))
    return held | {d for devs in session.scalars(pools) for d in devs}


def draining_devices(session: Session) -> set[str]:
    return set(session.scalars(sa.select(DeviceRow.id).where(DeviceRow.draining)))
