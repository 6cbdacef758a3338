"""What changed since the last look: the live feed's one query per poll, for every viewer.

A ``Cursor`` remembers the last job event seen and the newest job update; ``read_changes``
returns what came after it — jobs whose row changed (state, step, loss, devices) and new
job events — each with its owner, so the stream shows a viewer only what is theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.models import Job, JobEvent

MAX_CHANGES = 1000
"""Most events one poll reads; the rest come with the next poll."""


@dataclass(frozen=True)
class Cursor:
    event_id: int
    """The last job event seen."""
    updated: datetime | None
    """The newest job update seen, and the jobs updated at exactly that time."""
    at_updated: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Change:
    kind: Literal["job", "event"]
    owner_id: int
    data: dict[str, Any]


def start_cursor(session: Session) -> Cursor:
    """Now: only what changes from here on."""
    event_id = session.scalar(sa.select(sa.func.max(JobEvent.id))) or 0
    updated = session.scalar(sa.select(sa.func.max(Job.updated_at)))
    ids = _updated_at(session, updated) if updated is not None else frozenset()
    return Cursor(event_id, updated, ids)


def read_changes(session: Session, cursor: Cursor) -> tuple[list[Change], Cursor]:
    """The jobs updated and the events added after ``cursor``, and the cursor after them."""
    query = sa.select(Job)
    if cursor.updated is not None:
        query = query.where(Job.updated_at >= cursor.updated)
    jobs = [
        j
        for j in session.scalars(query.order_by(Job.updated_at))
        if not (j.updated_at == cursor.updated and j.id in cursor.at_updated)
    ]
    rows = session.execute(
        sa.select(JobEvent, Job.owner_id)
        .join(Job, Job.id == JobEvent.job_id)
        .where(JobEvent.id > cursor.event_id)
        .order_by(JobEvent.id)
        .limit(MAX_CHANGES)
    ).all()
    changes = [Change("job", j.owner_id, job_summary(j)) for j in jobs]
    changes += [Change("event", owner, event_data(e)) for e, owner in rows]
    updated, at = cursor.updated, cursor.at_updated
    if jobs:
        updated = jobs[-1].updated_at
        same = {j.id for j in jobs if j.updated_at == updated}
        at = frozenset(same | (at if updated == cursor.updated else frozenset()))
    event_id = rows[-1][0].id if rows else cursor.event_id
    return changes, Cursor(event_id, updated, at)


def job_summary(job: Job) -> dict[str, Any]:
    """What a jobs table row shows."""
    return {
        "id": job.id,
        "name": job.name,
        "owner": job.owner.name,
        "state": job.state,
        "step": job.step,
        "steps": job.steps,
        "last_loss": job.last_loss,
        "samples_per_s": job.last_samples_per_s,
        "devices": list(job.devices),
        "error": job.error,
        "created_at": job.created_at.isoformat(),
        "updated_at": job.updated_at.isoformat(),
    }


def event_data(event: JobEvent) -> dict[str, Any]:
    return {
        "id": event.id,
        "job_id": event.job_id,
        "time": event.time.isoformat(),
        "kind": event.kind,
        "message": event.message,
        "data": event.data,
    }


def _updated_at(session: Session, updated: datetime) -> frozenset[str]:
    return frozenset(session.scalars(sa.select(Job.id).where(Job.updated_at == updated)))
