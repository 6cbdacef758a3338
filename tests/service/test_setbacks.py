"""A worker that does not start in time (``WorkerNotStarted``: its device held by something
else, its node not answering): the controller places the job again elsewhere, leaves that
device alone for a while, and fails a job whose workers keep not starting, saying why."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from shoal.service.cluster import InProcessCluster
from shoal.service.db.session import SessionFactory
from shoal.service.setbacks import MAX_RESTARTS, UNREADY_S, Setbacks
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.worker_group import GroupFactory, StageLost, WorkerNotStarted
from shoal.workers.snapshot import RunnerEvent, StagePlan
from tests.service.test_controller import (
    FOUR_DEVICES,
    UNENDING,
    RefusingFirstMove,
    Resizable,
    cancel_after,
    events,
    growing_job,
    job,
    make_controller,
    owner,
    reconcile_until,
    submit,
)

NOT_STARTED = "its worker did not start within 300 s"


def not_starting(refusals: int, starts: list[list[str]]) -> GroupFactory:
    """Groups whose first ``refusals`` starts fail as a ``RayGroup``'s does where a worker's
    device is held (its first device's); ``starts`` gets each start's devices."""

    def make(plans: Sequence[StagePlan], setup: StageSetup) -> LocalGroup:
        starts.append([p.device.id for p in plans])
        if len(starts) <= refusals:
            raise WorkerNotStarted(plans[0].index, plans[0].device.id, NOT_STARTED)
        return LocalGroup(plans, setup)

    return make


ONE_DEVICE = {"min_devices": 1, "max_devices": 1}


@pytest.mark.integration
def test_a_job_whose_worker_did_not_start_trains_elsewhere_and_the_device_is_left_alone(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """The job's first worker does not start: it is placed on another device and trains
    there; a second job, placed after, is not put on the device either (it failed the first
    job before, which never trained)."""
    starts: list[list[str]] = []
    cluster = InProcessCluster(FOUR_DEVICES, make_group=not_starting(1, starts))
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    first = submit(session_factory, who, steps=3, resources=ONE_DEVICE)
    reconcile_until(
        controller,
        lambda: job(session_factory, first).state == "SUCCEEDED",
        what=lambda: [(e.kind, e.message) for e in events(session_factory, first)],
    )
    second = submit(session_factory, who, steps=3, resources=ONE_DEVICE)
    reconcile_until(
        controller,
        lambda: job(session_factory, second).state == "SUCCEEDED",
        what=lambda: [(e.kind, e.message) for e in events(session_factory, second)],
    )
    (held,) = starts[0]
    assert len(starts) == 3 and all(held not in devices for devices in starts[1:]), starts
    history = events(session_factory, first)
    (said,) = [e for e in history if e.kind == "worker_not_started"]
    assert said.data["device_id"] == held and NOT_STARTED in said.message, said.message
    (lost,) = [e for e in history if e.kind == "device_lost"]
    assert lost.data["devices"] == [held], lost.data
    assert job(session_factory, first).devices == starts[1], starts


@pytest.mark.integration
def test_a_job_whose_workers_keep_not_starting_fails_saying_why(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """No worker ever starts: the job is tried on each of the four devices once (each is
    left alone after), and the fourth time in a row without a step fails it."""
    starts: list[list[str]] = []
    cluster = InProcessCluster(FOUR_DEVICES, make_group=not_starting(100, starts))
    controller = make_controller(session_factory, cluster, tmp_path)
    job_id = submit(session_factory, owner(session_factory), steps=3, resources=ONE_DEVICE)
    reconcile_until(
        controller,
        lambda: job(session_factory, job_id).state == "FAILED",
        what=lambda: (starts, [(e.kind, e.message) for e in events(session_factory, job_id)]),
    )
    tried = [device for devices in starts for device in devices]
    assert len(tried) == len(set(tried)) == MAX_RESTARTS + 1 == 4, starts
    error = job(session_factory, job_id).error or ""
    assert NOT_STARTED in error and "4 times without the job passing step 0" in error, error


class NotStartingFirstMove(RefusingFirstMove):
    """A RefusingFirstMove whose refused move's new worker is not built in time, as
    ``RayGroup``'s is on a device held by something else (``WorkerNotStarted``)."""

    def refusal(self, plan: StagePlan) -> StageLost:
        return WorkerNotStarted(plan.index, plan.device.id, NOT_STARTED)


@pytest.mark.integration
def test_a_job_is_not_grown_again_onto_a_device_its_worker_did_not_start_on(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """A growth whose new worker is not built in time is that device's loss (recovered in
    place); the controller's later growths leave the device alone (it asked for the same
    devices again at the next tick before)."""
    NotStartingFirstMove.refusals = 1
    cluster = Resizable(InProcessCluster(FOUR_DEVICES, make_group=NotStartingFirstMove), 2)
    controller = make_controller(session_factory, cluster, tmp_path)  # type: ignore[arg-type]
    job_id = growing_job(session_factory, controller, steps=UNENDING)
    cluster.devices = 4
    history = cancel_after(session_factory, controller, job_id, "relayout_failed", more=10)
    (said,) = [e.data for e in history if e.kind == "worker_not_started"]
    failed = next(i for i, e in enumerate(history) if e.kind == "relayout_failed")
    later = [e.data["devices"] for e in history[failed:] if e.kind == "resize"]
    assert all(said["device_id"] not in devices for devices in later), (said, later)


def not_started(device_id: str) -> RunnerEvent:
    return RunnerEvent("worker_not_started", 0, NOT_STARTED, {"device_id": device_id})


@pytest.mark.unit
def test_a_device_a_worker_did_not_start_on_is_left_alone_for_a_while() -> None:
    now = [100.0]
    setbacks = Setbacks(lambda: now[0])
    assert not setbacks.not_started([RunnerEvent("checkpoint", 3, "saved", {})])
    assert setbacks.not_started([not_started("gpu-1"), not_started("gpu-2")])
    now[0] += UNREADY_S / 2
    assert setbacks.not_started([not_started("gpu-2")])  # left alone from now on
    assert setbacks.unready() == {"gpu-1", "gpu-2"}
    now[0] += UNREADY_S / 2 + 1
    assert setbacks.unready() == {"gpu-2"}
    now[0] += UNREADY_S
    assert setbacks.unready() == set()


@pytest.mark.unit
def test_restarts_are_counted_in_a_row_until_the_job_passes_a_step() -> None:
    setbacks = Setbacks()
    assert [setbacks.restarts("a", 0) for _ in range(3)] == [1, 2, 3]
    assert setbacks.restarts("b", 0) == 1  # each job its own
    assert setbacks.restarts("a", 5) == 1  # it trained since
    assert setbacks.restarts("a", 5) == 2
    setbacks.forget("a")
    assert setbacks.restarts("a", 5) == 1
