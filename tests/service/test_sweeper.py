"""Sweeps end to end through the controller, on a real database (SQLite and PostgreSQL),
with in-process runners: trials are jobs, Optuna samples and prunes, the best checkpoints
stay, a cancel reaches every trial, a restarted control plane carries a sweep on, and a
sweep leaves a draining or lost node with its trials."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from shoal.scheduler.devices import DEVICE_RESOURCE, Device, NodeInfo
from shoal.service import sweeper as sweeper_module
from shoal.service.auth import Principal
from shoal.service.cluster import InProcessCluster
from shoal.service.controller import Controller
from shoal.service.db.models import (
    Checkpoint,
    DeviceRow,
    Job,
    JobEvent,
    JobMetric,
    Sweep,
    Trial,
    User,
)
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.jobs import restart_job
from shoal.service.sweeps import list_trials, request_cancel, submit_sweep, trial_state
from shoal.service.sweepspec import SweepSpec, validate_sweep_spec
from shoal.workers.reference import train_reference
from shoal.workers.sharp.shard_pool import HostLost, LocalPool, _Local
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf, RunnerEvent
from tests.factories import sweep_spec
from tests.service.test_controller import NODES, make_controller, owner, reconcile_until

pytestmark = pytest.mark.integration


def sweep_of(factory: SessionFactory, sweep_id: str) -> tuple[Sweep, list[Trial]]:
    with factory() as session:
        sweep = session.get(Sweep, sweep_id)
        assert sweep is not None
        return sweep, list(list_trials(session, sweep_id))


def ended(factory: SessionFactory, sweep_id: str) -> bool:
    return sweep_of(factory, sweep_id)[0].state in ("SUCCEEDED", "FAILED", "CANCELLED")


def standalone_losses(spec: dict[str, object], lr: float) -> list[float]:
    base = spec["base"]
    assert isinstance(base, dict)
    return train_reference(
        ModelRef("mlp", None, base["model"]["config"]),
        DataRef("digits", None, {}),
        OptimizerConf("sgd", lr),
        batch_size=base["batch_size"],
        micro_batches=base["micro_batches"],
        steps=base["steps"],
        seed=0,
    ).losses


def submit(
    factory: SessionFactory, who: Principal, **overrides: object
) -> tuple[str, dict[str, object]]:
    spec = sweep_spec(**overrides)
    return submit_sweep(factory, who, validate_sweep_spec(spec, []))[0].id, spec


@pytest.fixture
def alice(session_factory: SessionFactory) -> Principal:
    return owner(session_factory)


@pytest.mark.parametrize("executor", ["sharp", "jobs"])
def test_a_sweep_samples_prunes_keeps_the_best_and_each_trial_trains_like_alone(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path, executor: str
) -> None:
    """Trials on the sweep's SHARP executor (two shared devices) or each a job of its own."""
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    sweep_id, spec = submit(session_factory, alice, executor=executor)
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)

    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and len(trials) == 8
    states = [trial_state(t) for t in trials]
    assert set(states) <= {"SUCCEEDED", "PRUNED"} and "PRUNED" in states, states
    lrs = [t.params["optimizer.lr"] for t in trials]
    assert len(set(lrs)) == 8 and all(0.001 <= lr <= 0.5 for lr in lrs)
    with session_factory() as session:
        for trial in trials:
            assert trial.job.spec["optimizer"]["lr"] == trial.params["optimizer.lr"]
            losses = list(
                session.scalars(
                    sa.select(JobMetric.loss)
                    .where(JobMetric.job_id == trial.job_id)
                    .order_by(JobMetric.step)
                )
            )
            alone = standalone_losses(spec, trial.params["optimizer.lr"])
            if trial.pruned:
                # Cancelled at its next step boundary: a fast trial may have ended first.
                assert trial.objective is None and len(losses) <= len(alone)
                assert losses == pytest.approx(alone[: len(losses)], rel=1e-5, abs=1e-6)
            else:
                assert losses == pytest.approx(alone, rel=1e-5, abs=1e-6)
                assert trial.objective == losses[-1]
            steps = sorted(int(s) for s in trial.intermediate)
            assert steps and all(s % 5 == 0 for s in steps)
            # Every step's MFU is known: a SHARP trial's over its sweep's shared devices,
            # whose speeds the executor measured when it placed its first model there.
            mfus = list(
                session.scalars(sa.select(JobMetric.mfu).where(JobMetric.job_id == trial.job_id))
            )
            assert mfus and all(m is not None and 0 < m < 1 for m in mfus), mfus
            (placement,) = session.scalars(
                sa.select(JobEvent.data).where(
                    JobEvent.job_id == trial.job_id, JobEvent.kind == "placement"
                )
            )
            assert placement.get("executor") == ("sharp" if executor == "sharp" else None)
            assert (trial.job.pool == sweep_id) == (executor == "sharp")
        kept = set(session.scalars(sa.select(Checkpoint.job_id).distinct()))
    completed = sorted((t for t in trials if not t.pruned), key=lambda t: t.objective or 0.0)
    assert kept == {t.job_id for t in completed[:2]}
    assert all(t.checkpoints_dropped == (t.job_id not in kept) for t in trials)


