"""A database connection lost in the middle of a request: a 503 saying to retry, nothing
half-written, and a retried submission creating its job once (PostgreSQL: the connection
is really killed by the server)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from shoal.service import jobs
from shoal.service.db.models import Job, JobEvent
from tests.api.conftest import Api
from tests.factories import job_spec

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_submission_whose_connection_dies_is_503_writes_nothing_and_retries_once(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice = api.token("alice") | {"Idempotency-Key": "retry-me"}
    add_job = jobs.add_job

    def add_then_lose_the_connection(session: Any, *args: Any, **kwargs: Any) -> Any:
        job = add_job(session, *args, **kwargs)
        session.flush()  # the job's row and its event are sent, not committed
        session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return job

    monkeypatch.setattr(jobs, "add_job", add_then_lose_the_connection)
    lost = api.client.post("/api/v1/jobs", json=job_spec(), headers=alice)
    assert lost.status_code == 503, lost.text
    assert lost.headers["Retry-After"] == "1" and "retry" in lost.json()["detail"]
    assert "Traceback" not in lost.text
    with api.factory() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0
        assert session.scalar(sa.select(sa.func.count()).select_from(JobEvent)) == 0

    monkeypatch.setattr(jobs, "add_job", add_job)
    first = api.client.post("/api/v1/jobs", json=job_spec(), headers=alice)
    again = api.client.post("/api/v1/jobs", json=job_spec(), headers=alice)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    with api.factory() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 1
    # The pool replaced the dead connection: reads work on.
    assert api.client.get("/api/v1/jobs", headers=alice).json()["total"] == 1
