"""The jobs API over a real database: contract, idempotency, visibility, bad input."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from shoal.service.db.models import DeviceRow, Job, JobEvent
from shoal.service.jobs import transition
from shoal.service.lifecycle import JobState
from tests.api.conftest import Api
from tests.factories import job_spec

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"


def test_submit_then_read_back(api: Api) -> None:
    alice = api.token("alice")
    r = api.client.post(JOBS, json=job_spec(), headers=alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "QUEUED" and job["owner"] == "alice" and job["steps"] == 20
    assert job["spec"]["model"]["config"]["in_features"] == 64  # filled from the data

    got = api.client.get(f"{JOBS}/{job['id']}", headers=alice).json()
    assert got["id"] == job["id"] and got["partition"] == []
    page = api.client.get(JOBS, headers=alice).json()
    assert page["total"] == 1 and page["items"][0]["id"] == job["id"]
    events = api.client.get(f"{JOBS}/{job['id']}/events", headers=alice).json()["items"]
    assert [(e["kind"], e["data"]["to"]) for e in events] == [("state", "QUEUED")]


def test_idempotency_key_returns_the_same_job(api: Api) -> None:
    alice = api.token("alice")
    headers = {**alice, "Idempotency-Key": "k-1"}
    first = api.client.post(JOBS, json=job_spec(), headers=headers)
    again = api.client.post(JOBS, json=job_spec(), headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    other = api.client.post(JOBS, json=job_spec(steps=7), headers=headers)
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
    assert api.client.get(JOBS, headers=alice).json()["total"] == 1


def test_users_see_only_their_jobs_admins_all(api: Api) -> None:
    alice, bob, root = api.token("alice"), api.token("bob"), api.token("root", admin=True)
    job_id = api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"]
    assert api.client.get(f"{JOBS}/{job_id}", headers=bob).status_code == 404
    assert api.client.post(f"{JOBS}/{job_id}/cancel", headers=bob).status_code == 404
    assert api.client.get(f"{JOBS}/{job_id}/metrics", headers=bob).status_code == 404
    assert api.client.get(JOBS, headers=bob).json()["total"] == 0
    assert api.client.get(f"{JOBS}/{job_id}", headers=root).status_code == 200
    assert api.client.get(JOBS, headers=root).json()["total"] == 1


def test_auth_is_required(api: Api) -> None:
    assert api.client.get(JOBS).status_code == 401
    bad = api.client.get(JOBS, headers={"Authorization": "Bearer shoal_nope"})
    assert bad.status_code == 401 and bad.json()["detail"] == "invalid or revoked token"
    assert api.client.get("/healthz").status_code == 200


def test_cancel_queued_then_conflicts_then_restart(api: Api) -> None:
    alice = api.token("alice")
    job_id = api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"]
    r = api.client.post(f"{JOBS}/{job_id}/cancel", headers=alice)
    assert r.status_code == 200 and r.json()["state"] == "CANCELLED"
    again = api.client.post(f"{JOBS}/{job_id}/cancel", headers=alice)
    assert again.status_code == 409 and "already CANCELLED" in again.json()["detail"]
    restarted = api.client.post(f"{JOBS}/{job_id}/restart", headers=alice)
    assert restarted.status_code == 200 and restarted.json()["state"] == "QUEUED"
    assert api.client.post(f"{JOBS}/{job_id}/restart", headers=alice).status_code == 409


def test_cancel_of_running_job_is_a_request(api: Api) -> None:
    alice = api.token("alice")
    job_id = api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"]
    with api.factory() as session, session.begin():
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, JobState.RUNNING, "placed")
    r = api.client.post(f"{JOBS}/{job_id}/cancel", headers=alice)
    assert r.json()["state"] == "RUNNING" and r.json()["cancel_requested"] is True


def test_list_filters_by_state_and_paginates(api: Api) -> None:
    alice = api.token("alice")
    ids = [api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"] for _ in range(5)]
    api.client.post(f"{JOBS}/{ids[0]}/cancel", headers=alice)
    queued = api.client.get(JOBS, params={"state": "QUEUED", "limit": 2}, headers=alice).json()
    assert queued["total"] == 4 and len(queued["items"]) == 2
    rest = api.client.get(
        JOBS, params={"state": "QUEUED", "limit": 2, "offset": 2}, headers=alice
    ).json()
    assert {j["id"] for j in queued["items"]}.isdisjoint(j["id"] for j in rest["items"])
    capped = api.client.get(JOBS, params={"limit": 10_000}, headers=alice).json()
    assert capped["limit"] == 100
    assert [j["id"] for j in capped["items"]] == ids[::-1]  # newest first
    bad = api.client.get(JOBS, params={"state": "DONE"}, headers=alice)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "state.0"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (job_spec(steps=-1), "steps"),
        (job_spec(steps="many"), "steps"),
        (job_spec(batch_size=4, micro_batches=8), ""),
        (job_spec(model={"builtin": "mlp", "config": {"layers": 10**12}}), "model.config.layers"),
        (job_spec(model={"builtin": "transformer-xl"}), "model.builtin"),
        (job_spec(model={"factory": "os:system"}), "model.factory"),
        (job_spec(data={"factory": "subprocess:run"}), "data.factory"),
        (job_spec(extra_field=True), "extra_field"),
        ([1, 2, 3], ""),
    ],
)
def test_bad_specs_are_422_naming_the_field(api: Api, body: object, field: str) -> None:
    alice = api.token("alice")
    r = api.client.post(JOBS, json=body, headers=alice)
    assert r.status_code == 422, r.text
    assert field in [e["field"] for e in r.json()["errors"]]
    assert "Traceback" not in r.text
    with api.factory() as session:  # nothing half-written
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0
        assert session.scalar(sa.select(sa.func.count()).select_from(JobEvent)) == 0


def test_malformed_json_and_oversized_bodies(api: Api) -> None:
    alice = {**api.token("alice"), "Content-Type": "application/json"}
    r = api.client.post(JOBS, content=b'{"name": "x",', headers=alice)
    assert r.status_code == 422 and "not valid JSON" in r.json()["detail"]
    huge = json.dumps(job_spec(name="x" * 10, padding="y" * 100_000)).encode()
    r = api.client.post(JOBS, content=huge, headers=alice)
    assert r.status_code == 413 and "SHOAL_MAX_BODY_BYTES" in r.json()["detail"]


def test_unknown_ids_are_404(api: Api) -> None:
    alice = api.token("alice")
    for path in ("", "/metrics", "/events", "/checkpoints"):
        r = api.client.get(f"{JOBS}/deadbeef{path}", headers=alice)
        assert r.status_code == 404 and r.json()["detail"] == "no job 'deadbeef'"
    assert api.client.post(f"{JOBS}/deadbeef/cancel", headers=alice).status_code == 404


def test_openapi_is_served_with_the_job_contract(api: Api) -> None:
    schema = api.client.get("/api/v1/openapi.json").json()
    assert "/api/v1/jobs" in schema["paths"]
    assert "JobSpec" in schema["components"]["schemas"]


def add_device(api: Api) -> None:
    """One live 2 GiB CPU device, as a node's worker reports it."""
    with api.factory() as session, session.begin():
        session.add(
            DeviceRow(
                id="n1-cpu-0",
                node_id="n1",
                kind="cpu",
                memory_mb=2048,
                gpu=False,
                spot=False,
                state="alive",
            )
        )