def test_a_sweep_waits_while_its_owner_is_at_their_device_quota(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    def allow(devices: int) -> None:
        with transaction(session_factory) as session:
            user = session.get(User, alice.user_id)
            assert user is not None
            user.max_devices = devices

    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    allow(1)
    base = {**sweep_spec()["base"], "steps": 5}
    sweep_id, _ = submit(session_factory, alice, executor="sharp", devices=2, base=base)
    for _ in range(5):
        controller.reconcile_once()
    sweep, trials = sweep_of(session_factory, sweep_id)
    assert (sweep.state, sweep.devices, trials) == ("QUEUED", [], [])
    allow(2)
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=120)
    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and len(trials) == 8


def cancelled_sweep(
    factory: SessionFactory, who: Principal, controller: Controller, executor: str = "sharp"
) -> str:
    """A sweep of two long trials, cancelled once both run; waits until it has ended."""
    sweep_id, _ = submit(
        factory,
        who,
        executor=executor,
        max_concurrent=2,
        early_stopping={"rule": "none"},
        base={**sweep_spec()["base"], "steps": 100_000},
    )
    reconcile_until(controller, lambda: len(sweep_of(factory, sweep_id)[1]) == 2)
    request_cancel(factory, who, sweep_id)
    reconcile_until(controller, lambda: ended(factory, sweep_id), timeout=120)
    return sweep_id


