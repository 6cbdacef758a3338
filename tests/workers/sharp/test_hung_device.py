"""A device whose worker hangs in a call while the other devices go on is given up as lost
once none of its calls has ended for the task timeout (``scheduler.silence``): its models
roll back to their copies and train on exactly as alone. Before, the executor waited for it
for good (its timeout fired only when no call of any device ended), each model there saying
``stalled`` once a minute."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool
from shoal.workers.snapshot import JobSnapshot, RunStatus
from tests.workers.sharp.test_sharp_runner import (
    assert_alone,
    budget_for_shards,
    devices,
    model,
    placed_first,
)

TIMEOUT_S = 5.0
RELEASE_S = 90.0
"""When the hung threads are let go whatever happened: a run that waits for one for good
then ends, and the test fails saying how, not at the suite's timeout."""


class HangingPool(LocalPool):
    """A LocalPool whose device where the first model placed lives hangs in its
    ``hang_at``-th shard task there (its thread blocked until the test ends) and answers
    nothing after it."""

    hang_at = 6

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.tasks = 0
        self.hung = threading.Event()
        self.release = threading.Event()

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host == placed_first(self, host, method) and method in ("forward", "backward"):
            self.tasks += 1
            if self.tasks == self.hang_at:
                return self.hang(host, method)
        return super().submit(host, method, *args)

    def hang(self, host: int, method: str) -> Any:
        """A call of ``method`` on ``host`` that hangs its thread until the test ends."""
        return self._local(host, method, self._threads[host].submit(self._hang))

    def _hang(self) -> None:
        self.hung.set()
        self.release.wait()


def run_hanging(
    tmp_path: Path, pool_class: type[HangingPool]
) -> tuple[list[JobSnapshot], SharpTrainer, dict[str, RunStatus], HangingPool]:
    """Two models trained on two devices of a ``pool_class`` pool, task timeout
    ``TIMEOUT_S``: the models, the trainer, their statuses and the pool (its hung threads
    let go once the run has ended)."""
    snaps = [
        model(tmp_path, "a", steps=5, keep_copies=True, copy_budget=1.0),
        model(tmp_path, "b", seed=9, steps=5, keep_copies=True, copy_budget=1.0),
    ]
    pools: list[HangingPool] = []

    def make_pool(devices: Any, budgets: Any) -> HangingPool:
        pools.append(pool_class(devices, budgets))
        watchdog = threading.Timer(RELEASE_S, pools[-1].release.set)
        watchdog.daemon = True
        watchdog.start()
        return pools[-1]

    on = devices()
    budget = budget_for_shards(snaps[0], 3)
    trainer = SharpTrainer(
        snaps, on, make_pool, budgets={d.id: budget for d in on}, task_timeout_s=TIMEOUT_S
    )
    try:
        statuses = trainer.run()
    finally:
        for pool in pools:
            pool.release.set()
    (pool,) = pools
    return snaps, trainer, statuses, pool


@pytest.mark.unit
def test_a_device_hung_in_a_call_is_given_up_and_its_models_train_on_exactly(
    tmp_path: Path,
) -> None:
    snaps, trainer, statuses, pool = run_hanging(tmp_path, HangingPool)
    assert pool.hung.is_set(), f"no task hung: {pool.tasks} tasks on the device"
    assert_one_given_up_and_exact(snaps, trainer, statuses)


def assert_one_given_up_and_exact(
    snaps: list[JobSnapshot], trainer: SharpTrainer, statuses: dict[str, RunStatus]
) -> None:
    """Both models SUCCEEDED exactly as alone, one device lost as hung, said where it was."""
    reports = {job: trainer.report(job, 0) for job in statuses}
    assert set(statuses.values()) == {RunStatus.SUCCEEDED}, {j: r.error for j, r in reports.items()}
    (dead,) = trainer.lost_devices()
    lost = [e for r in reports.values() for e in r.events if e.kind == "device_lost"]
    assert lost, {job: [e.kind for e in r.events] for job, r in reports.items()}
    for event in lost:
        assert event.data["devices"] == [dead], event
        assert "none of its calls ended for 5 s" in event.message, event.message
    for snap in snaps:
        latest = {m.step: m.loss for m in reports[snap.job_id].metrics}  # replays replace
        assert sorted(latest) == list(range(1, 6))
        assert_alone(snap, [latest[s] for s in range(1, 6)])


