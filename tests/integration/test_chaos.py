"""Faults the service must ride out, end to end on `shoal up`: the database server restarting
under a running job (PostgreSQL). The job ends SUCCEEDED with the loss curve of an undisturbed
run of the same spec, every step stored once, and a submission made while the database was
down is acknowledged once it is back, never lost, never doubled.

The other faults are tested where they live: a node SIGKILLed or drained mid-run
(test_elastic.py), the control plane SIGKILLed and restarted (test_shoal_up.py), a device lost
under a sweep (test_sweeps.py)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from service.client import ShoalClient
from tests.integration.conftest import wait_until
from tests.integration.test_shoal_up import Api, StartShoal, admin_token, example_spec

pytestmark = pytest.mark.integration


def restart_postgres() -> None:
    """Restart the machine's PostgreSQL server: every connection is cut, then it is back."""
    (version,) = os.listdir("/etc/postgresql")
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.skipif(not Path("/etc/postgresql").is_dir(), reason="no local PostgreSQL server")
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_database_restart_mid_run_loses_nothing(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    shoal = shoal_up(tmp_path / "home", empty_database)
    token = admin_token(shoal)
    api = Api(shoal, token)
    steps = 200
    spec = example_spec(name="through-a-restart", steps=steps, checkpoint={"every_steps": 50})
    with ShoalClient(shoal.url, token) as client:
        job_id = client.submit_job(spec, idempotency_key="chaos-1")["id"]
        runner_reaper.append(job_id)
        api.wait_state(job_id, lambda j: j["step"] >= 5, "the job to train")

        # A submission while the server restarts: the client retries a 503 (its key makes
        # that safe); it must end acknowledged, once.
        late: dict[str, object] = {}
        during = threading.Thread(
            target=lambda: late.update(
                client.submit_job(example_spec(name="late", steps=5), idempotency_key="chaos-2")
            )
        )
        restarting = threading.Thread(target=restart_postgres)
        restarting.start()
        during.start()
        restarting.join(150)
        during.join(60)
    assert late.get("name") == "late", "a submission made during the restart was lost"
    runner_reaper.append(str(late["id"]))
    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")
    assert job["step"] == steps and job["attempt"] == 1 and job["error"] is None
    metrics = api.items(job_id, "metrics")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))

    # The same spec, undisturbed: the same curve, bitwise.
    ref = httpx.post(
        f"{shoal.url}/api/v1/jobs",
        json={**spec, "name": "undisturbed"},
        headers=api.headers,
        timeout=30,
    ).json()["id"]
    runner_reaper.append(ref)
    api.wait_state(ref, lambda j: j["state"] == "SUCCEEDED", "the reference to succeed")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in api.items(ref, "metrics")]
    names = [j["name"] for j in api.get("/jobs", limit=50)["items"]]
    assert sorted(names) == ["late", "through-a-restart", "undisturbed"]
    wait_until(lambda: api.job(str(late["id"]))["state"] == "SUCCEEDED", 120, "the late job")
