"""Requests per second per token: the bucket arithmetic, and 429s from the served app."""

from __future__ import annotations

import pytest

from api import ratelimit
from api.ratelimit import Buckets, caller
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
def test_callers_are_hashed_tokens_or_addresses_and_memory_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = caller({"headers": [(b"authorization", b"Bearer shoal_secret")]})
    assert token.startswith("token:") and "shoal_secret" not in token
    assert caller({"headers": [], "client": ("10.0.0.7", 5000)}) == "address:10.0.0.7"
    monkeypatch.setattr(ratelimit, "MAX_CALLERS", 3)
    buckets = Buckets(rate=1.0, burst=1, clock=Clock())
    for name in "abcd":
        buckets.take(name)
    assert buckets.take("a") == 0.0  # forgotten (the least recent), so it starts full


@pytest.mark.integration
def test_the_app_answers_429_past_a_tokens_rate_and_never_limits_health(api_limited: Api) -> None:
    alice, bob = api_limited.token("alice"), api_limited.token("bob")
    codes = [api_limited.client.get("/api/v1/jobs", headers=alice).status_code for _ in range(8)]
    assert codes[:5] == [200] * 5 and codes[-1] == 429
    refused = api_limited.client.get("/api/v1/jobs", headers=alice)
    assert int(refused.headers["Retry-After"]) >= 1 and "per token" in refused.json()["detail"]
    assert api_limited.client.get("/api/v1/jobs", headers=bob).status_code == 200
    assert all(api_limited.client.get("/healthz").status_code == 200 for _ in range(20))
