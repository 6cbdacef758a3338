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

from shoal.workers.sharp.shard_pool import LocalPool
from shoal.workers.snapshot import RunStatus
from tests.workers.sharp.test_sharp_runner import (
    assert_alone,
    budget_for_shards,
    model,
    placed_first,
    train,
)

TIMEOUT_S = 5.0


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
                return self._local(host, method, self._threads[host].submit(self._hang))
        return super().submit(host, method, *args)

    def _hang(self) -> None:
        self.hung.set()
        self.release.wait()


@pytest.mark.unit
def test_a_device_hung_in_a_call_is_given_up_and_its_models_train_on_exactly(
    tmp_path: Path,
) -> None:
    snaps = [
        model(tmp_path, "a", steps=5, keep_copies=True, copy_budget=1.0),
        model(tmp_path, "b", seed=9, steps=5, keep_copies=True, copy_budget=1.0),
    ]
    pools: list[HangingPool] = []

    def make_pool(devices: Any, budgets: Any) -> HangingPool:
        pools.append(HangingPool(devices, budgets))
        return pools[-1]

    try:
        trainer = train(snaps, make_pool, budget_for_shards(snaps[0], 3), task_timeout_s=TIMEOUT_S)
    finally:
        for pool in pools:
            pool.release.set()
    (pool,) = pools
    assert pool.hung.is_set(), f"no task hung: {pool.tasks} tasks on the device"
    (dead,) = trainer.lost_devices()
    events = {s.job_id: trainer.report(s.job_id, 0).events for s in snaps}
    lost = [e for evs in events.values() for e in evs if e.kind == "device_lost"]
    assert lost, {job: [e.kind for e in evs] for job, evs in events.items()}
    for event in lost:
        assert event.data["devices"] == [dead], event
        assert "none of its calls ended for 5 s" in event.message, event.message
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        assert report.status is RunStatus.SUCCEEDED, report.error
        latest = {m.step: m.loss for m in report.metrics}  # a replayed step's record replaces it
        assert sorted(latest) == list(range(1, 6))
        assert_alone(snap, [latest[s] for s in range(1, 6)])
