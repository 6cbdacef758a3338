"""The controller's contract, end to end on a real database (SQLite and PostgreSQL).

Tests run against both ``Cluster`` implementations: runners as threads on in-process
stages (``InProcessCluster``, seconds) and runners as detached Ray actors driving StageWorker
actors on the session's local Ray (``RayCluster``, tens of seconds). A test whose Ray half
would only repeat a Ray path another test drives runs in-process alone (``IN_PROCESS``), and
says which test drives it on Ray.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from shoal.scheduler.devices import (
    DEVICE_RESOURCE,
    LABEL_KIND,
    LABEL_MEMORY_MB,
    UNMEASURED_GPU_OVERHEAD_MB,
    NodeInfo,
)
from shoal.scheduler.placement import Quota
from shoal.service.auth import Principal
from shoal.service.cluster import Cluster, InProcessCluster, RayCluster
from shoal.service.controller import Controller, ControllerConfig
from shoal.service.db.models import Checkpoint, DeviceRow, Job, JobEvent, JobMetric, User
from shoal.service.db.session import SessionFactory
from shoal.service.jobs import request_cancel, restart_job, submit_job, transition
from shoal.service.lifecycle import JobState
from shoal.service.specs import validate_job_spec
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.pipeline.group import CANNOT_HOST
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.worker_group import StageLost
from shoal.workers.snapshot import StagePlan
from tests.factories import job_spec

pytestmark = pytest.mark.integration

NODES = [NodeInfo("f" * 56, True, {DEVICE_RESOURCE: 2.0}, {LABEL_KIND: "cpu"})]
FOUR_DEVICES = [NodeInfo("f" * 56, True, {DEVICE_RESOURCE: 4.0}, NODES[0].labels)]


class TwoDeviceRay(RayCluster):
    """The session's Ray, showing two of its devices so both backends see the same pool."""

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(n.node_id, n.alive, {**n.resources, DEVICE_RESOURCE: 2.0}, n.labels)
            for n in super().nodes()
        ]


@pytest.fixture(params=["inprocess", "ray"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if request.param == "inprocess":
        yield InProcessCluster(NODES)
        return
    address = request.getfixturevalue("ray_address")
    yield TwoDeviceRay(address, timeout_s=30)


IN_PROCESS = pytest.mark.parametrize("cluster", ["inprocess"], indirect=True)
"""Run a test on the in-process cluster only: its Ray half would repeat a Ray test (named
beside each use)."""


def make_controller(factory: SessionFactory, cluster: Cluster, tmp_path: Path) -> Controller:
    return Controller(factory, cluster, ControllerConfig(checkpoint_root=str(tmp_path / "ckpt")))


def owner(factory: SessionFactory) -> Principal:
    with factory() as session, session.begin():
        user = User(name="alice")
        session.add(user)
        session.flush()
        return Principal(user.id, user.name, False)


def submit(factory: SessionFactory, who: Principal, **overrides: object) -> str:
    job, _ = submit_job(factory, who, validate_job_spec(job_spec(**overrides), []))
    return job.id


def job(factory: SessionFactory, job_id: str) -> Job:
    with factory() as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def reconcile_until(
    controller: Controller,
    done: Callable[[], bool],
    timeout: float = 60.0,
    what: Callable[[], object] = lambda: "",
) -> None:
    """Reconcile until ``done``; on a timeout, say ``what()`` (the state waited on)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"condition not reached in time {what()}"
        controller.reconcile_once()
        time.sleep(0.02)  # runners are threads: give them the GIL between ticks


def events(factory: SessionFactory, job_id: str) -> list[JobEvent]:
    with factory() as session:
        return list(
            session.scalars(
                sa.select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            )
        )


def latest_checkpoint(factory: SessionFactory, job_id: str) -> int:
    """The step of the job's latest checkpoint the controller has recorded (0: none)."""
    with factory() as session:
        step = session.scalar(
            sa.select(sa.func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id)
        )
    return int(step or 0)


def run_past_a_checkpoint(controller: Controller, factory: SessionFactory, job_id: str) -> None:
    """Reconcile until the running job has trained past a checkpoint the controller recorded
    (the job must have steps enough not to end meanwhile)."""
    reconcile_until(
        controller,
        lambda: latest_checkpoint(factory, job_id) >= 10 and job(factory, job_id).step >= 12,
        what=lambda: (job(factory, job_id).state, job(factory, job_id).step),
    )


def resumed_and_stepping(factory: SessionFactory, job_id: str) -> bool:
    """The job was resumed from a checkpoint, runs, and has trained past both its resume step
    and the step at which it lost its runner (if it did)."""
    history = events(factory, job_id)
    resumed = [e.data["step"] for e in history if e.kind == "resumed"]
    lost = [e.data["step"] for e in history if e.kind == "runner_lost"]
    row = job(factory, job_id)
    return bool(resumed) and row.state == "RUNNING" and row.step > max(resumed + lost) + 2


def test_job_trains_to_success_with_metrics_events_and_checkpoints(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    job_id = submit(
        session_factory,
        who,
        steps=30,
        resources={"max_devices": 2},
        parallelism={"stages": 2},
        optimizer={"lr": 0.01},
    )
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "SUCCEEDED")

    row = job(session_factory, job_id)
    assert row.step == 30 and row.error is None and len(row.devices) == 2
    ranges = [p["blocks"] for p in row.partition]
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0]
    assert ranges[1][1] == 3  # two stages covering the mlp's 3 blocks
    with session_factory() as session:
        metrics = list(
            session.scalars(
                sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            )
        )
        losses = [m.loss for m in metrics]
        steps = sorted(c.step for c in session.scalars(sa.select(Checkpoint)))
        holders = set(session.scalars(sa.select(DeviceRow.job_id)))
    assert len(losses) == 30 and sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert (row.last_loss, row.last_samples_per_s) == (losses[-1], metrics[-1].samples_per_s)
    assert all(m.grad_norm is not None and m.grad_norm > 0 for m in metrics)
    # MFU: the MLP's matrix products per step (forward, weight and input gradients, none
    # for the data: 16,256 FLOPs a sample, 32 a step) over the step's time and its two
    # devices' measured speeds (CPU devices peak at what they measured).
    with session_factory() as session:
        gflops = {d.id: d.speed_gflops for d in session.scalars(sa.select(DeviceRow))}
    for m in metrics:
        peak = sum(gflops[d] or 0.0 for d in {s["device_id"] for s in m.stages}) * 1e9
        assert m.mfu == pytest.approx(16256 * 32 / (m.step_time_s * peak)), (m.step, gflops)
    assert row.last_mfu == metrics[-1].mfu
    assert steps == [20, 30]  # every 10 steps, keep 2
    kinds = [e.kind for e in events(session_factory, job_id)]
    assert kinds[:2] == ["state", "state"] and "placement" in kinds and "checkpoint" in kinds
    assert kinds[-1] == "state"
    assert holders == {None}  # devices released


@IN_PROCESS  # on Ray: the dead runner's test ends by cancelling
def test_cancel_of_a_running_job(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    job_id = submit(session_factory, who, steps=100_000)
    reconcile_until(controller, lambda: job(session_factory, job_id).step > 0)
    request_cancel(session_factory, who, job_id)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "CANCELLED")
    assert job(session_factory, job_id).step < 100_000


def test_a_dead_runner_is_restarted_from_the_latest_checkpoint(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    """The runner disappears under the controller (its process or node died): the job goes
    RECOVERING and a new runner resumes from the latest checkpoint. Every step is recorded
    once; steps the dead runner trained past the controller's last poll and checkpointed are
    not trained again, so their metrics are the ones missing."""
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    job_id = submit(session_factory, who, steps=100_000)  # ends only when cancelled
    run_past_a_checkpoint(controller, session_factory, job_id)
    cluster.stop_runner(job_id)
    reconcile_until(
        controller,
        lambda: resumed_and_stepping(session_factory, job_id),
        what=lambda: [(e.kind, e.message) for e in events(session_factory, job_id)],
    )
    request_cancel(session_factory, who, job_id)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "CANCELLED")
    history = events(session_factory, job_id)
    (lost,) = [e for e in history if e.kind == "runner_lost"]
    assert lost.data["resume_step"] >= 10
    # The dying runner may have written a checkpoint the controller had not read yet: the
    # new one resumes from the latest on disk, and its event says what it replays.
    (resumed,) = [e for e in history if e.kind == "resumed"]
    assert resumed.data["step"] >= lost.data["resume_step"]
    assert resumed.data["steps_replayed"] == max(0, lost.data["step"] - resumed.data["step"])
    states = [(e.data["from"], e.data["to"]) for e in history if e.kind == "state"]
    assert ("RUNNING", "RECOVERING") in states and ("RECOVERING", "RUNNING") in states
    assert job(session_factory, job_id).attempt == 2
    with session_factory() as session:
        steps = list(session.scalars(sa.select(JobMetric.step).where(JobMetric.job_id == job_id)))
    recorded, last = set(steps), job(session_factory, job_id).step
    assert len(recorded) == len(steps) and max(recorded) == last
    assert set(range(1, lost.data["step"] + 1)) <= recorded
    assert set(range(resumed.data["step"] + 1, last + 1)) <= recorded


@IN_PROCESS  # a runner stopped on Ray: the dead runner's test
def test_a_runner_that_keeps_dying_fails_the_job_with_the_reason(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, cluster, tmp_path)
    job_id = submit(session_factory, owner(session_factory), steps=100_000)
    reconcile_until(controller, lambda: job(session_factory, job_id).step > 0)
    for _ in range(10):  # killed as soon as it is up, before it can pass a step
        if job(session_factory, job_id).state == "FAILED":
            break
        cluster.stop_runner(job_id)
        controller.reconcile_once()
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "FAILED")
    assert "times without the job passing step" in (job(session_factory, job_id).error or "")


