"""A copy a host could not make (the call that was to start it failed, or never ran) is
dropped: the model trains on, exactly, and says which copy a loss now rolls back to."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.ledger import Ledger
from shoal.workers.sharp.models import Copying
from shoal.workers.sharp.placing import arrive
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool, _Local
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.snapshot import RunStatus
from tests.workers.sharp.test_sharp_runner import (
    StepThreeLosingPool,
    assert_alone,
    back_to_placement,
    budget_for_shards,
    devices,
    failed_call,
    model,
    placed_first,
    train,
)


class CopyFailingPool(LocalPool):
    """A LocalPool whose ``copied`` call for the second part of step 2's copy fails as a
    host's does when the call that was to start the copy failed: the host hands it over
    all the same (its state stays as the executor's next calls expect), the executor is
    told it failed."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.shards = 0
        self.copied = 0
        self.failed: str | None = None

    @property
    def fail_at(self) -> int:
        """Of a model in n shards (the cut depends on the devices' measured overhead): its
        copy as placed is calls 1..n, its tasks copy step 1 off in n+1..2n; 2n+2 is step
        2's second part."""
        return 2 * self.shards + 2

    def submit(self, host: int, method: str, *args: Any) -> Any:
        self.shards += method == "add"
        return super().submit(host, method, *args)

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        call = super().submit_after(host, after, method, *args)
        self.copied += method == "copied"
        if method != "copied" or self.copied != self.fail_at:
            return call
        self.failed = self.devices[host].id
        error = ShardFailed(self.failed, "backward", "RuntimeError: it did not run")
        failed: Future[Any] = Future()
        call.future.add_done_callback(lambda _: failed.set_exception(error))
        return _Local(host, method, failed)


@pytest.mark.unit
def test_a_copy_not_made_is_dropped_and_the_model_trains_on_exactly(tmp_path: Path) -> None:
    pools: list[CopyFailingPool] = []

    def failing(devs: Any, budgets: Any) -> CopyFailingPool:
        pools.append(CopyFailingPool(devs, budgets))
        return pools[-1]

    snap = model(tmp_path, "a", steps=4, keep_copies=True, copy_budget=1.0)
    trainer = train([snap], failing, budget_for_shards(snap, 3))
    report = trainer.report("a", 0)
    assert report.status is RunStatus.SUCCEEDED, report.error
    (pool,) = pools
    assert pool.copied > pool.fail_at  # copies went on after the dropped one
    dropped = [e for e in report.events if e.kind == "copy_dropped"]
    (event,) = dropped
    # Step 1's copy, complete, may still be on its way as step 2's part fails: it stands.
    assert event.step == 1 and event.data["device_id"] == pool.failed, event
    assert event.data["kept_step"] in (0, 1), event
    assert f"rolls it back to its copy after step {event.data['kept_step']}" in event.message
    (model_run,) = trainer._models.values()
    assert model_run.saved is not None and model_run.saved[0] >= 3, model_run.saved
    assert_alone(snap, [m.loss for m in report.metrics])


@pytest.mark.unit
@pytest.mark.parametrize("task_copied", [True, False])
def test_only_the_copy_not_made_is_dropped(tmp_path: Path, task_copied: bool) -> None:
    """A step's task copy failing leaves the previous step's copy on its way, and the other
    way round: each is dropped alone."""
    snap = model(tmp_path, "a", steps=4, keep_copies=True)
    run = arrive(snap, budget_for_shards(snap, 3), 0, Homes(devices()), task_copies=True)
    run.saved = (1, {})
    run.ledger, run.copying = Ledger(2, list), Copying(2, set())
    run.drop_copy("dev", "the copy did not start", task_copied=task_copied)
    assert (run.ledger is None, run.copying is None) == (task_copied, not task_copied)
    (event,) = [e for e in run.run.report(0).events if e.kind == "copy_dropped"]
    assert event.data == {"device_id": "dev", "kept_step": 1}


class LastCopyFailingPool(LocalPool):
    """A LocalPool whose hosts fail to hand over the copy of the first model's last step
    (its last checkpoint), as they do where the call to start the copy failed."""

    last_step = 4

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.last: set[tuple[Any, int]] = set()

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method == "copy" and args[0][0] == "a" and args[1] == self.last_step:
            self.last.add((args[0], args[2]))
        return super().submit(host, method, *args)

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        if method != "copied" or (args[0], args[1]) not in self.last:
            return super().submit_after(host, after, method, *args)
        error = ShardFailed(self.devices[host].id, "copy", "RuntimeError: it did not run")
        return failed_call(host, method, error)


@pytest.mark.unit
def test_a_last_checkpoint_not_made_fails_its_model_only(tmp_path: Path) -> None:
    """The last step's checkpoint is taken as a copy is, beside the other models' tasks: a
    part of it not made fails its model, as a checkpoint not written does."""
    # No copies kept: its last checkpoint is its only copy (none of its tasks take one).
    broken = model(tmp_path, "a", steps=LastCopyFailingPool.last_step, keep_copies=False)
    fine = model(tmp_path, "b", seed=9, steps=6)
    pool = devices()
    budget = budget_for_shards(fine, 3)
    trainer = SharpTrainer(
        [broken, fine],
        pool,
        LastCopyFailingPool,
        budgets=dict.fromkeys([d.id for d in pool], budget),
    )
    assert trainer.run() == {"a": RunStatus.FAILED, "b": RunStatus.SUCCEEDED}
    failed = trainer.report("a", 0)
    assert "its checkpoint of step 4 could not be taken" in (failed.error or ""), failed.error
    assert [m.step for m in failed.metrics] == [1, 2, 3, 4]
    assert not [e for e in failed.events if e.kind == "checkpoint"]
    assert_alone(fine, [m.loss for m in trainer.report("b", 0).metrics])


class DroppingCopyPool(StepThreeLosingPool):
    """A StepThreeLosingPool whose device fails to make its parts of the copies after steps
    1 and 2 (both dropped) before it is lost."""

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        if host == placed_first(self, host, method) and method == "copied" and args[1] in (2, 3):
            error = ShardFailed(self.devices[host].id, "copy", "RuntimeError: it did not run")
            return failed_call(host, method, error)
        return super().submit_after(host, after, method, *args)


@pytest.mark.unit
def test_a_loss_after_dropped_copies_replays_the_steps_since_the_copy_kept_as_its_event_says(
    tmp_path: Path,
) -> None:
    """The copies after steps 1 and 2 were not made (copies every step): a device lost in
    step 3 rolls the model back to the copy made at placement, and its event's bound says
    so."""
    report = back_to_placement(tmp_path, DroppingCopyPool)
    dropped = [e.data["kept_step"] for e in report.events if e.kind == "copy_dropped"]
    assert dropped == [0, 0], report.events


@pytest.mark.unit
def test_no_step_takes_a_copy_while_the_first_is_coming_and_its_interval_a_guess(
    tmp_path: Path,
) -> None:
    """The interval is 1 until a copy was measured: while step 1's copy is still coming
    in, step 2's tasks take none (at most the interval the measure gives); once it is in,
    or with a budget that copies every step anyway, they do."""
    snap = model(tmp_path, "a", steps=4, keep_copies=True)
    run = arrive(snap, budget_for_shards(snap, 3), 0, Homes(devices()), task_copies=True)
    run.copying = Copying(1, set())
    run._begin_step(2, 0.0)
    assert run.ledger is None
    run.copying = None
    run._begin_step(2, 0.0)
    assert run.ledger is not None
    every = arrive(
        replace(snap, copy_budget=1.0), budget_for_shards(snap, 3), 0, Homes(devices()),
        task_copies=True,
    )  # fmt: skip
    every.copying = Copying(1, set())
    every._begin_step(2, 0.0)
    assert every.ledger is not None
