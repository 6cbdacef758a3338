"""``GET /metrics`` over a real database: Prometheus text whose figures are the database's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from shoal.api.app import create_app
from shoal.service.auth import Principal, authenticate, create_token
from shoal.service.db.models import DeviceRow, Job, JobMetric, Sweep
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.jobs import add_event, add_job, transition
from shoal.service.lifecycle import JobState
from shoal.service.settings import Settings
from shoal.service.specs import validate_job_spec
from tests.api.conftest import Api
from tests.factories import job_spec

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PER_JOB = {
    "shoal_job_step",
    "shoal_job_loss",
    "shoal_job_samples_per_second",
    "shoal_job_steps_per_second",
    "shoal_job_mfu",
    "shoal_stage_compute_seconds",
    "shoal_stage_idle_seconds",
}


def scrape(client: TestClient, headers: dict[str, str] | None = None) -> Samples:
    r = client.get("/metrics", headers=headers or {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def owner(factory: SessionFactory) -> Principal:
    token = create_token(factory, user="alice")
    with factory() as session:
        who = authenticate(session, token)
    assert who is not None
    return who


TOKEN = "scrape-me-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def scraper(session_factory: SessionFactory, tmp_path: Path) -> Iterator[TestClient]:
    """An API whose /metrics shows the per-job series to a scrape that brings TOKEN."""
    settings = Settings(home=tmp_path, database_url="unused://", metrics_token=TOKEN)
    with TestClient(create_app(settings, session_factory)) as client:
        yield client


def busy_cluster(factory: SessionFactory) -> tuple[str, str]:
    """Alice's jobs (one QUEUED, one RUNNING at step 3 with two stages' timings), job events,
    a sweep and three devices: the ids of the queued and the running job."""
    who = owner(factory)
    accepted = validate_job_spec(job_spec(steps=10), [])
    with transaction(factory) as session:
        queued = add_job(session, who, accepted)
        running = add_job(session, who, accepted)
        transition(session, running, JobState.RUNNING, "placed")
        running.step, running.last_loss = 3, 0.25
        running.stage_times = [
            {"stage": 0, "replica": 0, "device_id": "d0", "compute_s": 0.4, "idle_s": 0.1},
            {"stage": 1, "replica": 0, "device_id": "d1", "compute_s": 0.3, "idle_s": 0.2},
        ]
        for step, seconds in ((2, 1.0), (3, 0.5)):  # the latest step counts
            session.add(
                JobMetric(
                    job_id=running.id,
                    step=step,
                    loss=0.3,
                    samples_per_s=64.0 / seconds,
                    step_time_s=seconds,
                    mfu=0.1 * seconds,
                )
            )
        add_event(session, running.id, "repartition", "re-cut")
        add_event(session, running.id, "recovered", "back")
        add_event(session, running.id, "recovered", "back again")
        session.add(
            Sweep(
                id="s" * 32, name="s", owner_id=who.user_id, spec={}, state="RUNNING", max_trials=4
            )
        )
        for i, (kind, state, draining) in enumerate(
            [("cpu-a", "alive", False), ("cpu-a", "alive", True), ("cpu-b", "lost", False)]
        ):
            session.add(
                DeviceRow(
                    id=f"d{i}",
                    node_id="n",
                    kind=kind,
                    memory_mb=1024,
                    gpu=False,
                    spot=False,
                    state=state,
                    draining=draining,
                )
            )
    return queued.id, running.id


def test_states_devices_events_and_running_jobs_are_exposed(
    session_factory: SessionFactory, scraper: TestClient
) -> None:
    queued, running = busy_cluster(session_factory)
    got = scrape(scraper, BEARER)
    assert got[("shoal_jobs", (("state", "QUEUED"),))] == 1
    assert got[("shoal_jobs", (("state", "RUNNING"),))] == 1
    assert got[("shoal_jobs", (("state", "FAILED"),))] == 0  # every state, zeros included
    assert got[("shoal_sweeps", (("state", "RUNNING"),))] == 1
    assert got[("shoal_devices", (("kind", "cpu-a"), ("state", "alive")))] == 1
    assert got[("shoal_devices", (("kind", "cpu-a"), ("state", "draining")))] == 1
    assert got[("shoal_devices", (("kind", "cpu-b"), ("state", "lost")))] == 1
    assert got[("shoal_job_events_total", (("kind", "recovered"),))] == 2
    assert got[("shoal_job_events_total", (("kind", "repartition"),))] == 1
    job = (("job", running),)
    assert got[("shoal_job_step", job)] == 3 and got[("shoal_job_loss", job)] == 0.25
    assert got[("shoal_job_samples_per_second", job)] == 128.0
    assert got[("shoal_job_steps_per_second", job)] == 2.0
    assert got[("shoal_job_mfu", job)] == 0.05
    stage1 = (("job", running), ("replica", "0"), ("stage", "1"))
    assert got[("shoal_stage_compute_seconds", stage1)] == 0.3
    assert got[("shoal_stage_idle_seconds", stage1)] == 0.2
    # Only running jobs have series of their own: their number is bounded by the devices.
    assert not any(dict(labels).get("job") == queued for _, labels in got)


def test_request_latency_is_a_histogram_by_route_template(api: Api) -> None:
    alice = api.token("alice")
    for _ in range(3):
        assert api.client.get("/api/v1/jobs/" + "0" * 32, headers=alice).status_code == 404
    api.client.get("/no/such/page")
    got = scrape(api.client)
    route = (("method", "GET"), ("route", "/api/v1/jobs/{job_id}"), ("status", "404"))
    assert got[("shoal_api_request_seconds_count", route)] == 3
    assert got[("shoal_api_request_seconds_bucket", (("le", "+Inf"), *route))] == 3
    unmatched = (("method", "GET"), ("route", "unmatched"), ("status", "404"))
    assert got[("shoal_api_request_seconds_count", unmatched)] == 1
    assert not any("0" * 32 in dict(labels).get("route", "") for _, labels in got)


def test_a_scrape_without_the_metrics_token_names_no_job(
    session_factory: SessionFactory, scraper: TestClient
) -> None:
    """/metrics is open, so what it shows anyone is counts: no job's id, name, step or loss.
    The per-job series need SHOAL_METRICS_TOKEN; any other bearer token is refused."""
    queued, running = busy_cluster(session_factory)
    with session_factory() as session:
        names = {job.name for job in session.scalars(sa.select(Job))}
    opened = scraper.get("/metrics")
    assert opened.status_code == 200, opened.text
    for secret in (queued, running, *names):
        assert secret not in opened.text, f"{secret!r} in an open scrape:\n{opened.text}"
    got = scrape(scraper)
    assert got[("shoal_jobs", (("state", "RUNNING"),))] == 1
    assert got[("shoal_devices", (("kind", "cpu-a"), ("state", "alive")))] == 1
    assert got[("shoal_job_events_total", (("kind", "recovered"),))] == 2
    assert not {name for name, _ in got} & PER_JOB, sorted(got)
    assert ("shoal_job_loss", (("job", running),)) in scrape(scraper, BEARER)
    for wrong in ("Bearer nope", f"Bearer {TOKEN}x", TOKEN, f"Basic {TOKEN}"):
        refused = scraper.get("/metrics", headers={"Authorization": wrong})
        assert refused.status_code == 401 and "SHOAL_METRICS_TOKEN" in refused.text
        assert running not in refused.text


def test_without_a_metrics_token_set_no_scrape_gets_per_job_series(
    session_factory: SessionFactory, api: Api
) -> None:
    _, running = busy_cluster(session_factory)
    assert not {name for name, _ in scrape(api.client)} & PER_JOB
    alice = api.token("alice")  # an API token is not the metrics token
    refused = api.client.get("/metrics", headers=alice)
    assert refused.status_code == 401 and "SHOAL_METRICS_TOKEN is not set" in refused.text
    assert running not in refused.text