@IN_PROCESS  # resumed on Ray from a checkpoint: the dead runner's test
@pytest.mark.parametrize("ended", ["FAILED", "CANCELLED"])
def test_restart_resumes_from_the_latest_checkpoint(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path, ended: str
) -> None:
    """`shoal restart` of a failed or a cancelled job: a new attempt, from its checkpoint."""
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    job_id = submit(session_factory, who, steps=100_000)  # ends only when cancelled
    run_past_a_checkpoint(controller, session_factory, job_id)
    if ended == "CANCELLED":
        request_cancel(session_factory, who, job_id)
        reconcile_until(controller, lambda: job(session_factory, job_id).state == "CANCELLED")
    else:
        cluster.stop_runner(job_id)
        with session_factory() as session, session.begin():  # as a crash would leave it
            row = session.get(Job, job_id)
            assert row is not None
            transition(session, row, JobState.FAILED, "the test failed it", error="failed")
    restart_job(session_factory, who, job_id)
    reconcile_until(controller, lambda: resumed_and_stepping(session_factory, job_id))
    resumed = [e for e in events(session_factory, job_id) if e.kind == "resumed"]
    assert len(resumed) == 1 and resumed[0].data["step"] >= 10
    assert job(session_factory, job_id).attempt == 2
    request_cancel(session_factory, who, job_id)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "CANCELLED")


def test_checkpoints_at_an_fsspec_url_are_written_and_resumed_from(
    session_factory: SessionFactory,
) -> None:
    """An object store's URL as the checkpoint root (an in-memory file system here: the
    in-process cluster shares it); a restarted job resumes from what was written there."""
    import fsspec

    root = f"memory://shoal-{uuid.uuid4().hex}"
    cluster = InProcessCluster(NODES)
    controller = Controller(session_factory, cluster, ControllerConfig(checkpoint_root=root))
    who = owner(session_factory)
    job_id = submit(session_factory, who, steps=300, checkpoint={"every_steps": 10, "keep": 2})
    run_past_a_checkpoint(controller, session_factory, job_id)
    cluster.stop_runner(job_id)
    with session_factory() as session, session.begin():
        row = session.get(Job, job_id)
        assert row is not None
        transition(session, row, JobState.FAILED, "the test failed it", error="failed")
    restart_job(session_factory, who, job_id)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "SUCCEEDED")
    (resumed,) = [e for e in events(session_factory, job_id) if e.kind == "resumed"]
    assert resumed.data["step"] >= 10
    steps = [info.step for info in CheckpointStore(root).list(job_id)]
    assert steps == [290, 300]
    with session_factory() as session:
        paths = session.scalars(sa.select(Checkpoint.path).where(Checkpoint.job_id == job_id))
        assert all(path.startswith(f"{root}/{job_id}/step-") for path in paths)
    fsspec.filesystem("memory").rm(root, recursive=True)


