"""What changed since the last look: the live feed's reads each poll, for every viewer.

A ``Cursor`` remembers the job updates and job events a feed has sent; ``read_changes``
returns what came since — jobs whose row changed (state, step, loss, devices) and new job
events — each with its owner, so the stream shows a viewer only what is theirs.

"Since" is not "newer than the newest seen", for two reasons:

* A write stamps its job's ``updated_at`` (in Python, before it may wait for a lock) and takes
  its event's id (a PostgreSQL sequence) before it commits, so a write stamped later can commit,
  and be read, first. The feed reads ``SETTLE`` back from the newest stamps it has read and
  leaves out what it already sent, so the slower write still comes.
* Events and jobs are two reads, each seeing what was committed when it ran (PostgreSQL's
  READ COMMITTED; SQLite outside a transaction). An event commits with or after its job's row,
  so the events are read first: the jobs read after them show the row of every event read,
  and a viewer gets a job's row with or before its events, never an event without its row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.db.models import Job, JobEvent

MAX_CHANGES = 1000
"""Most events one poll reads; the rest come with the next poll."""

SETTLE = timedelta(seconds=60)
"""The longest a write may take from stamping its rows to committing them (SQLite's 30 s busy
timeout included): the feed reads this far back, and a slower write may be missed."""


@dataclass(frozen=True)
class Cursor:
    newest_update: datetime | None
    """The newest job ``updated_at`` read; None while there was no job."""
    updates_sent: Mapping[str, datetime]
    """Each job updated within ``SETTLE`` of ``newest_update``, and the update last sent."""
    event_floor: int
    """Every job event up to this id was sent, or given up on (see ``_settle``)."""
    events_sent: Mapping[int, datetime]
    """The events above ``event_floor`` that were sent, and their times."""


@dataclass(frozen=True)
class Change:
    kind: Literal["job", "event"]
    owner_id: int
    data: dict[str, Any]


def start_cursor(session: Session) -> Cursor:
    """Now: only what changes from here on, writes stamped earlier that commit later included."""
    newest = session.scalar(sa.select(sa.func.max(Job.updated_at)))
    # Rows are taken as sent before events (the reverse of a poll): a job committed between
    # the two reads then shows its row without its first event, never the event alone.
    stamps = _job_stamps(session, newest)
    # Writes in flight now may hold ids below the newest event's: the last MAX_CHANGES are
    # taken as sent, and the holes among them settled like any others.
    top = session.scalar(sa.select(sa.func.max(JobEvent.id))) or 0
    unread = Cursor(newest, {}, max(top - MAX_CHANGES, 0), {})
    events = [event for event, _ in _new_events(session, unread)]
    return _advance(unread, stamps, events)


def read_changes(session: Session, cursor: Cursor) -> tuple[list[Change], Cursor]:
    """The jobs updated and the events added since ``cursor``, and the cursor after them."""
    events = _new_events(session, cursor)  # before the jobs: see the module docstring
    stamps = _job_stamps(session, cursor.newest_update)
    jobs = _jobs(session, [i for i, at in stamps.items() if cursor.updates_sent.get(i) != at])
    stamps.update((job.id, job.updated_at) for job in jobs)  # a row may be newer than its stamp
    changes = [Change("job", job.owner_id, job_summary(job)) for job in jobs]
    changes += [Change("event", owner, event_data(event)) for event, owner in events]
    return changes, _advance(cursor, stamps, [event for event, _ in events])


def _new_events(session: Session, cursor: Cursor) -> list[tuple[JobEvent, int]]:
    """The events above the floor not sent yet, oldest first, with their jobs' owners."""
    rows = session.execute(
        sa.select(JobEvent, Job.owner_id)
        .join(Job, Job.id == JobEvent.job_id)
        .where(JobEvent.id > cursor.event_floor)
        .order_by(JobEvent.id)
        .limit(MAX_CHANGES + len(cursor.events_sent))
    )
    return [(event, owner) for event, owner in rows if event.id not in cursor.events_sent]


def _job_stamps(session: Session, newest: datetime | None) -> dict[str, datetime]:
    """The ``updated_at`` of every job updated within ``SETTLE`` of ``newest`` (None: all)."""
    query = sa.select(Job.id, Job.updated_at)
    if newest is not None:
        query = query.where(Job.updated_at > newest - SETTLE)
    return {job_id: at for job_id, at in session.execute(query)}


def _jobs(session: Session, ids: Sequence[str]) -> Sequence[Job]:
    if not ids:
        return []
    return session.scalars(
        sa.select(Job).where(Job.id.in_(ids)).order_by(Job.updated_at, Job.id)
    ).all()


def _advance(cursor: Cursor, stamps: Mapping[str, datetime], events: Sequence[JobEvent]) -> Cursor:
    """The cursor once ``stamps`` (every job in ``cursor``'s window) and ``events`` are sent."""
    stamped = [*stamps.values(), cursor.newest_update]
    newest = max((at for at in stamped if at is not None), default=None)
    sent = {i: at for i, at in stamps.items() if newest is not None and at > newest - SETTLE}
    floor, events_sent = _settle(
        cursor.event_floor, {**cursor.events_sent, **{e.id: e.time for e in events}}
    )
    return Cursor(newest, sent, floor, events_sent)


def _settle(floor: int, sent: Mapping[int, datetime]) -> tuple[int, dict[int, datetime]]:
    """Raise ``floor`` over the events sent, and over the holes below an event stamped
    ``SETTLE`` before the newest sent: an id lower than that event's was taken before it, so
    the write that holds it rolled back or is slower than ``SETTLE``; waiting on, the cursor
    would grow with every event."""
    if sent:
        settled = max(sent.values()) - SETTLE
        floor = max([floor, *(i for i, at in sent.items() if at <= settled)])
    while floor + 1 in sent:
        floor += 1
    return floor, {i: at for i, at in sent.items() if i > floor}


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
        "mfu": job.last_mfu,
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
