"""``/api/v1/users``: an admin sees every user's quota and holdings and sets limits."""

from __future__ import annotations

from typing import Any

import pytest
from httpx import Response

from tests.api.conftest import Api
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration

USERS = "/api/v1/users"
JOBS = "/api/v1/jobs"
SWEEPS = "/api/v1/sweeps"


def test_an_admin_sets_a_users_quota_and_sees_what_applies(api: Api) -> None:
    root, alice = api.token("root", admin=True), api.token("alice")
    listed = {u["name"]: u for u in api.client.get(USERS, headers=root).json()["items"]}
    assert listed["alice"]["effective_max_jobs"] is None  # no default set here
    assert listed["alice"]["running_jobs"] == 0 and listed["alice"]["held_devices"] == 0
    answer = api.client.put(f"{USERS}/alice/quota", json={"max_jobs": 2}, headers=root)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["max_jobs"], answer.json()["effective_max_jobs"]) == (2, 2)
    assert answer.json()["max_devices"] is None
    cleared = api.client.put(f"{USERS}/alice/quota", json={}, headers=root).json()
    assert cleared["max_jobs"] is None  # back to the default
    # Users may not read or set quotas; unknown users and bad limits are refused clearly.
    assert api.client.get(USERS, headers=alice).status_code == 403
    assert api.client.put(f"{USERS}/alice/quota", json={}, headers=alice).status_code == 403
    missing = api.client.put(f"{USERS}/nobody/quota", json={}, headers=root)
    assert missing.status_code == 404 and "nobody" in missing.json()["detail"]
    bad = api.client.put(f"{USERS}/alice/quota", json={"max_jobs": 0}, headers=root)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "max_jobs"


def test_a_priority_above_the_default_is_an_admins_grant(api: Api) -> None:
    """Priority preempts other users' jobs, so a user may submit above the default priority
    only what an admin granted them (max_priority), for jobs and every trial of a sweep;
    an admin may submit any priority."""
    root, alice = api.token("root", admin=True), api.token("alice")

    def job(who: dict[str, str], priority: int) -> Response:
        answer: Response = api.client.post(JOBS, json=job_spec(priority=priority), headers=who)
        return answer

    def sweep(base: int, space: dict[str, Any] | None = None) -> Response:
        spec = sweep_spec(base=job_spec(priority=base, steps=30))
        spec["space"].update(space or {})
        answer: Response = api.client.post(SWEEPS, json=spec, headers=alice)
        return answer

    def refused(answer: Response, field: str) -> None:
        assert answer.status_code == 422, answer.text
        (error,) = answer.json()["errors"]
        assert (
            error["field"] == field
            and "ask an admin to raise your max_priority" in (error["message"])
        ), error

    refused(job(alice, 1), "priority")
    assert job(alice, 0).status_code == 201 and job(alice, -5).status_code == 201
    assert job(root, 100).status_code == 201
    refused(sweep(1), "base.priority")
    refused(sweep(0, {"priority": {"type": "int", "low": 0, "high": 3}}), "space.priority")
    refused(sweep(0, {"priority": {"type": "categorical", "choices": [0, 2]}}), "space.priority")
    assert sweep(0).status_code == 201
    # An admin grants alice up to 3: that much she may use, and no more.
    granted = api.client.put(f"{USERS}/alice/quota", json={"max_priority": 3}, headers=root)
    assert granted.status_code == 200, granted.text
    assert (granted.json()["max_priority"], granted.json()["effective_max_priority"]) == (3, 3)
    assert job(alice, 3).status_code == 201
    refused(job(alice, 4), "priority")
    assert sweep(3, {"priority": {"type": "int", "low": 0, "high": 3}}).status_code == 201
    refused(sweep(0, {"priority": {"type": "int", "low": 0, "high": 4}}), "space.priority")
    listed = {u["name"]: u for u in api.client.get(USERS, headers=root).json()["items"]}
    assert listed["root"]["effective_max_priority"] is None  # an admin: any
    bad = api.client.put(f"{USERS}/alice/quota", json={"max_priority": 101}, headers=root)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "max_priority"
    cleared = api.client.put(f"{USERS}/alice/quota", json={}, headers=root).json()
    assert (cleared["max_priority"], cleared["effective_max_priority"]) == (None, 0)
    refused(job(alice, 3), "priority")