class EveryDeviceHangingPool(HangingPool):
    """A HangingPool where every device hangs in each shard task from the ``hang_at``-th
    (counted on all devices) on."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method in ("forward", "backward"):
            self.tasks += 1
            if self.tasks >= self.hang_at:
                return self.hang(host, method)
        return LocalPool.submit(self, host, method, *args)


@pytest.mark.unit
def test_every_device_hung_ends_the_models_lost_for_the_control_plane_to_resume(
    tmp_path: Path,
) -> None:
    """With every device given up the models are LOST (the control plane resumes a LOST
    run from its checkpoint, elsewhere), saying why; before, the executor failed with every
    model (FAILED: "no shard task finished within" the timeout)."""
    _, trainer, statuses, _ = run_hanging(tmp_path, EveryDeviceHangingPool)
    errors = {job: trainer.report(job, 0).error or "" for job in statuses}
    assert statuses == {"a": RunStatus.LOST, "b": RunStatus.LOST}, errors
    for error in errors.values():
        assert "its worker hangs" in error and "no device is left" in error, errors
    assert sorted(trainer.lost_devices()) == sorted(d.id for d in devices())


class RecoveryHangingPool(HangingPool):
    """A HangingPool whose other device hangs in each call from the first device's give-up
    on: the calls re-forming the models there never end."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if self._given_up and host not in self._given_up:
            return self.hang(host, method)
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_a_device_hung_in_a_recovery_is_given_up_too(tmp_path: Path) -> None:
    """A device hung in a call re-forming a model after another's loss is given up as
    hung, as in the dispatch loop: the models still training, with no device left, are LOST;
    before, the recovery's wait timed out and the executor failed with every model."""
    _, trainer, statuses, pool = run_hanging(tmp_path, RecoveryHangingPool)
    errors = {job: trainer.report(job, 0).error or "" for job in statuses}
    # b, on the other device, may have trained all its steps first.
    assert statuses["a"] is RunStatus.LOST, (statuses, errors)
    assert statuses["b"] in (RunStatus.LOST, RunStatus.SUCCEEDED), (statuses, errors)
    lost = {job for job, status in statuses.items() if status is RunStatus.LOST}
    assert set(pool._given_up) == {0, 1}, pool._given_up
    for job in lost:
        assert "its worker hangs" in errors[job] and "no device is left" in errors[job], errors


class CopyHangingPool(HangingPool):
    """A LocalPool whose device gets the first copy of a model (taken as the model arrives,
    ``keep_copies``) hangs in it and answers nothing after it."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method == "copy" and self.tasks == 0:
            self.tasks += 1
            return self.hang(host, method)
        return LocalPool.submit(self, host, method, *args)


@pytest.mark.unit
def test_a_device_hung_in_a_gather_is_given_up_and_the_models_train_on_exactly(
    tmp_path: Path,
) -> None:
    """The executor's waits at a model's arrival or step boundary (its state gathered for a
    copy or a checkpoint, a move) give a hung device up too: its models are placed again
    and train on exactly. Before, the wait timed out and the executor failed every model."""
    snaps, trainer, statuses, pool = run_hanging(tmp_path, CopyHangingPool)
    assert pool.hung.is_set(), "no copy hung"
    assert len(pool._given_up) == 1, pool._given_up
    assert_one_given_up_and_exact(snaps, trainer, statuses)


class MeasureHangingPool(HangingPool):
    """A LocalPool whose first device's worker never answers its first call (the executor
    asks each worker what its device holds, then measures its speed)."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method == "overhead" and host == 0:
            return self.hang(host, method)
        return LocalPool.submit(self, host, method, *args)


@pytest.mark.unit
def test_a_worker_that_never_answers_its_measurement_is_stopped_and_the_models_train_elsewhere(
    tmp_path: Path,
) -> None:
    """A device whose worker does not answer within the task timeout as it is measured is
    not started (``worker_not_started``): the models train exactly on the other device, and
    the worker is stopped (given up), so the pool's end does not wait for its hung call.
    Before, it was left running, and a pool in this process waited for it for good."""
    snaps, trainer, statuses, pool = run_hanging(tmp_path, MeasureHangingPool)
    reports = {job: trainer.report(job, 0) for job in statuses}
    assert set(statuses.values()) == {RunStatus.SUCCEEDED}, {j: r.error for j, r in reports.items()}
    assert set(pool._given_up) == {0}, pool._given_up
    said = [e for r in reports.values() for e in r.events if e.kind == "worker_not_started"]
    assert said and "did not answer within 5 s" in said[0].message, said
    for snap in snaps:
        assert_alone(snap, [m.loss for m in reports[snap.job_id].metrics])
