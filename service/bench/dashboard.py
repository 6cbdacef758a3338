"""``shoal bench dashboard``: how long the jobs page takes to show many jobs in a real browser.

A scratch database gets ``jobs`` jobs in every state (with steps, losses and throughputs);
the control plane serves it on loopback (no controller: nothing trains); chromium, driven
by Playwright, opens the jobs page signed in, ``repeats`` times in fresh tabs. Measured:
from navigation start to every job's row in the table (``performance.now()`` in the page),
and the peer in the same run: the REST request that lists the jobs, timed alone.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from shoal.service.bench.data import fill
from shoal.service.bench.report import BenchError
from shoal.service.db.session import make_engine, make_session_factory
from shoal.service.settings import Settings


class BrowserMissing(BenchError):
    """No chromium or no Playwright: the message says what to install."""


def _browser(chromium: Path) -> Any:
    if not chromium.exists():
        raise BrowserMissing(
            f"no chromium at {chromium}: install it (apt-get install chromium) or pass --chromium"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise BrowserMissing(
            "Playwright is not installed: pip install playwright (no browser download is"
            " needed: the machine's chromium is used)"
        ) from None
    return sync_playwright()


def run_dashboard_bench(
    jobs: int, repeats: int, chromium: Path, progress: Any = lambda _name: None
) -> dict[str, Any]:
    """Medians (and every run) of the jobs page's time to show ``jobs`` rows, and of the
    list request alone."""
    from shoal.api.app import create_app
    from shoal.service.bench.report import machine
    from shoal.service.server import serving

    playwright = _browser(chromium)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-dashboard-") as tmp:
        progress(f"writing {jobs} jobs")
        database = f"sqlite:///{Path(tmp) / 'shoal.db'}"
        token = fill(database, jobs, admin=True).token
        factory = make_session_factory(make_engine(database))
        settings = Settings(home=Path(tmp), database_url=database)
        with serving(create_app(settings, factory), lifespan="on") as url, playwright as pw:
            progress("timing the list request")
            api_ms = _time_list(url, token, repeats)
            progress("timing the jobs page")
            browser = pw.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
            try:
                page_ms = [_time_page(browser, url, token, jobs) for _ in range(repeats)]
            finally:
                browser.close()
    return {
        "jobs": jobs,
        "repeats": repeats,
        "page_ready_ms": statistics.median(page_ms),
        "page_ready_ms_runs": page_ms,
        "list_request_ms": statistics.median(api_ms),
        "list_request_ms_runs": api_ms,
        "chromium": str(chromium),
        "machine": machine(),
    }


def _time_list(url: str, token: str, repeats: int) -> list[float]:
    """The jobs list as the page requests it, page by page, timed on its own."""
    times = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
        for _ in range(repeats):
            started, offset, total = time.perf_counter(), 0, 1
            while offset < total:
                page = client.get(f"/api/v1/jobs?limit=500&offset={offset}").json()
                offset, total = offset + page["limit"], page["total"]
            times.append(round((time.perf_counter() - started) * 1000, 1))
    return times


def _time_page(browser: Any, url: str, token: str, jobs: int) -> float:
    """A fresh tab, already signed in: navigation start to ``jobs`` rows in the table."""
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    try:
        context.add_init_script(f"sessionStorage.setItem('shoal-token', {token!r})")
        page = context.new_page()
        page.goto(f"{url}/#/jobs")
        ready = page.wait_for_function(
            f"document.querySelectorAll('#jobs-table tbody tr').length === {jobs}"
            " && performance.now()",
            timeout=60_000,
        )
        return round(float(ready.json_value()), 1)
    finally:
        context.close()
