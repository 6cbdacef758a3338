"""Structured logs: every committed job event is a log line carrying its job id; with
``SHOAL_LOG_JSON`` each line is one JSON object with ``job_id`` and ``event`` keys."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.service.auth import Principal
from shoal.service.db.models import User
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.jobs import add_event, submit_job
from shoal.service.server import configure_logging
from shoal.service.settings import Settings
from shoal.service.specs import validate_job_spec
from tests.factories import job_spec


@pytest.fixture
def json_logs(tmp_path: Path) -> Iterator[io.StringIO]:
    """What the service logs with ``SHOAL_LOG_JSON`` set."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging(Settings(home=tmp_path, database_url="unused://", log_json=True), stream)
    yield stream
    root.handlers[:], root.level = handlers, level


def lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_a_committed_job_event_is_a_json_log_line_with_its_job_id(
    session_factory: SessionFactory, json_logs: io.StringIO
) -> None:
    with transaction(session_factory) as session:
        user = User(name="alice")
        session.add(user)
        session.flush()
        alice = Principal(user.id, user.name, False)
    job, _ = submit_job(session_factory, alice, validate_job_spec(job_spec(), []))

    with pytest.raises(RuntimeError), transaction(session_factory) as session:
        add_event(session, job.id, "checkpoint", "never written")
        raise RuntimeError("the transaction rolls back")

    logged = [line for line in lines(json_logs.getvalue()) if line.get("job_id") == job.id]
    assert [(line["event"], line["level"]) for line in logged] == [("state", "INFO")]
    assert "submitted" in str(logged[0]["message"]) and logged[0]["logger"] == "shoal.service.jobs"
