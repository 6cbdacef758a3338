"""Who may do what, over every route that names a job or a sweep, read from the app's own
OpenAPI schema (a new route is covered the day it is added): the owner and admins reach it;
another user gets the very 404 an unknown id gets (so ids cannot be probed); no token, a
wrong one or a revoked one gets 401."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.service.auth import PrincipalCache, revoke_token
from tests.api.conftest import Api
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration

UNKNOWN = "0123456789abcdef0123456789abcdef"


def operations(api: Api) -> list[tuple[str, str, str]]:
    """(method, path template, the id parameter) of every operation naming a job or sweep."""
    schema = api.client.get("/api/v1/openapi.json").json()
    found = []
    for path, item in schema["paths"].items():
        for method in item:
            for name in ("job_id", "sweep_id"):
                if f"{{{name}}}" in path:
                    found.append((method.upper(), path, name))
    return found


def call(api: Api, method: str, path: str, headers: dict[str, str]) -> Any:
    return api.client.request(method, path, headers=headers)


def test_every_owned_route_is_the_owners_and_admins_and_a_404_to_others(api: Api) -> None:
    alice, bob, root = api.token("alice"), api.token("bob"), api.token("root", admin=True)
    ids = {
        "job_id": api.client.post("/api/v1/jobs", json=job_spec(), headers=alice).json()["id"],
        "sweep_id": api.client.post("/api/v1/sweeps", json=sweep_spec(), headers=alice).json()[
            "id"
        ],
    }
    ops = operations(api)
    assert {(m, p) for m, p, _ in ops} >= {
        ("GET", "/api/v1/jobs/{job_id}"),
        ("POST", "/api/v1/jobs/{job_id}/cancel"),
        ("GET", "/api/v1/jobs/{job_id}/checkpoints"),
        ("GET", "/api/v1/sweeps/{sweep_id}"),
        ("POST", "/api/v1/sweeps/{sweep_id}/cancel"),
    }
    # Reads first, then the actions that change state (cancel, restart).
    for method, template, name in sorted(ops, key=lambda op: op[0] != "GET"):
        path = template.replace(f"{{{name}}}", ids[name])
        unknown = template.replace(f"{{{name}}}", UNKNOWN)
        theirs = call(api, method, path, bob)
        never = call(api, method, unknown, bob)
        assert theirs.status_code == never.status_code == 404, (method, template, theirs.text)
        assert theirs.json()["detail"].replace(ids[name], UNKNOWN) == never.json()["detail"]
        for who in (alice, root):
            answer = call(api, method, path, who)
            assert answer.status_code not in (401, 403, 404), (method, template, answer.text)
        assert call(api, method, path, {}).status_code == 401


def test_lists_show_a_user_only_their_own_and_admins_everything(api: Api) -> None:
    alice, bob, root = api.token("alice"), api.token("bob"), api.token("root", admin=True)
    api.client.post("/api/v1/jobs", json=job_spec(), headers=alice)
    api.client.post("/api/v1/sweeps", json=sweep_spec(), headers=alice)
    for listing in ("/api/v1/jobs", "/api/v1/sweeps"):
        assert api.client.get(listing, headers=bob).json()["total"] == 0
        assert api.client.get(listing, headers=alice).json()["total"] == 1
        assert api.client.get(listing, headers=root).json()["total"] == 1


def test_a_revoked_or_malformed_token_is_refused_everywhere_but_health(api: Api) -> None:
    now, ttl = [0.0], api.settings.auth_cache_s
    api.client.app.state.principals = PrincipalCache(ttl, clock=lambda: now[0])
    alice = api.token("alice")
    token = alice["Authorization"].removeprefix("Bearer ")
    assert api.client.get("/api/v1/jobs", headers=alice).status_code == 200
    assert revoke_token(api.factory, token)
    # The API remembers whom the token belongs to for `auth_cache_s` from its lookup (its
    # use since does not extend that), then asks the database again and refuses it.
    now[0] = ttl - 0.1
    assert api.client.get("/api/v1/jobs", headers=alice).status_code == 200
    now[0] = ttl
    for headers in (
        alice,
        {"Authorization": f"Bearer {token}x"},
        {"Authorization": token},  # no scheme
        {"Authorization": "Basic YWxpY2U6cHc="},
        {"Authorization": "Bearer " + "shoal_" + "a" * 500},
    ):
        for path in ("/api/v1/jobs", "/api/v1/sweeps", "/api/v1/devices", "/api/v1/stream"):
            answer = api.client.get(path, headers=headers)
            assert answer.status_code == 401, (path, headers, answer.text)
    assert api.client.get("/healthz").status_code == 200
    assert api.client.get("/readyz").status_code == 200
