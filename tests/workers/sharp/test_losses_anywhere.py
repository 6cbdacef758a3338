"""A device lost at any task of a SHARP model's first steps, a part of a copy on its way
then or not, with copies at every step or as the default budget allows, taken by the tasks
or by the hosts, alone or beside another model: each model trains exactly as alone, and its
``device_lost`` events say the steps it ran again."""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.workers.sharp.shard_pool import HostLost, _Local
from tests.workers.sharp.test_sharp_runner import (
    GonePool,
    assert_alone,
    budget_for_shards,
    model,
    placed_first,
    train,
)

pytestmark = pytest.mark.unit

STEPS = 4


class LateCopyLosingPool(GonePool):
    """A pool whose device where the model placed lives is lost as the model's
    ``lose_at``-th task (on any device) is submitted: that call there and every later one
    fail. Until then it holds back its answer to its ``late``-th ``copied`` call since the
    model's first task (a part of a copy on its way, 0: none), which the loss then cuts
    off (the copy made at placement is waited for before any task)."""

    lose_at = 1
    late = 0

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.tasks = 0
        self.copies = 0
        self.held: list[Future[Any]] = []

    def submit(self, host: int, method: str, *args: Any) -> Any:
        target = placed_first(self, host, method)
        if method in ("forward", "backward") and self.gone is None:
            self.tasks += 1
            if self.tasks == self.lose_at and target is not None:
                self.gone = target
                for held in self.held:
                    held.set_exception(HostLost(self.devices[target].id, "preempted"))
        return super().submit(host, method, *args)

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        held = method == "copied" and self.tasks and self.gone is None
        if held and host == placed_first(self, host, method):
            self.copies += 1
            if self.copies == self.late:
                self.held.append(Future())
                return _Local(host, method, self.held[-1])
        return super().submit_after(host, after, method, *args)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.sampled_from([1.0, 0.05]),
    task_copies=st.booleans(),
    # Up to the end of step 3 however it is cut (3-5 shards, 6-10 tasks a step): the last
    # step's checkpoint waits for every part of its copy, which a held part would stall.
    lose_at=st.integers(1, 18),
    late=st.integers(0, 4),
    beside=st.booleans(),
)
def test_a_loss_at_any_task_with_a_copy_on_its_way_or_not_leaves_the_math_unchanged(
    budget: float, task_copies: bool, lose_at: int, late: int, beside: bool
) -> None:
    """``beside``: a second model trains on the same devices (the tasks counted to the loss
    are both models')."""
    pools: list[LateCopyLosingPool] = []

    def losing(devices: Any, budgets: Any) -> LateCopyLosingPool:
        pool = LateCopyLosingPool(devices, budgets)
        pool.lose_at, pool.late = lose_at, late
        pools.append(pool)
        return pool

    with tempfile.TemporaryDirectory() as root:
        snaps = [
            model(Path(root), job_id, seed=seed, steps=steps, copy_budget=budget, keep_copies=True)
            for job_id, seed, steps in [("a", 3, STEPS), ("b", 9, STEPS + 2)][: 1 + beside]
        ]
        trainer = train(snaps, losing, budget_for_shards(snaps[0], 3), task_copies=task_copies)
        assert all(pool.gone is not None for pool in pools), "the device was never lost"
        said = 0
        for snap in snaps:
            report = trainer.report(snap.job_id, 0)
            losses = [e.data for e in report.events if e.kind == "device_lost"]
            said += len(losses)
            for lost in losses:
                assert lost["steps_replayed"] <= lost["most_replayed"], lost
            latest = {m.step: m for m in report.metrics}  # a step run again replaces its record
            assert sorted(latest) == list(range(1, snap.steps + 1)), report.metrics
            replayed = sum(lost["steps_replayed"] for lost in losses)
            recorded = [m.step for m in report.metrics]
            assert len(recorded) - len(latest) == replayed, (snap.job_id, recorded, losses)
            assert_alone(snap, [latest[s].loss for s in range(1, snap.steps + 1)], losses)
        assert said, "no model said it lost a device"