def test_a_model_that_fits_no_known_device_is_refused_with_numbers(api: Api) -> None:
    alice = api.token("alice")
    huge = job_spec(model={"builtin": "mlp", "config": {"hidden": 8192, "layers": 40}})
    assert api.client.post(JOBS, json=huge, headers=alice).status_code == 201  # no devices yet
    add_device(api)
    r = api.client.post(JOBS, json=huge, headers=alice)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == "resources.max_devices"
    assert "largest device has 2.0 GiB" in error["message"]
    small = api.client.post(JOBS, json=job_spec(), headers=alice)
    assert small.status_code == 201


def test_a_block_that_fits_only_sharded_is_refused_with_the_fix_and_admitted_sharded(
    api: Api,
) -> None:
    alice = api.token("alice")
    add_device(api)
    # A 400 MiB block with Adam's 800 MiB of moments: 2.3 GiB whole, under 2 GiB sharded.
    wide = {"builtin": "mlp", "config": {"hidden": 10240, "layers": 2}}
    four = {"max_devices": 4}
    r = api.client.post(JOBS, json=job_spec(model=wide, resources=four), headers=alice)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert "for block 1 alone" in error["message"]
    assert "parallelism.shard: optimizer, parallelism.replicas: 2" in error["message"]
    sharded = job_spec(
        model=wide,
        resources=four,
        parallelism={"replicas": 2, "shard": "optimizer"},
    )
    r = api.client.post(JOBS, json=sharded, headers=alice)
    assert r.status_code == 201, r.text