def test_cancelling_a_sweep_cancels_its_trials(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    sweep, trials = sweep_of(session_factory, cancelled_sweep(session_factory, alice, controller))
    assert sweep.state == "CANCELLED" and len(trials) == 2
    assert [trial_state(t) for t in trials] == ["CANCELLED", "CANCELLED"]


@pytest.mark.parametrize("executor", ["sharp", "jobs"])
def test_a_trial_of_an_ended_sweep_restarted_runs_as_a_job_of_its_own(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path, executor: str
) -> None:
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    sweep_id = cancelled_sweep(session_factory, alice, controller, executor)
    trial = sweep_of(session_factory, sweep_id)[1][0]
    with transaction(session_factory) as session:  # a short rerun
        job = session.get(Job, trial.job_id)
        assert job is not None
        job.spec = {**job.spec, "steps": job.step + 3}
    restart_job(session_factory, alice, trial.job_id)

    def state() -> tuple[str, str | None, int]:
        with session_factory() as session:
            job = session.get(Job, trial.job_id)
            assert job is not None
            return job.state, job.pool, job.step

    reconcile_until(controller, lambda: state()[0] == "SUCCEEDED", timeout=60, what=state)
    assert state()[1] is None
    assert sweep_of(session_factory, sweep_id)[0].state == "CANCELLED"


def test_a_restarted_control_plane_carries_the_sweep_on(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    cluster = InProcessCluster(NODES)
    first = make_controller(session_factory, cluster, tmp_path)
    sweep_id, _ = submit(session_factory, alice, max_trials=6, early_stopping={"rule": "none"})
    reconcile_until(first, lambda: sum(t.told for t in sweep_of(session_factory, sweep_id)[1]) >= 3)
    second: Controller = make_controller(session_factory, cluster, tmp_path)
    reconcile_until(second, lambda: ended(session_factory, sweep_id), timeout=240)
    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED"
    assert [t.number for t in trials] == list(range(6))
    assert all(trial_state(t) == "SUCCEEDED" and t.objective is not None for t in trials)


def test_a_database_lost_as_a_trial_is_told_leaves_the_study_as_the_database_has_it(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """Writing a trial's end fails (the server restarting): the study, told already, is
    rebuilt from the database, which tells it again; the sweep carries on."""
    controller = make_controller(session_factory, InProcessCluster(NODES), tmp_path)
    sweep_id, _ = submit(session_factory, alice, max_trials=4, early_stopping={"rule": "none"})
    failed: list[int] = []

    def restart_at_first_tell(session: Session, *_: object) -> None:
        told = [
            o
            for o in session.dirty
            if isinstance(o, Trial) and o.told and sa.inspect(o).attrs.told.history.has_changes()
        ]
        if told and not failed:
            failed.append(told[0].number)
            raise OperationalError("UPDATE trials", {}, ConnectionError("the server restarts"))

    sa.event.listen(session_factory, "before_flush", restart_at_first_tell)
    try:
        reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)
    finally:
        sa.event.remove(session_factory, "before_flush", restart_at_first_tell)
    sweep, trials = sweep_of(session_factory, sweep_id)
    assert failed, "no trial's end was committed"
    assert sweep.state == "SUCCEEDED", sweep.error
    assert all(trial_state(t) == "SUCCEEDED" and t.told for t in trials), [
        (t.number, trial_state(t), t.told) for t in trials
    ]


class TwoNodes(InProcessCluster):
    """In-process executors on two nodes of two devices. Ray drains the nodes in
    ``drained``; the nodes and devices in ``dead`` fail every call, and Ray still lists
    them (it has not noticed yet)."""

    def __init__(self) -> None:
        self.drained: set[str] = set()
        self.dead: set[str] = set()
        super().__init__(
            [NodeInfo(c * 56, True, {DEVICE_RESOURCE: 2.0}, NODES[0].labels) for c in "ab"],
            make_pool=lambda devices, budgets: VanishingPool(devices, budgets, self.dead),
        )

    def nodes(self) -> list[NodeInfo]:
        return [replace(n, draining=n.node_id in self.drained) for n in super().nodes()]


class VanishingPool(LocalPool):
    """Shard workers in this process; those on the nodes or devices in ``dead`` are lost."""

    def __init__(self, devices: Sequence[Device], budgets: Any, dead: set[str]) -> None:
        super().__init__(devices, budgets)
        self._dead = dead

    def submit(self, host: int, method: str, *args: Any) -> Any:
        device = self.devices[host]
        if not {device.node_id, device.id} & self._dead:
            return super().submit(host, method, *args)
        failed: Future[Any] = Future()
        failed.set_exception(HostLost(device.id, "its node died"))
        return _Local(host, method, failed)


def long_sweep(factory: SessionFactory, who: Principal) -> tuple[str, dict[str, object]]:
    """Three trials, two at a time on the sweep's two devices, long enough to be moved."""
    base = {**sweep_spec()["base"], "steps": 120, "checkpoint": {"every_steps": 20, "keep": 2}}
    return submit(
        factory,
        who,
        executor="sharp",
        devices=2,
        max_trials=3,
        max_concurrent=2,
        early_stopping={"rule": "none"},
        base=base,
    )


def trial_history(factory: SessionFactory, job_id: str) -> tuple[list[str], list[JobEvent]]:
    with factory() as session:
        history = list(
            session.scalars(
                sa.select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            )
        )
    return [e.data["to"] for e in history if e.kind == "state"], history


def assert_exact(factory: SessionFactory, spec: dict[str, object], trial: Trial) -> None:
    """Every step stored once, with the losses of the trial's plain single-process run."""
    with factory() as session:
        metrics = session.execute(
            sa.select(JobMetric.step, JobMetric.loss)
            .where(JobMetric.job_id == trial.job_id)
            .order_by(JobMetric.step)
        ).all()
    alone = standalone_losses(spec, trial.params["optimizer.lr"])
    assert [step for step, _ in metrics] == list(range(1, len(alone) + 1))
    assert [loss for _, loss in metrics] == pytest.approx(alone, rel=1e-5, abs=1e-6)


def node_devices(factory: SessionFactory, node: str) -> set[str]:
    with factory() as session:
        return set(session.scalars(sa.select(DeviceRow.id).where(DeviceRow.node_id == node)))


def start_moving(controller: Controller, factory: SessionFactory, sweep_id: str, past: int) -> str:
    """Once two trials are past step ``past``: the node the sweep's devices are on."""
    reconcile_until(
        controller,
        lambda: sum(t.job.step >= past for t in sweep_of(factory, sweep_id)[1]) == 2,
        timeout=120,
    )
    held = sweep_of(factory, sweep_id)[0].devices
    with factory() as session:
        rows = session.scalars(sa.select(DeviceRow).where(DeviceRow.id.in_(held)))
        (node,) = {row.node_id for row in rows}
    return node


def test_a_sweep_leaves_a_draining_node_and_its_trials_lose_no_step(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """Ray's preemption notice for the node of the sweep's devices: its running trials
    checkpoint at their next step boundary, the executor is placed on the other node, and
    they resume there from those checkpoints, replaying nothing."""
    cluster = TwoNodes()
    controller = make_controller(session_factory, cluster, tmp_path)
    sweep_id, spec = long_sweep(session_factory, alice)
    node = start_moving(controller, session_factory, sweep_id, past=5)
    cluster.drained.add(node)
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)

    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and [trial_state(t) for t in trials] == ["SUCCEEDED"] * 3
    drained = node_devices(session_factory, node)
    moved = 0
    for trial in trials:
        assert_exact(session_factory, spec, trial)
        states, history = trial_history(session_factory, trial.job_id)
        assert not [e for e in history if e.kind == "device_lost"]
        if "QUEUED" in states[1:]:
            moved += 1
            assert states[-4:] == ["RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
            (suspended,) = [e for e in history if e.kind == "suspended"]
            (resumed,) = [e for e in history if e.kind == "resumed"]
            assert resumed.data["step"] == suspended.data["step"]
            assert resumed.data["steps_replayed"] == 0
        assert trial.job.devices and not set(trial.job.devices) & drained
    assert moved == 2  # the two running at the notice; the third started after the move


def test_a_sweep_that_lost_every_device_resumes_its_trials_elsewhere_from_checkpoints(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """The node of both of the sweep's devices dies: no device holds the trials' shards
    or their in-memory copies, so they wait QUEUED, and the sweep's executor, placed again
    on the other node (not on that one, which Ray still lists), resumes each from its
    latest checkpoint; the steps since then are trained again and stored once."""
    cluster = TwoNodes()
    controller = make_controller(session_factory, cluster, tmp_path)
    sweep_id, spec = long_sweep(session_factory, alice)
    node = start_moving(controller, session_factory, sweep_id, past=25)  # a checkpoint at 20
    cluster.dead.add(node)
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)

    sweep, trials = sweep_of(session_factory, sweep_id)
    gone = node_devices(session_factory, node)
    assert sweep.state == "SUCCEEDED" and [trial_state(t) for t in trials] == ["SUCCEEDED"] * 3
    lost = 0
    for trial in trials:
        assert_exact(session_factory, spec, trial)
        states, history = trial_history(session_factory, trial.job_id)
        losses = [e for e in history if e.kind == "device_lost"]
        if losses:
            lost += 1
            (why,) = [e.message for e in history if e.data.get("to") == "RECOVERING"]
            assert "no device is left" in why and set(losses[0].data["devices"]) <= gone
            assert len(losses) == 1 and not set(trial.job.devices) & gone
            assert states[-4:] == ["RECOVERING", "QUEUED", "RUNNING", "SUCCEEDED"]
            (resumed,) = [e for e in history if e.kind == "resumed"]
            # A checkpoint before the last step: how far the trials got before Ray saw the
            # node die depends on the machine's load.
            assert resumed.data["step"] == losses[-1].data["resume_step"] in range(20, 120, 20)
    assert lost == 2


def test_a_sweep_that_lost_a_device_goes_on_and_moves_back_onto_as_many_as_it_asked_for(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """One of the sweep's two devices dies: the executor moves its shards onto the other
    from the copies in memory and trains on; as two devices are free (on the other node:
    the first one may be dying too), the trials checkpoint and resume there, exact."""
    cluster = TwoNodes()
    controller = make_controller(session_factory, cluster, tmp_path)
    sweep_id, spec = long_sweep(session_factory, alice)
    node = start_moving(controller, session_factory, sweep_id, past=5)
    cluster.dead.add(sorted(node_devices(session_factory, node))[1])
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)

    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and [trial_state(t) for t in trials] == ["SUCCEEDED"] * 3
    first = node_devices(session_factory, node)
    moved = 0
    last_placed: set[str] = set()  # where the executor on the other node placed each trial
    for trial in trials:
        assert_exact(session_factory, spec, trial)
        states, history = trial_history(session_factory, trial.job_id)
        lost = [e for e in history if e.kind == "device_lost"]
        # From the copy in memory: at most the steps between two copies.
        assert all(e.data["steps_replayed"] <= e.data["most_replayed"] for e in lost)
        if "QUEUED" in states[1:]:
            moved += 1
            assert states[-4:] == ["RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
            (resumed,) = [e for e in history if e.kind == "resumed"]
            assert resumed.data["steps_replayed"] == 0
        assert trial.job.devices and not set(trial.job.devices) & first
        placed = [e for e in history if e.kind == "placement"][-1]
        last_placed |= {row["device_id"] for row in placed.data["stages"]}
    assert moved == 2
    assert len(last_placed) == 2 and not last_placed & first, last_placed


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sweep_goes_on_without_a_device_its_executor_lost_and_the_control_plane_drains(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """A device the executor has already lost and the control plane then drains (as one
    set aside: lost first, its event then drains it) is not one the sweep must leave:
    before, the sweep left it anyway, suspending its trials, and here (one node, the other
    device draining) waited for two free devices forever."""
    dead: set[str] = set()
    cluster = InProcessCluster(NODES, make_pool=lambda d, b: VanishingPool(d, b, dead))
    controller = make_controller(session_factory, cluster, tmp_path)
    sweep_id, spec = long_sweep(session_factory, alice)
    start_moving(controller, session_factory, sweep_id, past=5)
    gone = sweep_of(session_factory, sweep_id)[0].devices[1]
    dead.add(gone)
    deadline = time.monotonic() + 60
    while gone not in cluster.lost_pool_devices(sweep_id):  # no tick meanwhile: not seen yet
        assert time.monotonic() < deadline, f"the executor did not lose {gone}"
        time.sleep(0.05)
    with transaction(session_factory) as session:
        row = session.get(DeviceRow, gone)
        assert row is not None
        row.draining, row.drain_reason = True, f"device {gone} was set aside"

    def where() -> object:
        sweep, trials = sweep_of(session_factory, sweep_id)
        return sweep.state, sweep.devices, [(trial_state(t), t.job.step) for t in trials]

    reconcile_until(controller, lambda: ended(session_factory, sweep_id), 120, where)

    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and [trial_state(t) for t in trials] == ["SUCCEEDED"] * 3
    for trial in trials:
        assert_exact(session_factory, spec, trial)
        states, _ = trial_history(session_factory, trial.job_id)
        assert states.count("QUEUED") <= 1, states  # never suspended to be placed again


class FailingGpuPool(LocalPool):
    """Shard workers in this process; the second device's errs as it is measured (a
    failing GPU whose CUDA calls raise), as in ``tests/workers/sharp/test_set_aside.py``."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host != 1 or method != "measure_speed":
            return super().submit(host, method, *args)
        failed: Future[Any] = Future()
        failed.set_exception(ShardFailed(self.devices[host].id, method, "CUDA error: launch"))
        return _Local(host, method, failed)


def test_a_device_a_sweep_set_aside_is_drained_saying_why_and_the_sweep_goes_on_without_it(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """The sweep's executor sets aside a device its worker fails on: the control plane
    drains it with the executor's reason, so nothing more is placed there until an admin
    ends the drain, and the sweep trains on on its other device (not suspended to leave
    a draining device it no longer holds), every trial exact."""
    cluster = InProcessCluster(NODES, make_pool=FailingGpuPool)
    controller = make_controller(session_factory, cluster, tmp_path)
    sweep_id, spec = submit(
        session_factory,
        alice,
        executor="sharp",
        devices=2,
        max_trials=2,
        max_concurrent=2,
        early_stopping={"rule": "none"},
    )
    reconcile_until(controller, lambda: ended(session_factory, sweep_id), timeout=240)

    sweep, trials = sweep_of(session_factory, sweep_id)
    assert sweep.state == "SUCCEEDED" and [trial_state(t) for t in trials] == ["SUCCEEDED"] * 2
    for trial in trials:
        assert_exact(session_factory, spec, trial)
        states, _ = trial_history(session_factory, trial.job_id)
        assert states[1:] == ["RUNNING", "SUCCEEDED"], states
    with session_factory() as session:
        rows = session.scalars(sa.select(DeviceRow).order_by(DeviceRow.id)).all()
    drained = [(row.id, row.drain_reason) for row in rows if row.draining]
    assert len(drained) == 1, drained
    ((device_id, reason),) = drained
    assert reason is not None and reason.startswith(f"device {device_id} was set aside"), reason
    assert "measure_speed: CUDA error: launch" in reason


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sweep_avoids_the_node_of_devices_it_lost_for_suspect_s_then_places_there_again(
    session_factory: SessionFactory,
    alice: Principal,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For ``SUSPECT_S`` after a loss on a node (Ray lists a SIGKILLed node until its health
    checks fail) the sweep's placements leave that node's devices out: with one device
    elsewhere the sweep of two waits; after it, the node's devices are placeable again."""
    controller = make_controller(session_factory, TwoNodes(), tmp_path)
    sweep_id, _ = long_sweep(session_factory, alice)
    suspect, other = "a" * 56, "b" * 56
    devices = [Device(f"a-cpu-{i}", suspect, i, "cpu", 2048, False) for i in range(2)]
    devices.append(Device("b-cpu-0", other, 0, "cpu", 2048, False))
    now = [1000.0]
    monkeypatch.setattr(sweeper_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    sweeper = controller._sweeper
    sweeper._suspected(sweep_id, {suspect})

    def placed() -> list[Device] | None:
        with session_factory() as session:
            sweep = session.get(Sweep, sweep_id)
            assert sweep is not None
            spec = SweepSpec.model_validate(sweep.spec)
            return sweeper._placement(session, sweep, spec, devices)

    now[0] += sweeper_module.SUSPECT_S - 1
    assert placed() is None
    now[0] += 2
    chosen = placed()
    assert chosen is not None and len(chosen) == 2
    assert {d.node_id for d in chosen} >= {suspect}, chosen


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sweep_is_not_placed_on_a_device_no_worker_started_on_lately(
    session_factory: SessionFactory, alice: Principal, tmp_path: Path
) -> None:
    """A device a worker did not start on (``worker_not_started``, ``service.setbacks``)
    is left out of a sweep's placement as of a job's: with it, too few devices are left."""
    controller = make_controller(session_factory, TwoNodes(), tmp_path)
    sweep_id, _ = long_sweep(session_factory, alice)
    devices = [Device(f"a-cpu-{i}", "a" * 56, i, "cpu", 2048, False) for i in range(3)]

    def placed() -> list[Device] | None:
        with session_factory() as session:
            sweep = session.get(Sweep, sweep_id)
            assert sweep is not None
            spec = SweepSpec.model_validate(sweep.spec)
            return controller._sweeper._placement(session, sweep, spec, devices)

    said = RunnerEvent("worker_not_started", 0, "held", {"device_id": devices[0].id})
    assert controller._setbacks.not_started([said])
    chosen = placed()
    assert chosen is not None and devices[0] not in chosen, chosen
    said = RunnerEvent("worker_not_started", 0, "held", {"device_id": devices[1].id})
    assert controller._setbacks.not_started([said])
    assert placed() is None
