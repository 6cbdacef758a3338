"""Which devices are taken: by active jobs, by sweeps' SHARP executors, or being drained; what
each user holds against their quota; and the highest priority each may give a job."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.scheduler.placement import Quota, Usage
from shoal.service.auth import Principal
from shoal.service.db.models import DeviceRow, Job, Sweep, User
from shoal.service.lifecycle import JobState
from shoal.service.spec_errors import SpecError
from shoal.service.specs import JobSpec

ACTIVE_JOBS = (JobState.RUNNING.value, JobState.RECOVERING.value)
ACTIVE_SWEEPS = (JobState.QUEUED.value, JobState.RUNNING.value)
DEFAULT_PRIORITY: int = JobSpec.model_fields["priority"].default
DRAIN_REASON_CHARS = 500
"""The most of a drain's reason kept (the column's width)."""


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


def drain(row: DeviceRow, reason: str) -> None:
    """Mark the device draining, saying why; one already draining keeps the reason that
    began it."""
    if not row.draining:
        row.draining = True
        row.drain_reason = reason[:DRAIN_REASON_CHARS]


def undrain(row: DeviceRow) -> None:
    row.draining = False
    row.drain_reason = None


def usage_by_owner(session: Session) -> dict[str, Usage]:
    """Per user: the jobs they run (a sweep's trials run on its devices and count as the
    sweep, once it has devices) and the devices those jobs and their sweeps hold."""
    usage: dict[str, Usage] = {}
    jobs = session.execute(
        sa.select(User.name, Job.devices)
        .join(User, User.id == Job.owner_id)
        .where(Job.state.in_(ACTIVE_JOBS), Job.pool.is_(None))
    )
    sweeps = session.execute(
        sa.select(User.name, Sweep.devices)
        .join(User, User.id == Sweep.owner_id)
        .where(Sweep.state.in_(ACTIVE_SWEEPS))
    )
    for name, devices in [*jobs, *(s for s in sweeps if s.devices)]:
        held = usage.setdefault(name, Usage())
        held.jobs, held.devices = held.jobs + 1, held.devices + len(devices)
    return usage


def quotas(session: Session, default: Quota) -> dict[str, Quota]:
    """Each user's quota: their own limits where an admin set them, else ``default``'s."""
    return {
        user.name: Quota(
            user.max_jobs if user.max_jobs is not None else default.max_jobs,
            user.max_devices if user.max_devices is not None else default.max_devices,
        )
        for user in session.scalars(sa.select(User))
    }


def max_priority(user: User) -> int | None:
    """The highest priority ``user`` may give a job: any (None) for an admin; else what an
    admin granted them, or the default priority. Priority preempts other users' jobs, so
    more than the default is an admin's grant, like a quota."""
    if user.is_admin:
        return None
    return DEFAULT_PRIORITY if user.max_priority is None else user.max_priority


def check_priority(
    session: Session, principal: Principal, wanted: Sequence[tuple[str, int]]
) -> None:
    """Refuse, naming each field, the (field, priority) pairs of a submission above what
    ``principal`` may give a job."""
    if principal.is_admin:
        return
    user = session.get(User, principal.user_id)
    allowed = DEFAULT_PRIORITY if user is None else max_priority(user)
    if allowed is None:
        return
    over = [(field, priority) for field, priority in wanted if priority > allowed]
    if over:
        raise SpecError(
            [
                (
                    field,
                    f"priority {priority} is above your max_priority ({allowed}); use"
                    f" {allowed} or less, or ask an admin to raise your max_priority",
                )
                for field, priority in over
            ]
        )
