"""A placed job's layout as the dashboard draws it: ``GET /jobs/{id}/schedule`` (the grid its
stages run) and the devices' memory held (``GET /devices``), from the same scheduler code
that chose the layout."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.scheduler.memory import in_flight, stage_memory
from shoal.service.db.models import Job
from shoal.service.jobs import transition
from shoal.service.lifecycle import JobState
from shoal.service.snapshots import block_costs
from tests.api.conftest import Api
from tests.api.test_devices import add_device
from tests.factories import job_spec

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"


def placed(api: Api, who: dict[str, str], partition: list[dict[str, Any]], **spec: Any) -> str:
    """A RUNNING job whose stages sit on ``partition``'s devices."""
    resources = {"min_devices": 1, "max_devices": len(partition)}
    answer = api.client.post(JOBS, json=job_spec(resources=resources, **spec), headers=who)
    assert answer.status_code == 201, answer.text
    job_id: str = answer.json()["id"]
    with api.factory() as session, session.begin():
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, JobState.RUNNING, "placed")
        job.partition = partition
        job.devices = [row["device_id"] for row in partition]
    return job_id


def stage(index: int, device: str, blocks: tuple[int, int], replica: int = 0) -> dict[str, Any]:
    return {"stage": index, "replica": replica, "device_id": device, "blocks": list(blocks)}


@pytest.mark.parametrize(
    ("schedule", "first_row"),
    [
        ("1f1b", ["F0", "F1", "F2", "B0", "F3", "B1", None, "B2", None, "B3"]),
        ("gpipe", ["F0", "F1", "F2", "F3", None, None, "B0", "B1", "B2", "B3"]),
    ],
)
def test_the_schedule_is_the_grid_the_jobs_stages_run(
    api: Api, schedule: str, first_row: list[str | None]
) -> None:
    alice = api.token("alice")
    job_id = placed(
        api,
        alice,
        [stage(0, "n1-cpu-0", (0, 1)), stage(1, "n1-cpu-1", (1, 3))],
        micro_batches=4,
        parallelism={"stages": 2, "schedule": schedule},
    )
    answer = api.client.get(f"{JOBS}/{job_id}/schedule", headers=alice)
    assert answer.status_code == 200, answer.text
    grid = answer.json()
    assert (grid["name"], grid["stages"], grid["micro_batches"]) == (schedule, 2, 4)
    assert grid["grid"][0] == first_row and len(grid["grid"]) == 2
    slots = len(grid["grid"][0]) * 2
    assert grid["bubble"] == pytest.approx(sum(c is None for r in grid["grid"] for c in r) / slots)


def test_replicas_run_their_share_of_the_micro_batches(api: Api) -> None:
    alice = api.token("alice")
    rows = [stage(s, f"n1-cpu-{2 * r + s}", (s, s + 1), r) for r in range(2) for s in range(2)]
    job_id = placed(api, alice, rows, micro_batches=4, parallelism={"stages": 2, "replicas": 2})
    grid = api.client.get(f"{JOBS}/{job_id}/schedule", headers=alice).json()
    assert grid["micro_batches"] == 2 and grid["grid"][1] == [None, "F0", "B0", "F1", "B1", None]


def test_no_schedule_before_placement_nor_for_another_users_job(api: Api) -> None:
    alice, bob = api.token("alice"), api.token("bob")
    queued = api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"]
    answer = api.client.get(f"{JOBS}/{queued}/schedule", headers=alice)
    assert answer.status_code == 409 and "not placed" in answer.json()["detail"]
    assert api.client.get(f"{JOBS}/{queued}/schedule", headers=bob).status_code == 404
    trial = placed(api, alice, [stage(0, "n1-cpu-0", (0, 3))])
    with api.factory() as session, session.begin():
        row = session.get(Job, trial)
        assert row is not None
        row.pool = "a-sweep"  # trained by the sweep's SHARP executor
    answer = api.client.get(f"{JOBS}/{trial}/schedule", headers=alice)
    assert answer.status_code == 409 and "SHARP" in answer.json()["detail"]


def test_devices_show_the_memory_their_stage_is_planned_to_hold(api: Api) -> None:
    for device in ("n1-cpu-0", "n1-cpu-1", "n1-cpu-2"):
        add_device(api, device)
    alice = api.token("alice")
    job_id = placed(
        api,
        alice,
        [stage(0, "n1-cpu-0", (0, 2)), stage(1, "n1-cpu-1", (2, 3))],
        micro_batches=4,
        parallelism={"stages": 2},
    )
    with api.factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        costs = block_costs(job)
    expected = {
        device: stage_memory(
            costs,
            blocks,
            micro_batch_size=job_spec()["batch_size"] // 4,
            in_flight=in_flight("1f1b", 2, index, 4),
        ).total
        for index, device, blocks in [(0, "n1-cpu-0", (0, 2)), (1, "n1-cpu-1", (2, 3))]
    }
    items = api.client.get("/api/v1/devices", headers=alice).json()["items"]
    held = {d["id"]: d["memory_used_bytes"] for d in items}
    assert held == {**expected, "n1-cpu-2": None}
    assert expected["n1-cpu-0"] > 0
