"""``GET /api/v1/stream`` on a real server over a real database: server-sent events of the
jobs a viewer may see, from one database poll for every viewer."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shoal.api.app import create_app
from shoal.service.auth import create_token, revoke_token
from shoal.service.db.session import SessionFactory
from shoal.service.server import serving
from shoal.service.settings import Settings
from tests.factories import job_spec

pytestmark = pytest.mark.integration

STREAM = "/api/v1/stream"


@pytest.fixture
def server(session_factory: SessionFactory, tmp_path: Path) -> Iterator[str]:
    settings = Settings(home=tmp_path, database_url="unused://", poll_interval_s=0.1)
    with serving(create_app(settings, session_factory), lifespan="on") as url:
        yield url


class Watcher:
    """A stream read on a thread of its own: its events, parsed, in a queue."""

    def __init__(self, url: str, token: str) -> None:
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.comments: list[str] = []
        self._client = httpx.Client(base_url=url, timeout=httpx.Timeout(30.0, read=60.0))
        self._headers = {"Authorization": f"Bearer {token}"}
        self.connected = threading.Event()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.connected.wait(10), "the stream did not open"

    def _read(self) -> None:
        try:
            with self._client.stream("GET", STREAM, headers=self._headers) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                kind = None
                for line in response.iter_lines():
                    if line.startswith(":"):
                        self.comments.append(line)
                        self.connected.set()
                    elif line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: ") and kind is not None:
                        self.events.put((kind, json.loads(line.removeprefix("data: "))))
        except httpx.HTTPError:
            return  # closed by the test
        finally:
            self.ended.set()

    def until(self, wanted: Any, timeout: float = 10.0) -> list[tuple[str, dict[str, Any]]]:
        """Events read until one satisfies ``wanted`` (which is last)."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                item = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append(item)
            if wanted(item):
                return seen
        raise AssertionError(f"not seen within {timeout} s; saw {seen}")

    def close(self) -> None:
        self._client.close()


def test_a_viewer_sees_its_jobs_change_live_and_nothing_of_others(
    server: str, session_factory: SessionFactory
) -> None:
    alice = create_token(session_factory, user="alice")
    bob = create_token(session_factory, user="bob")
    admin = create_token(session_factory, user="root", admin=True)
    viewers = {
        name: Watcher(server, token)
        for name, token in [("alice", alice), ("bob", bob), ("admin", admin)]
    }
    try:
        with httpx.Client(base_url=server) as client:
            r = client.post(
                "/api/v1/jobs", json=job_spec(), headers={"Authorization": f"Bearer {alice}"}
            )
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            seen = viewers["alice"].until(lambda e: e[0] == "event" and e[1]["job_id"] == job_id)
            rows = [data for kind, data in seen if kind == "job"]
            assert rows and rows[0]["id"] == job_id and rows[0]["state"] == "QUEUED"
            assert rows[0]["owner"] == "alice" and rows[0]["steps"] == job_spec()["steps"]
            assert seen[-1][1]["kind"] == "state"  # "submitted"

            cancel = client.post(
                f"/api/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {alice}"}
            )
            assert cancel.status_code == 200, cancel.text
            seen = viewers["alice"].until(lambda e: e[0] == "job" and e[1]["state"] == "CANCELLED")
            assert seen[-1][1]["id"] == job_id
            # The admin sees everyone's jobs; bob sees nothing of alice's.
            viewers["admin"].until(lambda e: e[0] == "job" and e[1]["state"] == "CANCELLED")
            time.sleep(0.5)  # a few more polls
            assert viewers["bob"].events.empty()
            assert viewers["bob"].comments == [": connected"]
    finally:
        for viewer in viewers.values():
            viewer.close()


def test_the_stream_needs_a_token(server: str) -> None:
    r = httpx.get(server + STREAM, timeout=10)
    assert r.status_code == 401 and "bearer" in r.json()["detail"]


@pytest.fixture
def server_caching_tokens_1s(session_factory: SessionFactory, tmp_path: Path) -> Iterator[str]:
    settings = Settings(
        home=tmp_path, database_url="unused://", poll_interval_s=0.1, auth_cache_s=1.0
    )
    with serving(create_app(settings, session_factory), lifespan="on") as url:
        yield url


def test_a_revoked_tokens_stream_ends_within_the_auth_cache_time(
    server_caching_tokens_1s: str, session_factory: SessionFactory
) -> None:
    revoked = create_token(session_factory, user="alice")
    kept = create_token(session_factory, user="alice")
    watchers = [Watcher(server_caching_tokens_1s, t) for t in (revoked, kept)]
    try:
        assert revoke_token(session_factory, revoked)
        started = time.monotonic()
        ended = watchers[0].ended.wait(5.0)
        took = time.monotonic() - started
        assert ended, f"the revoked token's stream was still open after 5 s: {watchers[0].comments}"
        assert took <= 1.0 + 1.0, f"it ended {took:.2f} s after the revocation (cache: 1 s)"
        assert watchers[0].comments[-1].startswith(": the token was revoked")
        assert not watchers[1].ended.is_set()  # the same user's other token watches on
        again = httpx.get(
            server_caching_tokens_1s + STREAM,
            headers={"Authorization": f"Bearer {revoked}"},
            timeout=10,
        )
        assert again.status_code == 401
    finally:
        for watcher in watchers:
            watcher.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # a timer, not the database
def test_an_idle_stream_sends_a_keep_alive_comment_every_15_s(
    server: str, session_factory: SessionFactory
) -> None:
    watcher = Watcher(server, create_token(session_factory, user="alice"))
    opened = time.monotonic()
    try:
        while ": keep-alive" not in watcher.comments and time.monotonic() - opened < 25:
            time.sleep(0.1)
        waited = time.monotonic() - opened
        assert watcher.comments == [": connected", ": keep-alive"], (waited, watcher.comments)
        assert 14 <= waited <= 20, waited  # not sooner: proxies need one, clients no chatter
    finally:
        watcher.close()
