"""Requests per second per token: the bucket arithmetic, and 429s from the served app."""

from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path

import httpx
import pytest

from shoal.api import ratelimit
from shoal.api.app import create_app
from shoal.api.ratelimit import Buckets, client_address
from shoal.service.auth import create_token, revoke_token
from shoal.service.db.session import SessionFactory
from shoal.service.server import serving
from shoal.service.settings import Settings
from tests.api.conftest import Api


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_a_bucket_allows_its_burst_then_its_rate_and_says_how_long_to_wait() -> None:
    clock = Clock()
    buckets = Buckets(rate=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # empty: one more in 1/rate
    assert buckets.take("b") == 0.0  # callers are apart
    clock.now += 0.5
    assert buckets.take("a") == 0.0 and buckets.take("a") > 0
    clock.now += 60  # refills, up to the burst only
    assert [buckets.take("a") for _ in range(4)][-1] > 0


@pytest.mark.unit
def test_buckets_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "MAX_CALLERS", 3)
    buckets = Buckets(rate=1.0, burst=1, clock=Clock())
    for name in "abcd":
        buckets.take(name)
    assert buckets.take("a") == 0.0  # forgotten (the least recent), so it starts full


@pytest.mark.unit
@pytest.mark.parametrize(
    ("peer", "forwarded", "trusted", "expected"),
    [
        ("10.0.0.7", [], (), "10.0.0.7"),
        # From an untrusted peer the header is the client's word: ignored.
        ("10.0.0.7", ["1.2.3.4"], (), "10.0.0.7"),
        ("10.0.0.7", ["1.2.3.4"], ("192.168.0.0/16",), "10.0.0.7"),
        # From a trusted proxy: the address it appended (the last), not what the client
        # wrote before it.
        ("10.0.0.7", ["6.6.6.6, 1.2.3.4"], ("10.0.0.0/8",), "1.2.3.4"),
        # Through two trusted proxies, headers split over two lines.
        ("10.0.0.7", ["6.6.6.6, 1.2.3.4", "10.0.0.9"], ("10.0.0.0/8",), "1.2.3.4"),
        ("::1", ["2001:db8::5"], ("::1",), "2001:db8::5"),
    ],
)
def test_forwarded_addresses_count_only_from_trusted_proxies(
    peer: str, forwarded: list[str], trusted: tuple[str, ...], expected: str
) -> None:
    scope = {
        "client": (peer, 5000),
        "headers": [(b"x-forwarded-for", value.encode()) for value in forwarded]
        + [(b"forwarded", b"for=9.9.9.9"), (b"x-real-ip", b"9.9.9.9")],
    }
    networks = tuple(ipaddress.ip_network(t) for t in trusted)
    assert client_address(scope, networks) == expected


@pytest.mark.integration
def test_the_app_answers_429_past_a_tokens_rate_and_never_limits_health(api_limited: Api) -> None:
    alice, bob = api_limited.token("alice"), api_limited.token("bob")
    codes = [api_limited.client.get("/api/v1/jobs", headers=alice).status_code for _ in range(8)]
    assert codes[:5] == [200] * 5 and codes[-1] == 429
    refused = api_limited.client.get("/api/v1/jobs", headers=alice)
    assert int(refused.headers["Retry-After"]) >= 1 and "per user" in refused.json()["detail"]
    assert api_limited.client.get("/api/v1/jobs", headers=bob).status_code == 200
    for probe in ("/healthz", "/readyz", "/metrics"):
        answers = [api_limited.client.get(probe).status_code for _ in range(20)]
        assert answers == [200] * 20, (probe, answers)


@pytest.mark.integration
def test_every_token_of_a_user_in_every_accepted_form_spends_one_bucket(
    api_limited: Api,
) -> None:
    first = create_token(api_limited.factory, user="alice")
    second = create_token(api_limited.factory, user="alice")
    forms = [
        f"Bearer {first}",
        f"bearer {first}",
        f"BEARER    {first}   ",
        f"Bearer {second}",
        f"bEaReR {second}",
    ]  # five: the burst
    codes = [
        api_limited.client.get("/api/v1/jobs", headers={"Authorization": f}).status_code
        for f in forms
    ]
    assert codes == [200] * 5
    third = create_token(api_limited.factory, user="alice")
    refused = api_limited.client.get("/api/v1/jobs", headers={"Authorization": f"Bearer {third}"})
    assert refused.status_code == 429, (refused.status_code, refused.text)
    assert (
        api_limited.client.get("/api/v1/jobs", headers=api_limited.token("bob")).status_code == 200
    )


@pytest.mark.integration
def test_callers_without_a_valid_token_share_their_address_bucket(api_limited: Api) -> None:
    revoked = create_token(api_limited.factory, user="carol")
    revoke_token(api_limited.factory, revoked)
    strings = [None, "shoal_" + secrets.token_urlsafe(32), revoked, "x" * 300, "shoal_"]
    codes = []
    for token in [*strings, "shoal_" + secrets.token_urlsafe(32)]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        codes.append(api_limited.client.get("/api/v1/jobs", headers=headers).status_code)
    assert codes == [401] * 5 + [429], codes
    # A valid token is its user's, not its address's: still served.
    assert (
        api_limited.client.get("/api/v1/jobs", headers=api_limited.token("dan")).status_code == 200
    )


def _codes_by_forwarded_address(url: str, addresses: list[str]) -> list[int]:
    with httpx.Client(base_url=url) as client:
        return [
            client.get("/api/v1/jobs", headers={"X-Forwarded-For": a}).status_code
            for a in addresses
        ]


@pytest.mark.integration
def test_x_forwarded_for_names_the_caller_only_from_a_trusted_proxy(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """Served by uvicorn as `shoal up` serves it (which by itself believes the header from
    any local peer)."""
    for trusted in ([], ["127.0.0.0/8"]):
        settings = Settings(
            home=tmp_path,
            database_url="unused://",
            rate_limit_per_s=0.01,
            rate_limit_burst=3,
            trusted_proxies=trusted,
        )
        with serving(create_app(settings, session_factory)) as url:
            varied = _codes_by_forwarded_address(url, [f"203.0.113.{i}" for i in range(4)])
            same = _codes_by_forwarded_address(url, ["198.51.100.1"] * 4)
        if trusted:  # each forwarded address its own bucket
            assert varied == [401] * 4 and same == [401] * 3 + [429], (varied, same)
        else:  # one bucket: the peer's
            assert varied == [401] * 3 + [429] and same == [429] * 4, (varied, same)
