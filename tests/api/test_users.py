"""``/api/v1/users``: an admin sees every user's quota and holdings and sets limits."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api

pytestmark = pytest.mark.integration

USERS = "/api/v1/users"


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
