"""The API fuzzed from its own OpenAPI schema (schemathesis), on SQLite and PostgreSQL: no
5xx, and every response's status code, content type, headers and body are ones the schema
documents.

Stateless: each operation alone, with valid and invalid inputs; path ids are the generated
one or a seeded job's, sweep's or device's, so the routes find something. Stateful: call
sequences chained by the links schemathesis infers from the response schemas (an ``id`` or
``job_id`` feeding the next call's ``{job_id}``; FastAPI declares no links, and none are
needed), each sequence starting from the same seeded database. Both send the admin's token
on every call, except the cases schemathesis makes without it (401).

Not fuzzed: ``GET /api/v1/stream``, a server-sent event stream that never ends, so there is
no response to check (``test_stream.py`` covers it); the dashboard (``/``, ``/static``) and
``GET /metrics`` are not in the schema."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from sqlalchemy.orm import sessionmaker

from shoal.api.app import API_PREFIX, create_app
from shoal.service.auth import create_token
from shoal.service.db.models import Base, DeviceRow, Job
from shoal.service.db.session import SessionFactory, make_engine, make_session_factory, migrate
from shoal.service.jobs import transition
from shoal.service.lifecycle import JobState
from shoal.service.settings import Settings
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration

# A code upload's body is a zip: fuzzed as the bytes it is.
schemathesis.serializer.alias("application/zip", "application/octet-stream")
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_headers_conformance,
    schemathesis.checks.response_schema_conformance,
]
# Bounded for CI: the same cases every run (derandomized), no deadline on a shared machine.
FUZZ = hypothesis.settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
SCENARIOS = hypothesis.settings(
    FUZZ, max_examples=40, stateful_step_count=8, phases=[hypothesis.Phase.generate]
)


def _documented_schema() -> schemathesis.BaseSchema:
    """The schema the code declares, read from an app over no database; the cases are sent
    to ``served``'s app. (A schema loaded in a fixture, ``schemathesis.pytest.from_fixture``,
    fails on pytest 9.2, which dropped the ``_nodeid`` attribute schemathesis 4.32 sets.)"""
    settings = Settings(home=Path(tempfile.gettempdir()), database_url="unused://")
    return schemathesis.openapi.from_dict(create_app(settings, sessionmaker()).openapi())


SCHEMA = _documented_schema().exclude(path=f"{API_PREFIX}/stream")

# Generated specs almost never pass the spec's cross-field checks (a known model and data
# set, micro-batches dividing the batch, ...), so half the submissions are valid ones: the
# 201 path, idempotent retries and the ids the stateful links carry get exercised too.
_VALID_BODIES = {
    f"{API_PREFIX}/jobs": st.builds(
        job_spec,
        steps=st.integers(1, 10**7),
        priority=st.integers(-100, 100),
        seed=st.integers(0, 2**31 - 1),
    ),
    f"{API_PREFIX}/sweeps": st.builds(sweep_spec, max_trials=st.integers(1, 16)),
}


@SCHEMA.hook
def before_generate_body(context: schemathesis.HookContext, strategy: Any) -> Any:
    valid = _VALID_BODIES.get(context.operation.path) if context.operation else None
    return strategy if valid is None else st.one_of(strategy, valid)


@dataclass
class Served:
    app: FastAPI
    factory: SessionFactory
    headers: dict[str, str]  # the admin's bearer token
    ids: dict[str, list[str]]  # path parameter -> seeded ids

    def reseed(self) -> None:
        """Back to the seeded state: a device; a queued, a cancelled and a placed (RUNNING)
        job; a sweep. Users and tokens stay."""
        with self.factory() as session, session.begin():
            for table in reversed(Base.metadata.sorted_tables):
                if table.name not in ("users", "api_tokens"):
                    session.execute(sa.delete(table))
            session.add(
                DeviceRow(
                    id="n1-cpu-0",
                    node_id="n1",
                    kind="cpu",
                    memory_mb=2048,
                    gpu=False,
                    spot=True,
                    state="alive",
                )
            )
        client = TestClient(self.app)
        jobs = []
        for _ in range(3):
            answer = client.post(f"{API_PREFIX}/jobs", json=job_spec(), headers=self.headers)
            assert answer.status_code == 201, answer.text
            jobs.append(answer.json()["id"])
        cancel = client.post(f"{API_PREFIX}/jobs/{jobs[1]}/cancel", headers=self.headers)
        assert cancel.status_code == 200, cancel.text
        with self.factory() as session, session.begin():
            job = session.get(Job, jobs[2])
            assert job is not None
            transition(session, job, JobState.RUNNING, "placed")
            job.partition = [{"stage": 0, "replica": 0, "device_id": "n1-cpu-0", "blocks": [0, 4]}]
            job.devices = ["n1-cpu-0"]
        sweep = client.post(f"{API_PREFIX}/sweeps", json=sweep_spec(), headers=self.headers)
        assert sweep.status_code == 201, sweep.text
        self.ids = {"job_id": jobs, "sweep_id": [sweep.json()["id"]], "device_id": ["n1-cpu-0"]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """The app over a migrated database of each backend, seeded, without a controller
    (PostgreSQL: the session's database, as ``database_url`` gives it)."""
    home = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{home / 'shoal.db'}"
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_server_url")
    migrate(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    settings = Settings(  # no rate limit: the fuzzer's requests would turn into 429s
        home=home,
        database_url=url,
        max_body_bytes=64 * 1024,
        max_page_size=100,
        rate_limit_per_s=None,
    )
    token = create_token(factory, user="root", admin=True)
    served = Served(
        create_app(settings, factory), factory, {"Authorization": f"Bearer {token}"}, {}
    )
    served.reseed()
    try:
        yield served
    finally:
        engine.dispose()


@SCHEMA.parametrize()
@SCHEMA.given(data=st.data())
@FUZZ
def test_every_operation_answers_as_documented(
    case: schemathesis.Case, data: st.DataObject, served: Served
) -> None:
    for name, generated in (case.path_parameters or {}).items():
        choices = [generated, *served.ids.get(name, [])]
        case.path_parameters[name] = data.draw(st.sampled_from(choices), label=name)
    case.call_and_validate(app=served.app, headers=served.headers, checks=CHECKS)


def test_call_sequences_answer_as_documented(served: Served) -> None:
    class Sequences(SCHEMA.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            served.reseed()  # each scenario starts from the same state, so it can be replayed

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"app": served.app, "headers": served.headers}

        def validate_response(
            self, response: schemathesis.Response, case: schemathesis.Case, **kwargs: Any
        ) -> None:
            case.validate_response(response, checks=CHECKS, headers=served.headers)

    Sequences.run(settings=SCENARIOS)