def test_a_users_quota_keeps_their_next_job_waiting_until_one_ends(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """The default quota of one job at a time: alice's second job waits, saying why, and
    starts when her first ends; an admin's own limit for a user replaces the default."""
    config = ControllerConfig(
        checkpoint_root=str(tmp_path / "ckpt"), default_quota=Quota(max_jobs=1)
    )
    controller = Controller(session_factory, InProcessCluster(NODES), config)
    who = owner(session_factory)
    first = submit(session_factory, who, steps=200)
    second = submit(session_factory, who, steps=5)
    reconcile_until(controller, lambda: job(session_factory, first).state == "RUNNING")
    reconcile_until(
        controller, lambda: any(e.kind == "waiting" for e in events(session_factory, second))
    )
    (waiting,) = [e for e in events(session_factory, second) if e.kind == "waiting"]
    assert waiting.message == "alice runs 1 jobs: the quota's most (max_jobs)"
    assert job(session_factory, second).state == "QUEUED"
    with session_factory() as session, session.begin():
        user = session.scalar(sa.select(User).where(User.name == "alice"))
        assert user is not None
        user.max_jobs = 2  # an admin raised hers
    reconcile_until(controller, lambda: job(session_factory, second).state != "QUEUED")
    assert job(session_factory, first).state == "RUNNING"  # both at once now
    reconcile_until(controller, lambda: job(session_factory, first).state == "SUCCEEDED")


@IN_PROCESS  # on Ray: a restarted `shoal up`, in test_shoal_up.py and the chaos test
def test_a_new_controller_finds_running_jobs_instead_of_starting_them_again(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    first = make_controller(session_factory, cluster, tmp_path)
    job_id = submit(session_factory, owner(session_factory), steps=60)
    reconcile_until(first, lambda: job(session_factory, job_id).step > 0)
    second = make_controller(session_factory, cluster, tmp_path)  # a control-plane restart
    reconcile_until(second, lambda: job(session_factory, job_id).state == "SUCCEEDED")
    placements = [e for e in events(session_factory, job_id) if e.kind == "placement"]
    assert len(placements) == 1 and job(session_factory, job_id).attempt == 1
    with session_factory() as session:
        steps = list(session.scalars(sa.select(JobMetric.step).where(JobMetric.job_id == job_id)))
    assert sorted(steps) == list(range(1, 61))  # nothing lost or doubled across the switch


def test_a_job_that_does_not_fit_waits_with_its_reason_said_once(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    big = submit(
        session_factory, who, steps=5, parallelism={"stages": 3}, resources={"max_devices": 3}
    )
    controller.reconcile_once()
    controller.reconcile_once()
    waits = [e for e in events(session_factory, big) if e.kind == "waiting"]
    assert [e.message for e in waits] == ["needs 3 free devices, 2 available"]  # said once
    assert job(session_factory, big).state == "QUEUED"


# On Ray: replicated pipelines in tests/workers/pipeline/test_runner.py, four stages through
# the API in tests/integration/test_shoal_up.py.
def test_a_two_stage_two_replica_job_trains_to_success(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, InProcessCluster(FOUR_DEVICES), tmp_path)
    job_id = submit(
        session_factory,
        owner(session_factory),
        steps=6,
        micro_batches=4,
        optimizer={"name": "sgd", "lr": 0.05},
        parallelism={"stages": 2, "replicas": 2},
        resources={"min_devices": 4, "max_devices": 4},
    )
    reconcile_until(
        controller, lambda: job(session_factory, job_id).state == "SUCCEEDED", timeout=120
    )
    row = job(session_factory, job_id)
    assert row.step == 6 and row.error is None and len(row.devices) == 4
    assert [(p["stage"], p["replica"]) for p in row.partition] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [p["blocks"] for p in row.partition[:2]] == [p["blocks"] for p in row.partition[2:]]
    assert sorted({p["device_id"] for p in row.partition}) == sorted(row.devices)
    with session_factory() as session:
        metric = session.scalars(sa.select(JobMetric).where(JobMetric.job_id == job_id)).first()
    assert metric is not None
    assert [(s["stage"], s["replica"]) for s in metric.stages] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    placement = [e for e in events(session_factory, job_id) if e.kind == "placement"]
    assert placement[0].message.startswith("2 stages x 2 replicas")


def test_a_device_that_fails_as_it_is_measured_is_drained_and_the_job_trains_elsewhere(
    session_factory: SessionFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first device a job's worker measures fails the benchmark (a failing GPU: no
    model code ran): the job is placed again on other devices and trains to the end, and
    the control plane drains that device, saying why, so nothing else lands there."""
    import torch

    from shoal.workers import device_speed
    from shoal.workers.pipeline.timing import StepTimer

    benchmarks: list[float] = []

    def timer(device: torch.device, slowdown: float) -> StepTimer:
        benchmarks.append(slowdown)
        if len(benchmarks) == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return StepTimer(device, slowdown)

    monkeypatch.setattr(device_speed, "StepTimer", timer)
    controller = make_controller(session_factory, InProcessCluster(FOUR_DEVICES), tmp_path)
    job_id = submit(
        session_factory,
        owner(session_factory),
        steps=6,
        parallelism={"stages": 2, "replicas": 1},
        resources={"min_devices": 2, "max_devices": 2},
    )
    reconcile_until(
        controller,
        lambda: job(session_factory, job_id).state == "SUCCEEDED",
        timeout=120,
        what=lambda: [(e.kind, e.message) for e in events(session_factory, job_id)],
    )
    history = events(session_factory, job_id)
    (said,) = [e for e in history if e.kind == "device_set_aside"]
    failed = said.data["device_id"]
    with session_factory() as session:
        drained = [
            (d.id, d.drain_reason) for d in session.scalars(sa.select(DeviceRow)) if d.draining
        ]
    assert drained == [(failed, said.message)], drained
    assert "its worker failed as it measured it (RuntimeError: CUDA error" in said.message
    row = job(session_factory, job_id)
    assert row.step == 6 and row.attempt == 2 and failed not in row.devices, row.devices
    with session_factory() as session:
        steps = session.scalars(sa.select(JobMetric.step).where(JobMetric.job_id == job_id))
        assert sorted(steps) == list(range(1, 7))


@pytest.mark.parametrize("keep_copies", [True, False])
def test_a_lost_stage_worker_recovers_on_the_devices_left_and_stays_exact(
    session_factory: SessionFactory, ray_address: str, tmp_path: Path, keep_copies: bool
) -> None:
    """A stage worker's process is killed (as a node loss would): the job turns RECOVERING
    and back to RUNNING without the lost device, either in place from the in-memory copies
    (at most the copies' interval replayed, same runner) or, without copies, placed again
    from its latest checkpoint (a new attempt); every step is recorded once and the losses
    are those of one process."""
    import os
    import signal

    from shoal.workers.reference import train_reference
    from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf

    controller = make_controller(session_factory, RayCluster(ray_address, timeout_s=30), tmp_path)
    every, steps = 10, 200
    spec = {
        # Steps enough that the job is still running when the kill lands: the controller
        # sees step 14 a tick or more after the runner made it.
        "steps": steps,
        "parallelism": {"stages": 2, "replicas": 1},
        "resources": {"min_devices": 1, "max_devices": 2},
        "checkpoint": {"every_steps": every, "keep": 2},
        "elastic": {"keep_copies": keep_copies},
    }
    job_id = submit(session_factory, owner(session_factory), **spec)
    reconcile_until(controller, lambda: job(session_factory, job_id).step >= 14, timeout=120)
    (placement,) = [e for e in events(session_factory, job_id) if e.kind == "placement"]
    os.kill(placement.data["stages"][1]["pid"], signal.SIGKILL)
    reconcile_until(
        controller, lambda: job(session_factory, job_id).state == "SUCCEEDED", timeout=180
    )

    history = events(session_factory, job_id)
    lost_events = [e for e in history if e.kind == "device_lost"]
    assert len(lost_events) == 1, [(e.kind, e.message) for e in history]
    (lost,) = lost_events
    assert lost.data["step"] - lost.data["resume_step"] == lost.data["steps_replayed"]
    moves = [(e.data["from"], e.data["to"]) for e in history if e.kind == "state"]
    assert ("RUNNING", "RECOVERING") in moves and ("RECOVERING", "RUNNING") in moves
    row = job(session_factory, job_id)
    if keep_copies:
        # The steps since the last copy replay, or since the one before if the last had
        # not left the dying worker: at most the interval between copies.
        assert lost.data["steps_replayed"] <= lost.data["most_replayed"] and row.attempt == 1
        assert [e for e in history if e.kind == "copies"]
        (back,) = [e for e in history if e.kind == "recovered"]
        assert not set(lost.data["devices"]) & {r["device_id"] for r in back.data["to"]}
        assert not [e for e in history if e.kind == "resumed"]
    else:
        assert lost.data["resume_step"] in range(every, steps, every), lost.data
        assert lost.data["steps_replayed"] >= 0
        (resumed,) = [e for e in history if e.kind == "resumed"]
        assert resumed.data["step"] == lost.data["resume_step"]
        assert row.attempt == 2 and not set(lost.data["devices"]) & set(row.devices)
    with session_factory() as session:
        metrics = list(
            session.scalars(
                sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            )
        )
    assert [m.step for m in metrics] == list(range(1, steps + 1))
    base = job_spec()
    reference = train_reference(
        ModelRef("mlp", None, base["model"]["config"]),
        DataRef("digits", None, {}),
        OptimizerConf("adam", base["optimizer"]["lr"]),
        batch_size=base["batch_size"],
        micro_batches=base["micro_batches"],
        steps=steps,
        seed=row.spec.get("seed", 0),
    )
    assert [m.loss for m in metrics] == pytest.approx(reference.losses, rel=1e-5, abs=1e-6)


def test_a_job_left_with_too_few_devices_waits_queued_and_resumes_when_they_return(
    session_factory: SessionFactory, ray_address: str, tmp_path: Path
) -> None:
    """A job that needs both devices of the pool loses a stage worker (no in-memory copies):
    with one device left it cannot run, so it waits QUEUED; the lost device answers again
    (only its worker died), and the job resumes from its latest checkpoint on both."""
    import os
    import signal

    controller = make_controller(session_factory, TwoDeviceRay(ray_address, timeout_s=30), tmp_path)
    steps = 400  # seconds of training left when the worker is killed at step 14 or so
    job_id = submit(
        session_factory,
        owner(session_factory),
        steps=steps,
        micro_batches=4,
        optimizer={"name": "sgd", "lr": 0.05},
        parallelism={"stages": 2, "replicas": 1},
        resources={"min_devices": 2, "max_devices": 2},
        checkpoint={"every_steps": 10, "keep": 2},
        elastic={"keep_copies": False},
    )
    reconcile_until(controller, lambda: job(session_factory, job_id).step >= 14, timeout=120)
    (placement,) = [e for e in events(session_factory, job_id) if e.kind == "placement"]
    os.kill(placement.data["stages"][1]["pid"], signal.SIGKILL)
    reconcile_until(
        controller, lambda: job(session_factory, job_id).state == "SUCCEEDED", timeout=180
    )
    history = events(session_factory, job_id)
    states = [(e.data["from"], e.data["to"]) for e in history if e.kind == "state"]
    assert ("RECOVERING", "QUEUED") in states and ("QUEUED", "RUNNING") in states
    (lost,) = [e for e in history if e.kind == "device_lost"]
    (resumed,) = [e for e in history if e.kind == "resumed"]
    assert resumed.data["step"] == lost.data["resume_step"], (resumed.data, lost.data)
    assert resumed.data["step"] % 10 == 0 and 10 <= resumed.data["step"] < steps, resumed.data
    assert job(session_factory, job_id).attempt == 2
    done, losses = zip(*losses_of(session_factory, job_id), strict=True)
    assert list(done) == list(range(1, steps + 1))
    assert list(losses) == pytest.approx(reference_losses(steps, 4), rel=1e-5, abs=1e-6)


class Resizable:
    """A cluster whose node shows ``devices`` devices (a node growing or new capacity)."""

    def __init__(self, inner: Cluster, devices: int) -> None:
        self.inner = inner
        self.devices = devices

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                n.node_id, n.alive, {**n.resources, DEVICE_RESOURCE: float(self.devices)}, n.labels
            )
            for n in self.inner.nodes()
        ]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(params=["inprocess", "ray"])
def resizable(request: pytest.FixtureRequest) -> Iterator[Resizable]:
    if request.param == "inprocess":
        inner: Cluster = InProcessCluster(FOUR_DEVICES)
    else:
        inner = RayCluster(request.getfixturevalue("ray_address"), timeout_s=30)
    yield Resizable(inner, 2)


def losses_of(factory: SessionFactory, job_id: str) -> list[tuple[int, float]]:
    with factory() as session:
        return [
            (m.step, m.loss)
            for m in session.scalars(
                sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            )
        ]


def reference_losses(steps: int, micro_batches: int) -> list[float]:
    from shoal.workers.reference import train_reference
    from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf

    base = job_spec()
    return train_reference(
        ModelRef("mlp", None, base["model"]["config"]),
        DataRef("digits", None, {}),
        OptimizerConf("sgd", 0.05),
        batch_size=base["batch_size"],
        micro_batches=micro_batches,
        steps=steps,
        seed=0,
    ).losses


STEPS = 300


def drain(factory: SessionFactory, device_id: str) -> None:
    """What ``POST /devices/{id}/drain`` does."""
    with factory() as session, session.begin():
        row = session.get(DeviceRow, device_id)
        assert row is not None
        row.draining = True


"""Enough that in-process runners (a few ms a step) are still running when devices change."""


def running_job(
    factory: SessionFactory,
    controller: Controller,
    *,
    replicas: int | str = 1,
    max_devices: int = 2,
    steps: int = STEPS,
    **overrides: object,
) -> str:
    """A 2-stage job of ``steps`` steps on at least 2 devices, five steps in."""
    job_id = submit(
        factory,
        owner(factory),
        steps=steps,
        micro_batches=4,
        optimizer={"name": "sgd", "lr": 0.05},
        parallelism={"stages": 2, "replicas": replicas},
        resources={"min_devices": 2, "max_devices": max_devices},
        **overrides,
    )
    reconcile_until(controller, lambda: job(factory, job_id).step >= 5, timeout=120)
    return job_id


def growing_job(factory: SessionFactory, controller: Controller, steps: int = STEPS) -> str:
    """A 2-stage job on 2 devices that could use 4, five steps in."""
    return running_job(factory, controller, replicas="auto", max_devices=4, steps=steps)


UNENDING = 100_000
"""Steps of a job that ends only when cancelled. On Ray workers a step of this model takes
a few ms (its stages linked by sockets), so a job of STEPS steps can end before a change
the test makes reaches it; such a test runs this long and cancels the job once the change
is seen (``cancel_after``), then checks the steps it trained (``assert_exact_steps``)."""


def cancel_after(
    factory: SessionFactory,
    controller: Controller,
    job_id: str,
    kind: str,
    more: int = 5,
) -> list[JobEvent]:
    """Reconcile until the job has an event of ``kind`` and ``more`` steps after it, then
    cancel it and wait until it is CANCELLED; its events."""

    def seen() -> bool:
        return any(e.kind == kind for e in events(factory, job_id))

    def last_events() -> object:
        return [(e.kind, e.message) for e in events(factory, job_id)][-8:]

    reconcile_until(controller, seen, timeout=180, what=last_events)
    at = job(factory, job_id).step
    reconcile_until(controller, lambda: job(factory, job_id).step >= at + more, timeout=60)
    with factory() as session:
        row = session.get(Job, job_id)
        assert row is not None
        who = Principal(row.owner_id, "alice", False)
    request_cancel(factory, who, job_id)
    reconcile_until(
        controller, lambda: job(factory, job_id).state == "CANCELLED", timeout=60, what=last_events
    )
    return events(factory, job_id)


def assert_exact_steps(factory: SessionFactory, job_id: str) -> None:
    """Every step the job trained is stored once, in order, with the single-process losses."""
    steps, losses = zip(*losses_of(factory, job_id), strict=True)
    assert list(steps) == list(range(1, len(steps) + 1))
    assert list(losses) == pytest.approx(reference_losses(len(steps), 4), rel=1e-5, abs=1e-6)


# On Ray: a node added mid-run, tests/integration/test_elastic.py.
@pytest.mark.parametrize("resizable", ["inprocess"], indirect=True)
def test_a_running_job_grows_onto_devices_that_appear(
    session_factory: SessionFactory, resizable: Resizable, tmp_path: Path
) -> None:
    """Two devices, a job that could use four: two more appear mid-run and the job grows
    from one pipeline of 2 stages to two replicas, in place, every step once and exact."""
    controller = make_controller(session_factory, resizable, tmp_path)  # type: ignore[arg-type]
    job_id = growing_job(session_factory, controller, steps=UNENDING)
    assert len(job(session_factory, job_id).devices) == 2
    resizable.devices = 4
    history = cancel_after(session_factory, controller, job_id, "relayout")
    (resize,) = [e for e in history if e.kind == "resize"]
    (moved,) = [e for e in history if e.kind == "relayout"]
    assert len(resize.data["added"]) == 2 and moved.data["removed"] == []
    assert sorted(moved.data["added"]) == resize.data["added"]
    assert len(moved.data["to"]) == 4 and moved.data["micro_batches"] == [2, 2]
    row = job(session_factory, job_id)
    assert row.attempt == 1 and len(row.partition) == 4
    assert_exact_steps(session_factory, job_id)


def test_a_job_does_not_grow_for_less_than_the_configured_gain(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """Two more devices appear, but no layout on them is predicted 99% faster: the job
    finishes where it started."""
    cluster = Resizable(InProcessCluster(FOUR_DEVICES), 2)
    config = ControllerConfig(checkpoint_root=str(tmp_path / "ckpt"), growth_min_gain=0.99)
    controller = Controller(session_factory, cluster, config)  # type: ignore[arg-type]
    job_id = growing_job(session_factory, controller)
    cluster.devices = 4
    reconcile_until(
        controller, lambda: job(session_factory, job_id).state == "SUCCEEDED", timeout=180
    )
    assert not [e for e in events(session_factory, job_id) if e.kind in ("resize", "relayout")]
    assert len(job(session_factory, job_id).devices) == 2


# On Ray: the nodes Ray drains, tests/integration/test_elastic.py; the suspension below.
@pytest.mark.parametrize("resizable", ["inprocess"], indirect=True)
def test_a_drained_device_is_left_at_a_step_boundary_without_losing_a_step(
    session_factory: SessionFactory, resizable: Resizable, tmp_path: Path
) -> None:
    resizable.devices = 3
    controller = make_controller(session_factory, resizable, tmp_path)  # type: ignore[arg-type]
    job_id = running_job(session_factory, controller, steps=UNENDING)
    drained = job(session_factory, job_id).devices[1]
    drain(session_factory, drained)
    history = cancel_after(session_factory, controller, job_id, "relayout")
    (moved,) = [e for e in history if e.kind == "relayout"]
    assert moved.data["removed"] == [drained] and len(moved.data["added"]) == 1
    assert not [e for e in history if e.kind in ("device_lost", "resumed")]
    row = job(session_factory, job_id)
    assert drained not in row.devices and row.attempt == 1
    assert_exact_steps(session_factory, job_id)


def test_a_drained_device_with_nowhere_to_go_suspends_the_job_which_resumes_replaying_nothing(
    session_factory: SessionFactory, resizable: Resizable, tmp_path: Path
) -> None:
    """Both of the job's devices are needed (min_devices 2) and no other is free: draining
    one makes the runner checkpoint at its next step boundary and stop, the job waits
    QUEUED, and when a device appears it resumes from that very step."""
    controller = make_controller(session_factory, resizable, tmp_path)  # type: ignore[arg-type]
    job_id = running_job(
        session_factory,
        controller,
        steps=UNENDING,
        checkpoint={"every_steps": 1_000_000, "keep": 2},
    )
    drained = job(session_factory, job_id).devices[1]
    drain(session_factory, drained)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "QUEUED")
    suspended_at = job(session_factory, job_id).step
    controller.reconcile_once()
    assert job(session_factory, job_id).state == "QUEUED"  # no device to go to yet
    resizable.devices = 3
    history = cancel_after(session_factory, controller, job_id, "resumed")
    (suspend,) = [e for e in history if e.kind == "suspend"]
    assert suspend.data["draining"] == [drained]
    (stopped,) = [e for e in history if e.kind == "suspended"]
    (resumed,) = [e for e in history if e.kind == "resumed"]
    assert stopped.data["step"] == resumed.data["step"] == suspended_at
    assert resumed.data["steps_replayed"] == 0
    assert not [e for e in history if e.kind in ("device_lost", "runner_lost")]
    states = [(e.data["from"], e.data["to"]) for e in history if e.kind == "state"]
    assert ("RUNNING", "QUEUED") in states
    row = job(session_factory, job_id)
    assert drained not in row.devices and row.attempt == 2
    assert_exact_steps(session_factory, job_id)


def test_a_higher_priority_job_preempts_a_lower_one_which_resumes_losing_nothing(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """Both devices are the low job's; bob's urgent job needs both: the low job checkpoints
    at its next step boundary and requeues, the urgent one runs, then the low one resumes from
    that very step and ends with the losses of a run never interrupted. The low job's owner
    is told that a job of higher priority needed its devices, never which (another user's)."""
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    who = owner(session_factory)
    both = {"min_devices": 2, "max_devices": 2}
    low = submit(
        session_factory,
        who,
        steps=STEPS,
        micro_batches=4,
        optimizer={"name": "sgd", "lr": 0.05},
        parallelism={"stages": 2, "replicas": 1},
        resources=both,
        checkpoint={"every_steps": 1000, "keep": 2},
    )
    reconcile_until(controller, lambda: job(session_factory, low).step >= 5, timeout=120)
    with session_factory() as session, session.begin():
        session.add(User(name="bob", max_priority=5))  # an admin's grant
    with session_factory() as session:
        bob = session.scalars(sa.select(User).where(User.name == "bob")).one()
        granted = Principal(bob.id, bob.name, False)
    urgent = submit(
        session_factory, granted, steps=5, priority=5, parallelism={"stages": 2}, resources=both
    )
    reconcile_until(controller, lambda: job(session_factory, urgent).state != "QUEUED")
    reconcile_until(controller, lambda: job(session_factory, urgent).state == "SUCCEEDED")
    reconcile_until(controller, lambda: job(session_factory, low).state == "SUCCEEDED", timeout=180)
    history = events(session_factory, low)
    (suspend,) = [e for e in history if e.kind == "suspend"]
    assert "a job of higher priority needs its devices" in suspend.message
    told = [(e.kind, e.message, e.data) for e in history]
    assert not [e for e in told if urgent in repr(e) or "bob" in repr(e)], told
    (stopped,) = [e for e in history if e.kind == "suspended"]
    (resumed,) = [e for e in history if e.kind == "resumed"]
    assert stopped.data["step"] == resumed.data["step"] and resumed.data["steps_replayed"] == 0
    started = min(e.time for e in events(session_factory, urgent) if e.kind == "placement")
    assert stopped.time <= started  # the urgent job ran on the devices the low one left
    steps, losses = zip(*losses_of(session_factory, low), strict=True)
    assert list(steps) == list(range(1, STEPS + 1))
    assert list(losses) == pytest.approx(reference_losses(STEPS, 4), rel=1e-5, abs=1e-6)


class Draining(InProcessCluster):
    """In-process runners on two nodes of two devices; Ray drains the nodes in ``drained``."""

    def __init__(self) -> None:
        super().__init__(
            [NodeInfo(c * 56, True, {DEVICE_RESOURCE: 2.0}, NODES[0].labels) for c in "ab"]
        )
        self.drained: set[str] = set()

    def nodes(self) -> list[NodeInfo]:
        return [replace(n, draining=n.node_id in self.drained) for n in super().nodes()]


def test_a_node_ray_drains_is_left_by_its_jobs_without_losing_a_step(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """A preemption notice through Ray (the node is draining): the devices of that node,
    and only those, are marked draining, and the job moves to the other node in place."""
    cluster = Draining()
    controller = make_controller(session_factory, cluster, tmp_path)
    job_id = running_job(session_factory, controller)
    with session_factory() as session:
        nodes = {row.id: row.node_id for row in session.scalars(sa.select(DeviceRow))}
    (node,) = {nodes[d] for d in job(session_factory, job_id).devices}
    cluster.drained.add(node)
    reconcile_until(
        controller, lambda: job(session_factory, job_id).state == "SUCCEEDED", timeout=180
    )
    with session_factory() as session:
        flags = {row.id: row.draining for row in session.scalars(sa.select(DeviceRow))}
    assert flags == {device: nodes[device] == node for device in nodes}
    history = events(session_factory, job_id)
    (moved,) = [e for e in history if e.kind == "relayout"]
    assert {nodes[d] for d in moved.data["removed"]} == {node} and len(moved.data["added"]) == 2
    assert not [e for e in history if e.kind in ("device_lost", "resumed", "suspend")]
    row = job(session_factory, job_id)
    assert {nodes[d] for d in row.devices} == {"ab"[node == "a" * 56] * 56} and row.attempt == 1
    steps, losses = zip(*losses_of(session_factory, job_id), strict=True)
    assert list(steps) == list(range(1, STEPS + 1))
    assert list(losses) == pytest.approx(reference_losses(STEPS, 4), rel=1e-5, abs=1e-6)


def test_a_step_replayed_within_one_report_is_stored_once_as_rerun(
    session_factory: SessionFactory,
) -> None:
    from shoal.service.reports import persist_report
    from shoal.workers.snapshot import RunnerReport, RunStatus, StepMetrics

    who = owner(session_factory)
    job_id = submit(session_factory, who)
    metrics = [StepMetrics(s, loss, 10.0, 0.1, ()) for s, loss in ((1, 0.5), (2, 0.4), (2, 0.3))]
    with session_factory() as session, session.begin():
        row = session.get(Job, job_id)
        assert row is not None
        persist_report(
            session, row, RunnerReport(RunStatus.RUNNING, 3, 2, tuple(metrics), (), None)
        )
    with session_factory() as session:
        stored = session.execute(
            sa.select(JobMetric.step, JobMetric.loss)
            .where(JobMetric.job_id == job_id)
            .order_by(JobMetric.step)
        ).all()
    assert [tuple(r) for r in stored] == [(1, 0.5), (2, 0.3)]


def test_a_device_overhead_a_worker_measured_is_kept_with_the_device(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    from shoal.service.jobs import largest_device_mb
    from shoal.service.reports import persist_report
    from shoal.workers.snapshot import RunnerEvent, RunnerReport, RunStatus

    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    controller.reconcile_once()  # the inventory: the node's two devices
    with session_factory() as session:
        rows = list(session.scalars(sa.select(DeviceRow).order_by(DeviceRow.id)))
    assert [r.overhead_mb for r in rows] == [None, None]
    memory = rows[0].memory_mb
    assert largest_device_mb(session_factory) == memory
    who = owner(session_factory)
    job_id = submit(session_factory, who)
    measured = RunnerEvent(
        "device_memory",
        0,
        "held before any stage",
        {"device_id": rows[0].id, "overhead_bytes": 600 * 2**20 + 1, "how": "process"},
    )
    with session_factory() as session, session.begin():
        row = session.get(Job, job_id)
        assert row is not None
        persist_report(session, row, RunnerReport(RunStatus.RUNNING, 0, 1, (), (measured,), None))
    with session_factory() as session:
        kept = session.get(DeviceRow, rows[0].id)
        assert kept is not None and kept.overhead_mb == 601  # whole MiB, rounded up
    # Both devices measured: submission sizes jobs by what stages can use.
    with session_factory() as session, session.begin():
        for device in session.scalars(sa.select(DeviceRow)):
            device.overhead_mb = 601
    assert largest_device_mb(session_factory) == memory - 601


def test_devices_are_planned_around_their_measured_overhead_or_a_gpus_estimate(
    session_factory: SessionFactory,
) -> None:
    """What the controller plans with (placement, resizes, a sweep's shard budgets) and the
    submission check: each device less what a worker measured it to hold, or, before any
    has, less the estimate on a GPU (a CPU device's memory is the host's: nothing)."""
    from shoal.service.inventory import inventory, sync_devices
    from shoal.service.jobs import largest_device_mb

    gpu = NodeInfo("e" * 56, True, {"GPU": 1.0}, {LABEL_MEMORY_MB: "81559"})
    nodes = [*NODES, gpu]
    devices = inventory(session_factory, nodes)
    assert sorted((d.gpu, d.overhead_mb) for d in devices) == [
        (False, 0),
        (False, 0),
        (True, UNMEASURED_GPU_OVERHEAD_MB),
    ]
    sync_devices(session_factory, devices, set())
    assert largest_device_mb(session_factory) == 81559 - UNMEASURED_GPU_OVERHEAD_MB
    with session_factory() as session, session.begin():
        for row in session.scalars(sa.select(DeviceRow)):
            row.overhead_mb = 600
    assert {d.overhead_mb for d in inventory(session_factory, nodes)} == {600}
    assert largest_device_mb(session_factory) == 81559 - 600


def test_stages_are_planned_in_what_a_device_has_beside_its_overhead(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    controller.reconcile_once()
    with session_factory() as session, session.begin():
        for device in session.scalars(sa.select(DeviceRow)):
            device.overhead_mb = device.memory_mb  # nothing left for a stage
    job_id = submit(session_factory, owner(session_factory))
    reconcile_until(
        controller,
        lambda: job(session_factory, job_id).state != JobState.QUEUED.value,
        what=lambda: job(session_factory, job_id).state,
    )
    failed = job(session_factory, job_id)
    assert failed.state == JobState.FAILED.value, failed.state
    assert "fits device memory" in str(failed.error), failed.error
    assert "has 0 B" in str(failed.error), failed.error


def trained_losses(controller: Controller, factory: SessionFactory, job_id: str) -> list[float]:
    """Reconcile until the job SUCCEEDED (failing with its state and error); its losses."""
    reconcile_until(
        controller,
        lambda: job(factory, job_id).state == "SUCCEEDED",
        what=lambda: (job(factory, job_id).state, job(factory, job_id).error),
    )
    with factory() as session:
        return list(
            session.scalars(
                sa.select(JobMetric.loss).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            )
        )


@IN_PROCESS
def test_sharded_replicas_asked_of_in_process_stages_train_whole_and_the_job_says_so(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    """``parallelism.shard`` through submission, the controller and the runner: in-process
    the replicas stay whole, and the job says so. (On Ray they shard: ``shard: auto``'s test
    through the controller, and every mode in tests/workers/pipeline/test_sharding.py.)"""
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    losses = {}
    for shard in ("full", "none"):
        job_id = submit(
            session_factory,
            who,
            name=f"shard-{shard}",
            steps=20,
            parallelism={"stages": 1, "replicas": 2, "shard": shard},
            resources={"min_devices": 2, "max_devices": 2},
            elastic={"repartition": False},  # in-memory copies on, sharded or not
        )
        losses[shard] = trained_losses(controller, session_factory, job_id)
        said = [e.data["sharded"] for e in events(session_factory, job_id) if e.kind == "shard"]
        assert said == ([False] if shard != "none" else []), said
    assert len(losses["full"]) == 20
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-5, abs=1e-6)


@IN_PROCESS  # on Ray: tests/workers/pipeline/test_tensor_stages.py
def test_a_tensor_parallel_job_trains_as_one_on_one_device(
    session_factory: SessionFactory, cluster: Cluster, tmp_path: Path
) -> None:
    """``parallelism.tensor`` through submission, placement, the layout and the runner: a
    stage on a group of two devices of the node, its blocks split over them, trains as the
    same stage on one device does (within float rounding: the split sums in another order)."""
    controller = make_controller(session_factory, cluster, tmp_path)
    who = owner(session_factory)
    losses, flops = {}, {}
    for tensor in (2, 1):
        job_id = submit(
            session_factory,
            who,
            name=f"tensor-{tensor}",
            steps=20,
            parallelism={"stages": 1, "replicas": 1, "tensor": tensor},
            resources={"min_devices": tensor, "max_devices": tensor},
            elastic={"repartition": False},
        )
        losses[tensor] = trained_losses(controller, session_factory, job_id)
        ran = job(session_factory, job_id)
        (row,) = ran.partition
        assert len(ran.devices) == tensor and row["device_id"] == ran.devices[0], ran.devices
        assert row["tensor_devices"] == ran.devices[1:], ran.partition
        flops[tensor] = _flops_by_mfu(session_factory, job_id)
    assert len(losses[2]) == 20
    assert losses[2] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    # MFU counts the whole group's peak: the same model's FLOPs either way.
    assert flops[2] == pytest.approx(flops[1]), flops


def _flops_by_mfu(session_factory: SessionFactory, job_id: str) -> list[float]:
    """Each step's FLOPs as its MFU says: MFU x seconds x the summed peak of every device the
    step's stages name (CPU devices peak at what they measured)."""
    with session_factory() as session:
        gflops = {d.id: d.speed_gflops or 0.0 for d in session.scalars(sa.select(DeviceRow))}
        metrics = session.scalars(
            sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        ).all()
    named = [[d for s in m.stages for d in (s["device_id"], *s["tensor_devices"])] for m in metrics]
    assert all(m.mfu is not None for m in metrics), [m.mfu for m in metrics]
    return [
        (m.mfu or 0.0) * m.step_time_s * sum(gflops[d] for d in ds) * 1e9
        for m, ds in zip(metrics, named, strict=True)
    ]


class SmallDeviceRay(TwoDeviceRay):
    """The session's Ray, its two devices shown with 23 MB of memory each."""

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(n.node_id, n.alive, n.resources, {**n.labels, LABEL_MEMORY_MB: "23"})
            for n in super().nodes()
        ]


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_shard_auto_shards_the_replicas_where_whole_ones_fit_no_layout(
    session_factory: SessionFactory, tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Two 23 MB devices: two whole replicas of this MLP with Adam fit neither (26 MB
    would), sharded ones do; ``shard: auto`` places them sharded and says why. On Ray the
    replicas shard (with their in-memory copies, as by default); in-process they stay
    whole, and the job's event says what it asked for."""
    small: Cluster
    if backend == "ray":
        small = SmallDeviceRay(request.getfixturevalue("ray_address"), timeout_s=30)
    else:
        labels = {LABEL_KIND: "cpu", LABEL_MEMORY_MB: "23"}
        small = InProcessCluster([NodeInfo("e" * 56, True, {DEVICE_RESOURCE: 2.0}, labels)])
    controller = make_controller(session_factory, small, tmp_path)
    job_id = submit(
        session_factory,
        owner(session_factory),
        name="auto-shard",
        model={"builtin": "mlp", "config": {"hidden": 1024, "layers": 2}},
        steps=3,
        parallelism={"stages": 1, "replicas": 2, "shard": "auto"},
        resources={"min_devices": 2, "max_devices": 2},
        elastic={"repartition": False},
    )
    reconcile_until(
        controller,
        lambda: job(session_factory, job_id).state == "SUCCEEDED",
        what=lambda: (job(session_factory, job_id).state, job(session_factory, job_id).error),
    )
    said = events(session_factory, job_id)
    placed = [e.message for e in said if "placed on" in e.message]
    assert placed and "replicas sharded (gradients)" in placed[0], placed
    (shard,) = [e.data for e in said if e.kind == "shard"]
    assert (shard["shard"], shard["sharded"]) == ("gradients", backend == "ray")


class RefusingFirstMove(LocalGroup):
    """A LocalGroup whose first move onto devices it does not have fails as one onto a
    device Ray cannot place a worker on does (``RayGroup.regroup``, ``CANNOT_HOST``): the
    group stays as it was."""

    refusals = 1
    """The moves onto new devices still to refuse (the test's one job's)."""

    def regroup(self, plans: Sequence[StagePlan], keep: Mapping[int, int]) -> None:
        new = [p for w, p in enumerate(plans) if w not in keep]
        if new and type(self).refusals > 0:
            type(self).refusals -= 1
            raise self.refusal(new[0])
        super().regroup(plans, keep)

    def refusal(self, plan: StagePlan) -> StageLost:
        return StageLost(plan.index, plan.device.id, CANNOT_HOST)


def test_a_job_whose_move_failed_is_moved_again(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """A growth whose new worker does not start is that device's loss, recovered in place
    from the copies; the move is over (``relayout_failed``): the controller asks again and
    the job grows, every step once and exact."""
    RefusingFirstMove.refusals = 1
    cluster = Resizable(InProcessCluster(FOUR_DEVICES, make_group=RefusingFirstMove), 2)
    controller = make_controller(session_factory, cluster, tmp_path)  # type: ignore[arg-type]
    job_id = growing_job(session_factory, controller, steps=UNENDING)
    cluster.devices = 4
    history = cancel_after(session_factory, controller, job_id, "relayout")
    kinds = [e.kind for e in history if e.kind in ("resize", "relayout_failed", "relayout")]
    assert kinds == ["resize", "relayout_failed", "resize", "relayout"], kinds
    (failed,) = [e for e in history if e.kind == "relayout_failed"]
    assert CANNOT_HOST in failed.message, failed.message
    (lost,) = [e for e in history if e.kind == "device_lost"]
    assert lost.data["devices"] == [failed.data["device_id"]], (lost.data, failed.data)
    assert job(session_factory, job_id).attempt == 1
    assert_exact_steps(session_factory, job_id)
