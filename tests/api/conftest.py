"""An API client over a real database (SQLite and PostgreSQL), without a controller."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.service.auth import create_token
from shoal.service.db.session import SessionFactory
from shoal.service.settings import Settings


@dataclass
class Api:
    client: TestClient
    factory: SessionFactory
    settings: Settings

    def token(self, user: str, *, admin: bool = False, code: bool = False) -> dict[str, str]:
        secret = create_token(self.factory, user=user, admin=admin, code=code)
        return {"Authorization": f"Bearer {secret}"}


def _serve(factory: SessionFactory, settings: Settings) -> Iterator[Api]:
    with TestClient(create_app(settings, factory), raise_server_exceptions=False) as c:
        yield Api(c, factory, settings)


@pytest.fixture
def api(session_factory: SessionFactory, tmp_path: Path) -> Iterator[Api]:
    """No rate limit here: tests send requests far faster than any client would."""
    settings = Settings(
        home=tmp_path,
        database_url="unused://",
        max_body_bytes=64 * 1024,
        max_page_size=100,
        rate_limit_per_s=None,
    )
    yield from _serve(session_factory, settings)


@pytest.fixture
def api_limited(session_factory: SessionFactory, tmp_path: Path) -> Iterator[Api]:
    """Bursts of five requests per token, refilled at one request per 100 s: no bucket
    refills within a test, however slowly the machine serves it (at 1 per second, five
    requests and a token's creation outlasted a refill on a loaded CI machine)."""
    settings = Settings(
        home=tmp_path, database_url="unused://", rate_limit_per_s=0.01, rate_limit_burst=5
    )
    yield from _serve(session_factory, settings)
