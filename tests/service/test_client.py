"""The API client's retries: a 503 (the server's database out of reach, nothing changed)
is repeated for reads and for submissions carrying an idempotency key, never for others;
an exported model is written whole or not at all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shoal.service import client as client_module
from shoal.service.client import RETRY_WAITS_S, ApiError, ShoalClient

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_WAITS_S", (0.0,) * len(RETRY_WAITS_S))


UNAVAILABLE = {"detail": "the database is unreachable; nothing was changed, retry", "errors": []}


def flaky(failures: int, calls: list[httpx.Request]) -> httpx.MockTransport:
    """Answers 503 (Retry-After: 0) ``failures`` times, then 200."""

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= failures:
            return httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "0"})
        return httpx.Response(200, json={"id": "j1", "items": [], "total": 0})

    return httpx.MockTransport(answer)


@pytest.mark.parametrize("key", ["k-1", None])
def test_reads_and_keyed_submissions_are_retried_through_503s(key: str | None) -> None:
    calls: list[httpx.Request] = []
    with ShoalClient("http://shoal", "t", transport=flaky(2, calls)) as client:
        if key is None:
            assert client.list_jobs()["total"] == 0
        else:
            assert client.submit_job({"name": "x"}, idempotency_key=key)["id"] == "j1"
    assert len(calls) == 3
    assert all(c.headers.get("Idempotency-Key") == key for c in calls if key)


def test_a_submission_without_a_key_is_never_repeated() -> None:
    calls: list[httpx.Request] = []
    with (
        ShoalClient("http://shoal", "t", transport=flaky(1, calls)) as client,
        pytest.raises(ApiError) as refused,
    ):
        client.submit_job({"name": "x"})
    assert refused.value.status == 503 and len(calls) == 1


def test_retries_give_up_with_the_servers_message() -> None:
    calls: list[httpx.Request] = []
    with (
        ShoalClient("http://shoal", "t", transport=flaky(99, calls)) as client,
        pytest.raises(ApiError, match="database is unreachable"),
    ):
        client.list_jobs()
    assert len(calls) == 1 + len(RETRY_WAITS_S)


class _Broken(httpx.SyncByteStream):
    """A body whose connection drops after its first chunk."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"x" * 1024
        raise httpx.ReadError("connection reset")


def test_an_export_is_retried_through_503s_and_written_whole_or_not_at_all(
    tmp_path: Path,
) -> None:
    calls: list[httpx.Request] = []
    dest = tmp_path / "m.safetensors"

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "0"})
        if len(calls) == 2:
            return httpx.Response(200, stream=_Broken())
        return httpx.Response(200, content=b"model bytes")

    with ShoalClient("http://shoal", "t", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(ApiError, match="failed: connection reset"):
            client.export_model("j1", dest, step=10)  # the 503 retried, then the drop
        assert list(dest.parent.iterdir()) == []  # nothing half-written
        assert client.export_model("j1", dest) == len(b"model bytes")
    assert dest.read_bytes() == b"model bytes" and list(dest.parent.iterdir()) == [dest]
    assert [dict(c.url.params) for c in calls] == [{"step": "10"}, {"step": "10"}, {}]
