"""A served Shoal with live training, and Debian's chromium driven by Playwright.

The browser is the machine's (``SHOAL_CHROMIUM``, default ``/usr/bin/chromium``): Playwright
never downloads one. Without it these tests skip, unless ``SHOAL_REQUIRE_BROWSER`` is set
(CI sets it: there a missing browser is a failure).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shoal.api.app import create_app
from shoal.scheduler.devices import DEVICE_RESOURCE, LABEL_KIND, LABEL_SLOWDOWN, LABEL_SPOT
from shoal.service.auth import create_token
from shoal.service.cluster import InProcessCluster, NodeInfo
from shoal.service.controller import Controller, ControllerConfig
from shoal.service.db.session import SessionFactory, make_engine, make_session_factory, migrate
from shoal.service.server import serving
from shoal.service.settings import Settings

CHROMIUM = Path(os.environ.get("SHOAL_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("SHOAL_TEST_ARTIFACTS", "build/test-artifacts")) / "dashboard"

FAST = NodeInfo("a" * 56, True, {DEVICE_RESOURCE: 2.0}, {LABEL_KIND: "cpu"})
SLOW = NodeInfo(
    "b" * 56,
    True,
    {DEVICE_RESOURCE: 1.0},
    {LABEL_KIND: "cpu-slow", LABEL_SLOWDOWN: "4", LABEL_SPOT: "true"},
)
"""Two nodes: two devices, and one spot device four times slower."""


@dataclass(frozen=True)
class Shoal:
    url: str
    token: str
    """An admin's."""
    factory: SessionFactory

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def shoal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shoal]:
    home = tmp_path_factory.mktemp("shoal")
    database = f"sqlite:///{home / 'shoal.db'}"
    migrate(database)
    factory = make_session_factory(make_engine(database))
    controller = Controller(
        factory,
        InProcessCluster([FAST, SLOW]),
        ControllerConfig(checkpoint_root=str(home / "checkpoints"), poll_interval_s=0.2),
    )
    settings = Settings(home=home, database_url=database, poll_interval_s=0.2)
    token = create_token(factory, user="root", admin=True)
    with serving(create_app(settings, factory, controller), lifespan="on") as url:
        yield Shoal(url, token, factory)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        why = f"no chromium at {CHROMIUM} (apt-get install chromium, or set SHOAL_CHROMIUM)"
        if os.environ.get("SHOAL_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where chromium's sandbox cannot start.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


class Console:
    """Every console error and uncaught exception of a page: a test ends with none."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))


@pytest.fixture
def expected_errors() -> list[str]:
    """Console errors a test provokes on purpose (a refused token's 401), by substring."""
    return []


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, expected_errors: list[str]) -> Iterator[Any]:
    """A fresh laptop-sized tab; its screenshot is saved as an artifact when the test ends,
    and the test fails on any console error it did not expect."""
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    tab = context.new_page()
    console = Console(tab)
    try:
        yield tab
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        tab.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        context.close()
    unexpected = [e for e in console.errors if not any(x in e for x in expected_errors)]
    assert unexpected == [], unexpected


def snap(page: Any, name: str) -> None:
    """A screenshot of the page as it is now: ``pages/NAME.png`` among the artifacts (the
    README's and docs/user-guide.md's pictures are these, ``make screenshots``)."""
    (ARTIFACTS / "pages").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "pages" / f"{name}.png"), full_page=True)


def sign_in(page: Any, shoal: Shoal, hash: str = "") -> None:
    page.goto(f"{shoal.url}/{hash}")
    page.get_by_label("Access token").fill(shoal.token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("navigation", name="Pages").wait_for()
