"""A SHARP executor kept waiting by a device's call says so on the model's events, names the
call and its device, and trains on exactly once the call ends: in its dispatch loop, and in
a recovery's wait."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from shoal.workers.sharp import stalls
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool
from shoal.workers.snapshot import RunnerEvent, RunStatus
from tests.workers.sharp.test_sharp_runner import (
    LosingPool,
    assert_alone,
    budget_for_shards,
    devices,
    model,
)


class HeldPool(LocalPool):
    """A LocalPool whose first ``backward`` on device 0 (where the model lives) waits until
    ``release`` is set."""

    release = threading.Event()

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.held = False

    def _call(self, host: int, method: str, *args: Any) -> Any:
        if host == 0 and method == "backward" and not self.held:
            self.held = True
            assert self.release.wait(timeout=60), "the test never released the call"
        return super()._call(host, method, *args)


class RehomeHeldPool(LosingPool):
    """A LosingPool whose first shard loaded (``add``) on the device left after the loss, as
    the model rolls back there, waits until ``release`` is set."""

    release = threading.Event()
    lose_at = 10  # the second forward of step 1, after 4 adds and the shards' first 4
    # copies: the shards roll back to those copies, loaded on the device left

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.held = False

    def _call(self, host: int, method: str, *args: Any) -> Any:
        after_the_loss = self.calls >= self.lose_at and host != getattr(self, "target", host)
        if method == "add" and after_the_loss and not self.held:
            self.held = True
            assert self.release.wait(timeout=60), "the test never released the call"
        return super()._call(host, method, *args)


def stalled_while_held(trainer: SharpTrainer, job_id: str, release: threading.Event) -> RunnerEvent:
    """Train on a thread until ``job_id`` says it is stalled, then release the held call and
    let the training end; the first ``stalled`` event."""
    statuses: dict[str, RunStatus] = {}
    training = threading.Thread(target=lambda: statuses.update(trainer.run()))
    training.start()

    def stalled() -> list[RunnerEvent]:
        return [e for e in trainer.report(job_id, 0).events if e.kind == "stalled"]

    try:
        for _ in range(300):
            if stalled() or not training.is_alive():
                break
            training.join(timeout=0.1)
        said = stalled()
        events = [(e.kind, e.message) for e in trainer.report(job_id, 0).events]
        assert said, f"no stalled event while a call was held; events: {events}"
    finally:
        release.set()
        training.join(timeout=60)
    assert statuses == {job_id: RunStatus.SUCCEEDED}, trainer.report(job_id, 0).error
    return said[0]


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_a_call_that_keeps_the_executor_waiting_is_named_in_a_stalled_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stalls, "STALL_S", 0.2)
    monkeypatch.setattr(HeldPool, "release", threading.Event())
    snap = model(tmp_path, "a", steps=2)
    pool = devices()
    budgets = {d.id: budget_for_shards(snap, 2) for d in pool}
    trainer = SharpTrainer([snap], pool, HeldPool, budgets=budgets, trades=False)
    first = stalled_while_held(trainer, "a", HeldPool.release)
    assert {"method": "backward", "device_id": pool[0].id} in first.data["calls"], first.data
    assert f"backward on {pool[0].id}" in first.message and first.data["waited_s"] >= 0.2
    assert_alone(snap, [m.loss for m in trainer.report("a", 0).metrics])


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_a_recovery_kept_waiting_names_the_call_in_a_stalled_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device is lost; as the model's shards are loaded on the one left, one load waits:
    the model says so, and trains on exactly once it ends."""
    monkeypatch.setattr(stalls, "STALL_S", 0.2)
    monkeypatch.setattr(RehomeHeldPool, "release", threading.Event())
    snap = model(tmp_path, "a", steps=4, keep_copies=True, copy_budget=1.0)
    pool = devices()
    budgets = {d.id: budget_for_shards(snap, 3) for d in pool}
    trainer = SharpTrainer([snap], pool, RehomeHeldPool, budgets=budgets, trades=False)
    first = stalled_while_held(trainer, "a", RehomeHeldPool.release)
    (dead,) = trainer.lost_devices()
    (left,) = [d.id for d in pool if d.id != dead]
    assert first.data["calls"] == [{"method": "add", "device_id": left}], first.data
    report = trainer.report("a", 0)
    kinds = [e.kind for e in report.events]
    assert kinds.index("stalled") < kinds.index("device_lost"), kinds  # said as it recovered
    latest = {m.step: m.loss for m in report.metrics}  # a replayed step's record replaces it
    assert sorted(latest) == list(range(1, 5))
    assert_alone(snap, [latest[s] for s in range(1, 5)])
