"""Runner actors: named, detached, never duplicated, found again, killed with their stages."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.scheduler.devices import DEVICE_RESOURCE, Device
from shoal.workers.actors import find_runner, kill_runner, runner_name, start_runner
from shoal.workers.snapshot import (
    DataRef,
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunnerReport,
    RunStatus,
    StagePlan,
)

pytestmark = pytest.mark.integration


def snapshot(root: Path, node: str, job_id: str, steps: int) -> JobSnapshot:
    devices = [Device(f"{node[:8]}-cpu-{i}", node, i, "cpu", 2048, False) for i in range(2)]
    return JobSnapshot(
        job_id=job_id,
        attempt=1,
        model=ModelRef("mlp", None, {"hidden": 16, "layers": 3}),
        data=DataRef("synthetic-regression", None, {"features": 8, "outputs": 2}),
        optimizer=OptimizerConf("sgd", 0.05),
        batch_size=8,
        micro_batches=2,
        steps=steps,
        seed=3,
        schedule="1f1b",
        recompute=False,
        stages=(StagePlan(0, (0, 2), devices[0]), StagePlan(1, (2, 4), devices[1])),
        num_blocks=4,
        checkpoint_root=str(root),
        checkpoint_every=0,
        checkpoint_keep=1,
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    # The runner trains on its own; polling is the only way to see it progress.
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def poll(job_id: str) -> RunnerReport:
    import ray

    runner: Any = find_runner(job_id)
    assert runner is not None
    report: RunnerReport = ray.get(runner.poll.remote(0), timeout=60)
    return report


def free_devices() -> float:
    import ray

    resources = ray.available_resources()  # type: ignore[no-untyped-call]
    return float(resources.get(DEVICE_RESOURCE, 0))


def test_a_runner_trains_once_and_is_found_by_name(ray_address: str, tmp_path: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = snapshot(tmp_path, node, "launch-1", steps=3)
    try:
        first = start_runner(snap)
        again = start_runner(snap)  # a restarted control plane starting it again
        assert again._actor_id == first._actor_id
        assert runner_name("launch-1") == "shoal-job-launch-1"
        wait_for(lambda: poll("launch-1").status.is_final, "the job to end")
        report = poll("launch-1")
        assert report.status is RunStatus.SUCCEEDED, report.error
        assert [m.step for m in report.metrics] == [1, 2, 3]  # trained once, not twice
        placement = next(e for e in report.events if e.kind == "placement")
        assert [s["device_id"] for s in placement.data["stages"]] == [
            f"{node[:8]}-cpu-0",
            f"{node[:8]}-cpu-1",
        ]
    finally:
        assert kill_runner("launch-1")
    assert find_runner("launch-1") is None
    assert not kill_runner("launch-1")


def test_killing_a_runner_frees_its_stage_workers(ray_address: str, tmp_path: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    start_runner(snapshot(tmp_path, node, "launch-2", steps=100_000))
    try:
        wait_for(lambda: len(poll("launch-2").metrics) > 0, "the first step")
        assert free_devices() <= 2  # the two stages hold two of the four
    finally:
        kill_runner("launch-2")
    wait_for(lambda: free_devices() == 4, "the stage workers to die with their runner")
    assert find_runner("launch-2") is None
