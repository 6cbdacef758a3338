"""The live feed's reads over a real database: every change once, ties in time included."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from shoal.service.auth import authenticate, create_token
from shoal.service.db.models import Job
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.feed import read_changes, start_cursor
from shoal.service.jobs import add_event, add_job
from shoal.service.specs import validate_job_spec
from tests.factories import job_spec

pytestmark = pytest.mark.integration

SAME = datetime(2030, 1, 1, tzinfo=UTC)


def test_changes_come_once_each_even_when_updates_share_a_timestamp(
    session_factory: SessionFactory,
) -> None:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        who = authenticate(session, token)
        assert who is not None
        cursor = start_cursor(session)
    accepted = validate_job_spec(job_spec(), [])
    with transaction(session_factory) as session:
        first = add_job(session, who, accepted).id
    with session_factory() as session:
        changes, cursor = read_changes(session, cursor)
    assert [(c.kind, c.data["id"] if c.kind == "job" else c.data["job_id"]) for c in changes] == [
        ("job", first),
        ("event", first),
    ]
    assert all(c.owner_id == who.user_id for c in changes)
    with session_factory() as session:
        assert read_changes(session, cursor)[0] == []  # nothing new: nothing again

    # Two updates at the very same time, read between them: each still comes once.
    with transaction(session_factory) as session:
        session.execute(sa.update(Job).where(Job.id == first).values(updated_at=SAME, step=1))
    with session_factory() as session:
        changes, cursor = read_changes(session, cursor)
    assert [(c.kind, c.data["step"]) for c in changes] == [("job", 1)]
    with transaction(session_factory) as session:
        second = add_job(session, who, accepted)
        second.updated_at = SAME
        add_event(session, first, "checkpoint", "step 1")
    with session_factory() as session:
        changes, cursor = read_changes(session, cursor)
    assert sorted(
        (c.kind, c.data.get("id") if c.kind == "job" else c.data["kind"]) for c in changes
    ) == sorted([("job", second.id), ("event", "state"), ("event", "checkpoint")])
    with session_factory() as session:
        assert read_changes(session, cursor)[0] == []
