"""The live feed against writes that commit while it reads, or in another order than they were
stamped in: a viewer gets a job's row with or before its events, and every change once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.auth import Principal, authenticate, create_token
from shoal.service.db.models import JobEvent, utcnow
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.feed import SETTLE, Change, Cursor, read_changes, start_cursor
from shoal.service.jobs import add_event, add_job
from shoal.service.specs import AcceptedSpec, validate_job_spec
from tests.factories import job_spec

pytestmark = pytest.mark.integration


@pytest.fixture
def alice(session_factory: SessionFactory) -> Principal:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        who = authenticate(session, token)
    assert who is not None
    return who


@pytest.fixture
def accepted() -> AcceptedSpec:
    return validate_job_spec(job_spec(), [])


def _start(factory: SessionFactory) -> Cursor:
    with factory() as session:
        return start_cursor(session)


def _read(factory: SessionFactory, cursor: Cursor) -> tuple[list[Change], Cursor]:
    with factory() as session:
        return read_changes(session, cursor)


def _story(changes: list[Change], job_id: str) -> list[str]:
    """What a viewer got of ``job_id``, in order: "job" for its row, else the event's kind."""
    return [
        "job" if c.kind == "job" else c.data["kind"]
        for c in changes
        if (c.data["id"] if c.kind == "job" else c.data["job_id"]) == job_id
    ]


@contextmanager
def _statements(factory: SessionFactory) -> Iterator[list[str]]:
    """The SQL statements run on ``factory``'s engine meanwhile."""
    run: list[str] = []

    def note(*args: Any) -> None:
        run.append(args[2])

    engine = factory.kw["bind"]
    sa.event.listen(engine, "after_cursor_execute", note)
    try:
        yield run
    finally:
        sa.event.remove(engine, "after_cursor_execute", note)


@contextmanager
def _commit_after(factory: SessionFactory, statements: int, writer: Session) -> Iterator[None]:
    """Commit ``writer`` once ``statements`` statements have run on ``factory``'s engine (at
    the end, if fewer ran): a write landing at that point of a read."""
    engine = factory.kw["bind"]
    run = 0

    def count(*_: Any) -> None:
        nonlocal run
        run += 1
        if run == statements:
            writer.commit()

    if statements == 0:
        writer.commit()
    sa.event.listen(engine, "after_cursor_execute", count)
    try:
        yield
    finally:
        sa.event.remove(engine, "after_cursor_execute", count)
        if writer.in_transaction():
            writer.commit()


def test_a_job_committed_while_the_feed_reads_shows_its_row_with_or_before_its_event(
    session_factory: SessionFactory, alice: Principal, accepted: AcceptedSpec
) -> None:
    # The stream test's flake: a job (its row and its first event, one transaction) that
    # commits between the feed's reads must not show its event first, nor without its row.
    cursor = _start(session_factory)
    with _statements(session_factory) as run:
        _read(session_factory, cursor)
    for point in range(len(run) + 1):
        with session_factory() as writer:
            job_id = add_job(writer, alice, accepted).id
            writer.flush()
            with _commit_after(session_factory, point, writer):
                first, cursor = _read(session_factory, cursor)
        then, cursor = _read(session_factory, cursor)
        story = _story(first + then, job_id)
        assert story == ["job", "state"], (
            f"committed after statement {point} of {len(run)}: {story}"
        )
        assert _read(session_factory, cursor)[0] == []


def test_a_job_committed_while_the_feed_starts_never_shows_its_event_alone(
    session_factory: SessionFactory, alice: Principal, accepted: AcceptedSpec
) -> None:
    # What commits as the feed starts may count as before it, whole or its row only.
    with _statements(session_factory) as run:
        _start(session_factory)
    for point in range(len(run) + 1):
        with session_factory() as writer:
            job_id = add_job(writer, alice, accepted).id
            writer.flush()
            with _commit_after(session_factory, point, writer):
                cursor = _start(session_factory)
        story = _story(_read(session_factory, cursor)[0], job_id)
        assert story in ([], ["job"], ["job", "state"]), f"after statement {point}: {story}"


def _add_stamped(writer: Session, who: Principal, accepted: AcceptedSpec, at: datetime) -> str:
    """A job added in ``writer``'s open transaction whose row was stamped at ``at``."""
    job = add_job(writer, who, accepted)
    job.updated_at = at
    writer.flush()
    return job.id


@pytest.mark.parametrize("cursor_from", ["start", "read"])
def test_a_write_stamped_before_another_but_committed_after_it_still_comes(
    session_factory: SessionFactory, alice: Principal, accepted: AcceptedSpec, cursor_from: str
) -> None:
    # A write stamps its job's updated_at (and, on PostgreSQL, takes its event's id) before it
    # commits; one stamped later may commit first and be read before it. SQLite lets one writer
    # at a time, so there the first write's ids come after anyway, but its stamp need not:
    # ``transition`` stamps before it waits for the database's lock.
    interleaves = session_factory.kw["bind"].dialect.name != "sqlite"
    cursor = _start(session_factory)
    early = utcnow()
    with session_factory() as late:
        if interleaves:
            late_id = _add_stamped(late, alice, accepted, early)
        with transaction(session_factory) as session:
            first_id = add_job(session, alice, accepted).id
        if cursor_from == "start":
            cursor = _start(session_factory)
        else:
            changes, cursor = _read(session_factory, cursor)
            assert _story(changes, first_id) == ["job", "state"]
        if not interleaves:
            late_id = _add_stamped(late, alice, accepted, early)
        late.commit()
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, late_id) == ["job", "state"]
    assert _story(changes, first_id) == []  # sent once
    assert _read(session_factory, cursor)[0] == []


def _hole(factory: SessionFactory, job_id: str, kinds: tuple[str, ...]) -> list[int]:
    """Events of ``kinds`` added in one commit, but the first one's id left unused (as a
    write rolled back on PostgreSQL leaves it): their ids."""
    with transaction(factory) as session:
        events = [add_event(session, job_id, kind, kind) for kind in kinds]
        session.flush()
        session.delete(events[0])
    return [e.id for e in events]


def test_a_hole_in_the_event_ids_is_waited_for_only_as_long_as_a_write_may_take(
    session_factory: SessionFactory, alice: Principal, accepted: AcceptedSpec
) -> None:
    cursor = _start(session_factory)
    with transaction(session_factory) as session:
        job_id = add_job(session, alice, accepted).id
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, job_id) == ["job", "state"]

    hole, *after = _hole(session_factory, job_id, ("lost", "b", "c"))
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, job_id) == ["b", "c"]
    assert cursor.event_floor < hole  # waited for
    # A write that took the hole's id commits late: it comes, and the hole is closed.
    with transaction(session_factory) as session:
        session.add(JobEvent(id=hole, job_id=job_id, kind="late", message="late"))
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, job_id) == ["late"]

    # A hole nothing fills is given up once an event stamped SETTLE later was read.
    hole, *after = _hole(session_factory, job_id, ("lost", "d"))
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, job_id) == ["d"] and cursor.event_floor < hole
    with transaction(session_factory) as session:
        stamped = session.get_one(JobEvent, after[-1]).time + SETTLE
        later = add_event(session, job_id, "e", "e")
        later.time = stamped
        session.flush()
        later_id = later.id
    changes, cursor = _read(session_factory, cursor)
    assert _story(changes, job_id) == ["e"]
    assert cursor.event_floor == later_id and not cursor.events_sent
