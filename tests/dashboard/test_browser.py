"""The dashboard in a real browser: sign in, a job's curve moving live, the pipeline picture
naming the slow device, cancel, the device pool, a sweep's trials compared. Every page ends
with no console error; screenshots are saved as artifacts (``SHOAL_TEST_ARTIFACTS``)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import Shoal, sign_in, snap
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration


def post(shoal: Shoal, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(f"{shoal.url}/api/v1{path}", json=body, headers=shoal.headers, timeout=30)
    assert r.status_code in (200, 201), r.text
    result: dict[str, Any] = r.json()
    return result


def get(shoal: Shoal, path: str) -> dict[str, Any]:
    r = httpx.get(f"{shoal.url}/api/v1{path}", headers=shoal.headers, timeout=30)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


@contextmanager
def cancelled_after(shoal: Shoal, job_id: str) -> Iterator[None]:
    """Cancel the job when the body ends, failed or not: a job left running would hold
    its devices from the tests after this one."""
    try:
        yield
    finally:
        if get(shoal, f"/jobs/{job_id}")["state"] in ("QUEUED", "RUNNING"):
            post(shoal, f"/jobs/{job_id}/cancel")


def three_stage_job(shoal: Shoal, name: str) -> str:
    """A long job over all three devices, the slow one included, never re-cut."""
    spec = job_spec(
        name=name,
        steps=50_000,  # runs until the test cancels it
        micro_batches=4,
        checkpoint={"every_steps": 5000, "keep": 1},
        parallelism={"stages": 3, "replicas": 1},
        resources={"min_devices": 3, "max_devices": 3},
        elastic={"repartition": False},
    )
    job_id: str = post(shoal, "/jobs", spec)["id"]
    until(lambda: get(shoal, f"/jobs/{job_id}")["step"] >= 2, 120, "the job trains")
    return job_id


def test_signing_in_needs_a_valid_token_which_never_enters_the_url(
    page: Any, shoal: Shoal, expected_errors: list[str]
) -> None:
    expected_errors.append("status of 401")  # the refused token's request
    queued = post(
        shoal, "/jobs", job_spec(name="signin-job", resources={"min_devices": 9, "max_devices": 9})
    )
    page.goto(shoal.url)
    page.get_by_label("Access token").fill("shoal_not-a-real-token")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("That token was refused").wait_for()
    assert page.get_by_role("navigation", name="Pages").is_hidden()

    sign_in(page, shoal)
    page.locator(f'tr[data-job="{queued["id"]}"]').wait_for()
    row = page.locator(f'tr[data-job="{queued["id"]}"]')
    assert "signin-job" in row.inner_text() and "QUEUED" in row.inner_text()
    assert page.locator("#signin").is_hidden() and shoal.token not in page.url
    assert page.evaluate("sessionStorage.getItem('shoal-token')") == shoal.token
    assert page.get_by_label("Access token").get_attribute("type") == "password"
    post(shoal, f"/jobs/{queued['id']}/cancel")


def test_a_running_jobs_curve_moves_live_its_pipeline_shows_the_slow_device_and_it_cancels(
    page: Any, shoal: Shoal
) -> None:
    job_id = three_stage_job(shoal, "live-job")
    with cancelled_after(shoal, job_id):
        watch_a_running_job(page, shoal, job_id)


def watch_a_running_job(page: Any, shoal: Shoal, job_id: str) -> None:
    sign_in(page, shoal)
    row = page.locator(f'tr[data-job="{job_id}"]')
    row.get_by_text("RUNNING").wait_for()
    row.get_by_role("link", name="live-job").click()
    loss = page.locator("#loss-chart polyline.series")
    loss.wait_for()
    points = lambda: len(loss.get_attribute("points").split())  # noqa: E731
    first = points()
    # New steps drawn without a reload: the stream said the job moved. (Polled from here:
    # wait_for_function evaluates a string, which the dashboard's CSP forbids.)
    until(lambda: points() > first, 30, "new steps drawn")
    assert points() > first

    pipeline = page.locator("#pipeline tbody tr")
    until(lambda: pipeline.count() == 3, 30, "three stages drawn")
    # The latest step's timings, live: a stage on a fast device can read slowest in a step
    # where its cores were taken (three stages share two), so the badge settles on the slow
    # device's stage within some steps.
    slowest = page.locator("#pipeline tr.slowest")
    until(lambda: "cpu-slow" in " ".join(slowest.all_inner_texts()), 60, "cpu-slow slowest")
    assert "slowest stage" in slowest.inner_text()
    grid = page.locator("#schedule tbody tr")
    assert grid.count() == 3
    assert page.locator("#schedule td.op-F").count() == 3 * 4  # 1F1B, 4 micro-batches
    caption = page.locator("#schedule caption").inner_text()
    assert caption.startswith("1F1B, 3 stages") and "4 micro-batches" in caption
    page.get_by_text("placement").first.wait_for()  # the event timeline
    # MFU beside samples/s, and per step: the MLP's FLOPs over its CPU devices' measured peaks.
    summary = page.locator("#job-summary")
    until(lambda: "MFU" in summary.inner_text(), 30, "the job's MFU shown")
    assert re.search(r"samples/s · MFU \d[\d.]*%", summary.inner_text()), summary.inner_text()
    page.get_by_role("img", name="Model FLOPs utilization per step").wait_for()
    snap(page, "job")

    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Confirm: cancel this job").click()
    page.locator("#job-summary .badge", has_text="CANCELLED").wait_for(timeout=60_000)
    assert get(shoal, f"/jobs/{job_id}")["state"] == "CANCELLED"


def test_the_jobs_table_filters_by_state_and_text(page: Any, shoal: Shoal) -> None:
    for name in ("filter-alpha", "filter-beta"):
        job = post(
            shoal, "/jobs", job_spec(name=name, resources={"min_devices": 9, "max_devices": 9})
        )
        post(shoal, f"/jobs/{job['id']}/cancel")
    sign_in(page, shoal)
    rows = page.locator("#jobs-table tbody tr")
    rows.first.wait_for()
    page.get_by_label("Search").fill("filter-al")
    until(lambda: rows.count() == 1, 5, "one job matches")
    assert "filter-alpha" in rows.first.inner_text()
    page.get_by_label("Search").fill("")
    page.get_by_label("State").select_option("CANCELLED")
    until(lambda: rows.count() >= 2, 5, "cancelled jobs listed")
    assert all("CANCELLED" in r for r in rows.all_inner_texts())


def test_the_devices_page_shows_nodes_spot_memory_held_jobs_and_draining(
    page: Any, shoal: Shoal
) -> None:
    spec = job_spec(
        name="devices-job",
        steps=50_000,  # runs until the test cancels it
        checkpoint={"every_steps": 5000, "keep": 1},
        parallelism={"stages": 2, "replicas": 1},
        resources={"min_devices": 2, "max_devices": 2, "device_kind": "cpu"},
    )
    job_id = post(shoal, "/jobs", spec)["id"]
    with cancelled_after(shoal, job_id):
        see_devices(page, shoal, job_id)


def see_devices(page: Any, shoal: Shoal, job_id: str) -> None:
    until(lambda: get(shoal, f"/jobs/{job_id}")["step"] >= 1, 120, "the job trains")
    devices = get(shoal, "/devices")["items"]
    slow = next(d for d in devices if d["kind"] == "cpu-slow")
    post(shoal, f"/devices/{slow['id']}/drain")

    sign_in(page, shoal, "#/devices")
    page.locator("section.node").nth(1).wait_for()
    assert page.locator("section.node").count() == 2
    assert "on-demand" in page.locator("section.node").first.inner_text()
    row = page.locator(f'tr[data-device="{slow["id"]}"]').inner_text()
    assert "DRAINING" in row and "drained by" in row and "spot" in row and "idle" in row
    holding = [d["id"] for d in get(shoal, "/devices")["items"] if d["job_id"] == job_id]
    assert len(holding) == 2
    for device in holding:
        held = page.locator(f'tr[data-device="{device}"]')
        assert held.get_by_role("link", name=job_id[:8]).is_visible()
        assert "KiB /" in held.inner_text()  # the stage's planned bytes, of 2.0 GiB
    snap(page, "devices")


def test_a_sweeps_trials_are_compared_on_its_page(page: Any, shoal: Shoal) -> None:
    spec = sweep_spec(name="browser-sweep", max_trials=4, max_concurrent=2)
    sweep_id = post(shoal, "/sweeps", spec)["id"]
    until(lambda: get(shoal, f"/sweeps/{sweep_id}")["state"] == "SUCCEEDED", 240, "the sweep")
    sweep = get(shoal, f"/sweeps/{sweep_id}")

    sign_in(page, shoal, "#/sweeps")
    page.get_by_role("link", name="browser-sweep").click()
    trials = page.locator("#trials-table tbody tr")
    trials.first.wait_for()
    assert trials.count() == 4
    best = sweep["best"]["number"]
    assert f"Best: trial {best}" in page.locator("#best-trial").inner_text()
    assert "best" in (page.locator(f'tr[data-trial="{best}"]').get_attribute("class") or "")
    curves = page.locator("figure.chart").first.locator("polyline.series")
    assert curves.count() == sum(1 for t in sweep["trials"] if t["intermediate"])
    assert page.locator("circle.point").count() == 4
    assert page.get_by_label("Hyperparameter").input_value() == "optimizer.lr"
    snap(page, "sweep")
    page.get_by_role("link", name="Jobs").click()  # the trials are jobs too
    page.locator(f'tr[data-job="{sweep["best"]["job_id"]}"]').wait_for()
    snap(page, "jobs")


def test_the_api_docs_render_from_the_server_alone(page: Any, shoal: Shoal) -> None:
    elsewhere: list[str] = []
    page.on("request", lambda r: r.url.startswith(shoal.url) or elsewhere.append(r.url))
    page.goto(f"{shoal.url}/api/v1/docs")
    page.locator(".swagger-ui .info .title").wait_for(timeout=30_000)
    assert "Shoal" in page.locator(".swagger-ui .info .title").inner_text()
    page.locator(".opblock-tag", has_text="jobs").first.wait_for()
    assert elsewhere == [], elsewhere  # no CDN: every asset came from the package
