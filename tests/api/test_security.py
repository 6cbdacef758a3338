"""Security headers on every answer, the dashboard's CSP, Swagger UI from the package, and
the DNS-rebinding guard of an API without auth."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.security import is_loopback_host
from shoal.service.db.session import SessionFactory
from shoal.service.settings import Settings
from tests.api.conftest import Api


@pytest.mark.integration
def test_every_answer_carries_the_security_headers(api: Api) -> None:
    admin = api.token("root", admin=True)
    answers = {
        "health": api.client.get("/healthz"),
        "list": api.client.get("/api/v1/jobs", headers=admin),
        "401": api.client.get("/api/v1/jobs"),
        "404": api.client.get("/api/v1/jobs/nope", headers=admin),
        "422": api.client.post("/api/v1/jobs", json={}, headers=admin),
        "no route": api.client.get("/nowhere"),
        "metrics": api.client.get("/metrics"),
        "openapi": api.client.get("/api/v1/openapi.json"),
        "docs": api.client.get("/api/v1/docs"),
        "dashboard": api.client.get("/"),
        "script": api.client.get("/static/shoal.js"),
    }
    for name, answer in answers.items():
        assert answer.headers.get("x-content-type-options") == "nosniff", name
        assert answer.headers.get("referrer-policy") == "no-referrer", name
        assert answer.headers.get("x-frame-options") == "DENY", name


@pytest.mark.integration
def test_the_dashboard_has_a_csp_its_page_satisfies(api: Api) -> None:
    page = api.client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    html = page.text
    # Nothing inline a CSP without 'unsafe-inline' would block: scripts come from files,
    # styles from the stylesheet, no on* handler attributes.
    assert all("src=" in tag for tag in re.findall(r"<script[^>]*>", html))
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"\son[a-z]+=", html)
    dashboard = Path(__file__).parents[2] / "api" / "dashboard"
    for module in dashboard.glob("*.js"):
        code = module.read_text()
        assert "innerHTML" not in code and "eval(" not in code, module.name
        assert 'setAttribute("style"' not in code and "setAttribute('style'" not in code


@pytest.mark.integration
def test_the_api_docs_load_nothing_from_another_site(api: Api) -> None:
    page = api.client.get("/api/v1/docs")
    assert page.status_code == 200
    assert "http://" not in page.text and "https://" not in page.text, page.text
    assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    for asset in assets:
        answer = api.client.get(asset)
        assert answer.status_code == 200 and len(answer.content) > 100, asset


@pytest.mark.unit
@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST:8000", True),
        ("127.0.0.1", True),
        ("127.0.0.1:8000", True),
        ("127.3.2.1:1", True),
        ("[::1]", True),
        ("[::1]:8000", True),
        (None, False),
        ("", False),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io", False),
        ("10.0.0.1:8000", False),
        ("[::2]:8000", False),
        ("[::1]x", False),
        ("localhost:80x", False),
        ("::1", False),  # not a Host: an IPv6 address is bracketed
    ],
)
def test_loopback_host_names(host: str | None, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.fixture
def no_auth(session_factory: SessionFactory, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        home=tmp_path, database_url="unused://", auth=False, host="127.0.0.1", port=8000
    )
    app = create_app(settings, session_factory)
    with TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as c:
        yield c


@pytest.mark.integration
def test_without_auth_a_request_to_a_non_loopback_host_is_refused(no_auth: TestClient) -> None:
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "localhost"):
        answer = no_auth.get("/api/v1/jobs", headers={"Host": host})
        assert answer.status_code == 200, (host, answer.text)
    for host in ("rebind.evil.example:8000", "rebind.evil.example", "192.168.1.5:8000"):
        for path in ("/api/v1/jobs", "/", "/healthz"):
            answer = no_auth.get(path, headers={"Host": host})
            assert answer.status_code == 400, (host, path, answer.status_code)
            detail = answer.json()["detail"]
            assert "loopback" in detail and "SHOAL_AUTH" in detail, detail
            assert answer.headers["x-content-type-options"] == "nosniff"
    submitted = no_auth.post("/api/v1/jobs", json={}, headers={"Host": "evil.example:8000"})
    assert submitted.status_code == 400
