"""``/api/v1/devices``: the pool, and draining a device and ending a drain (admins only)."""

from __future__ import annotations

import pytest

from shoal.service.db.models import DeviceRow
from tests.api.conftest import Api
from tests.factories import job_spec

pytestmark = pytest.mark.integration

DEVICES = "/api/v1/devices"


def add_device(api: Api, device_id: str = "n1-cpu-0") -> None:
    with api.factory() as session, session.begin():
        session.add(
            DeviceRow(
                id=device_id,
                node_id="n1",
                kind="cpu",
                memory_mb=2048,
                gpu=False,
                spot=True,
                state="alive",
            )
        )


def test_an_admin_drains_a_device_and_the_pool_shows_it(api: Api) -> None:
    add_device(api)
    admin = api.token("root", admin=True)
    assert api.client.get(DEVICES, headers=admin).json()["items"][0]["draining"] is False
    answer = api.client.post(f"{DEVICES}/n1-cpu-0/drain", headers=admin)
    assert answer.status_code == 200 and answer.json()["draining"] is True
    assert answer.json()["drain_reason"] == "drained by root"
    again = api.client.post(f"{DEVICES}/n1-cpu-0/drain", headers=admin)
    assert again.status_code == 200  # idempotent
    (listed,) = api.client.get(DEVICES, headers=admin).json()["items"]
    assert (listed["draining"], listed["drain_reason"]) == (True, "drained by root")


def test_an_admin_ends_a_drain_and_the_device_takes_jobs_again(api: Api) -> None:
    add_device(api)
    with api.factory() as session, session.begin():
        row = session.get(DeviceRow, "n1-cpu-0")
        assert row is not None
        row.draining, row.drain_reason = True, "device n1-cpu-0 was set aside: CUDA error"
    admin = api.token("root", admin=True)
    answer = api.client.post(f"{DEVICES}/n1-cpu-0/drain", headers=admin)
    assert answer.json()["drain_reason"] == "device n1-cpu-0 was set aside: CUDA error"
    for _ in range(2):  # idempotent
        ended = api.client.delete(f"{DEVICES}/n1-cpu-0/drain", headers=admin)
        assert ended.status_code == 200, ended.text
        assert (ended.json()["draining"], ended.json()["drain_reason"]) == (False, None)
    with api.factory() as session:
        row = session.get(DeviceRow, "n1-cpu-0")
        assert row is not None and (row.draining, row.drain_reason) == (False, None)


def test_draining_needs_an_admin_and_a_known_device(api: Api) -> None:
    add_device(api)
    user = api.token("alice")
    refused = api.client.post(f"{DEVICES}/n1-cpu-0/drain", headers=user)
    assert refused.status_code == 403 and "admin" in refused.json()["detail"]
    missing = api.client.post(f"{DEVICES}/nope/drain", headers=api.token("root", admin=True))
    assert missing.status_code == 404 and "GET /api/v1/devices" in missing.json()["detail"]
    assert api.client.post(f"{DEVICES}/n1-cpu-0/drain").status_code == 401
    with api.factory() as session:
        row = session.get(DeviceRow, "n1-cpu-0")
        assert row is not None and row.draining is False


def test_ending_a_drain_needs_an_admin_and_a_known_device(api: Api) -> None:
    add_device(api)
    admin = api.token("root", admin=True)
    api.client.post(f"{DEVICES}/n1-cpu-0/drain", headers=admin)
    refused = api.client.delete(f"{DEVICES}/n1-cpu-0/drain", headers=api.token("alice"))
    assert refused.status_code == 403 and "undraining" in refused.json()["detail"]
    missing = api.client.delete(f"{DEVICES}/nope/drain", headers=admin)
    assert missing.status_code == 404 and "GET /api/v1/devices" in missing.json()["detail"]
    assert api.client.delete(f"{DEVICES}/n1-cpu-0/drain").status_code == 401
    with api.factory() as session:
        row = session.get(DeviceRow, "n1-cpu-0")
        assert row is not None and row.draining is True


def test_the_pool_names_a_users_own_job_and_hides_another_users(api: Api) -> None:
    alice, bob, root = api.token("alice"), api.token("bob"), api.token("root", admin=True)
    job_id = api.client.post("/api/v1/jobs", json=job_spec(), headers=alice).json()["id"]
    add_device(api, "n1-cpu-0")
    add_device(api, "n1-cpu-1")
    with api.factory() as session, session.begin():
        row = session.get(DeviceRow, "n1-cpu-0")
        assert row is not None
        row.job_id = job_id

    def jobs_on_devices(headers: dict[str, str]) -> dict[str, str | None]:
        items = api.client.get(DEVICES, headers=headers).json()["items"]
        return {device["id"]: device["job_id"] for device in items}

    assert jobs_on_devices(alice) == {"n1-cpu-0": job_id, "n1-cpu-1": None}
    assert jobs_on_devices(root) == {"n1-cpu-0": job_id, "n1-cpu-1": None}
    assert jobs_on_devices(bob) == {"n1-cpu-0": "(another user's job)", "n1-cpu-1": None}
