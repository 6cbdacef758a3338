"""A model the SHARP executor cannot make (cut into shards for its devices, its data made,
its checkpoint read) fails alone, saying why; the models beside it train on."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool, PoolFactory
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.snapshot import DataRef, JobSnapshot, ModelRef, RunnerReport, RunStatus
from tests.workers.sharp.test_sharp_runner import (
    LosingPool,
    assert_alone,
    budget_for_shards,
    devices,
    failed_call,
    model,
)

WIDE = ModelRef("mlp", None, {"in_features": 16, "hidden": 1024, "layers": 2, "out_features": 4})
"""A block of a million parameters: more than half of a device sized for the small MLP."""


def fails_alone(odd: JobSnapshot, make_pool: PoolFactory) -> RunnerReport:
    """``odd`` trained with two models beside it: it fails, saying why, and they train as
    alone. Its report."""
    root = Path(odd.checkpoint_root)
    snaps = [model(root, "a"), odd, model(root, "c", seed=5, steps=3)]
    pool = devices()
    budget = budget_for_shards(snaps[0], 3)
    trainer = SharpTrainer(snaps, pool, make_pool, budgets={d.id: budget for d in pool})
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    failed, succeeded = RunStatus.FAILED, RunStatus.SUCCEEDED
    assert statuses == {"a": succeeded, odd.job_id: failed, "c": succeeded}, errors
    for snap in (snaps[0], snaps[2]):
        assert_alone(snap, [m.loss for m in trainer.report(snap.job_id, 0).metrics])
    report = trainer.report(odd.job_id, 0)
    assert report.error is not None, report
    return report


@pytest.mark.unit
def test_a_model_too_wide_for_these_devices_fails_alone_and_the_others_train_exactly(
    tmp_path: Path,
) -> None:
    """A sweep's trial whose widest block needs more than half of a device's budget cannot
    be cut into shards here: it fails, naming the block and the budget, and the models
    that arrived with it train as alone (before, the executor failed with every model)."""
    refused = fails_alone(model(tmp_path, "wide", model=WIDE), LocalPool)
    assert refused.error is not None and refused.metrics == ()
    assert refused.error.startswith("the SHARP executor cannot train this model: ShardError:")
    assert "block 0 needs" in refused.error and "devices with more memory" in refused.error


@pytest.mark.unit
def test_a_model_whose_data_cannot_be_made_fails_alone_and_the_others_train_exactly(
    tmp_path: Path,
) -> None:
    """A model arriving with two others whose data cannot be made (a dataset its workers do
    not know) fails, naming the dataset, having trained nothing; the models that arrived
    with it train exactly as alone."""
    nodata = replace(model(tmp_path, "nodata", seed=7), data=DataRef("no-such-data", None, {}))
    refused = fails_alone(nodata, LocalPool)
    assert refused.metrics == (), refused
    assert refused.error is not None, refused
    assert refused.error.startswith("the SHARP executor cannot train this model:"), refused
    assert "unknown dataset 'no-such-data'" in refused.error, refused


@pytest.mark.unit
def test_a_model_ended_here_and_added_again_that_cannot_be_made_reports_its_new_failure(
    tmp_path: Path,
) -> None:
    """A sweep's executor (open for more models): a model that ended here SUCCEEDED comes
    again, now unable to be made (its data: a dataset its workers do not know); it reports
    that failure, not its earlier run, and the model added after it trains exactly as
    alone."""
    first = model(tmp_path, "a", steps=2)
    pool = devices()
    budgets = {d.id: budget_for_shards(first, 3) for d in pool}
    trainer = SharpTrainer([first], pool, LocalPool, budgets=budgets, keep_open=True)
    thread = threading.Thread(target=trainer.run)
    thread.start()
    try:
        assert ended(trainer, "a").status is RunStatus.SUCCEEDED
        trainer.add(replace(first, attempt=2, data=DataRef("no-such-data", None, {})))
        beside = model(tmp_path, "b", seed=9, steps=2)
        trainer.add(beside)
        assert ended(trainer, "b").status is RunStatus.SUCCEEDED
    finally:
        trainer.close()
        thread.join(60)
    assert not thread.is_alive()
    assert_alone(beside, [m.loss for m in trainer.report("b", 0).metrics])
    again = trainer.report("a", 0)
    assert again.status is RunStatus.FAILED and again.metrics == (), again
    assert again.error is not None and "unknown dataset 'no-such-data'" in again.error


def ended(trainer: SharpTrainer, job_id: str, within_s: float = 60.0) -> RunnerReport:
    """``job_id``'s report once it has ended (its last report in the failure, if not)."""
    deadline = time.monotonic() + within_s
    report = trainer.report(job_id, 0)
    while report.status is RunStatus.RUNNING and time.monotonic() < deadline:
        time.sleep(0.02)
        report = trainer.report(job_id, 0)
    assert report.status is not RunStatus.RUNNING, f"{job_id} still running: {report}"
    return report


class BadShardPool(LocalPool):
    """A LocalPool whose workers cannot build model ``bad``'s shards: its ``add`` fails on
    the worker (as a factory of uploaded code raising for the trial's config would)."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method == "add" and args[0][0] == "bad":
            return super().submit(host, "no-such-method", *args)
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_a_model_whose_shards_cannot_be_built_fails_alone_and_the_others_train_exactly(
    tmp_path: Path,
) -> None:
    """A model arriving with others whose shards its workers cannot build fails with the
    worker's error, its other shards dropped, and the models beside it train as alone."""
    bad = fails_alone(model(tmp_path, "bad", seed=7), BadShardPool)
    assert bad.metrics == () and "no such method 'no-such-method'" in (bad.error or ""), bad


class CopyFailingPool(LocalPool):
    """A LocalPool whose hosts cannot copy model bad's shards: its ``copy`` fails on the
    worker."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method == "copy" and args[0][0] == "bad":
            error = ShardFailed(self.devices[host].id, method, "out of host memory")
            return failed_call(host, method, error)
        return super().submit(host, method, *args)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"keep_copies": True}, "its first copy could not be taken"),
        ({"checkpoint_every": 2}, "its checkpoint of step 2 could not be taken"),
    ],
)
def test_a_model_whose_state_cannot_be_copied_fails_alone(
    tmp_path: Path, fields: dict[str, Any], why: str
) -> None:
    """Model bad's hosts cannot copy its shards: its first copy (taken as it arrives, with
    keep_copies) or the checkpoint gathered at step 2 cannot be taken; it fails alone,
    saying so, and the models beside it train as alone."""
    bad = fails_alone(model(tmp_path, "bad", seed=7, **fields), CopyFailingPool)
    assert why in (bad.error or "") and "out of host memory" in (bad.error or ""), bad


class MoveFailingPool(LocalPool):
    """``moves_to_the_idle_device``'s setting (a and c on device 0, b cancelled on device
    1), device 1 unable to build a's and c's shards: the one that moves there fails."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host == 1 and method == "add" and args[0][0] in "ac":
            error = ShardFailed(self.devices[host].id, method, "out of memory")
            return failed_call(host, method, error)
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_a_model_that_cannot_move_at_a_step_boundary_fails_alone(tmp_path: Path) -> None:
    """Without trades, one of a and c moves to the device b left idle at its first step
    boundary; that device cannot build its shards: it fails, saying so, and the other
    trains on exactly (before, the executor failed with both)."""
    snaps = [model(tmp_path, name, seed=i, steps=4) for i, name in enumerate("abc")]
    pool = devices()
    budgets = {d.id: budget_for_shards(snaps[0], 3) for d in pool}
    trainer = SharpTrainer(snaps, pool, MoveFailingPool, budgets=budgets, trades=False)
    trainer.cancel("b")
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    moved = [name for name in "ac" if statuses[name] is RunStatus.FAILED]
    assert len(moved) == 1 and statuses["b"] is RunStatus.CANCELLED, errors
    (stayed,) = [snap for snap in snaps if snap.job_id in "ac" and snap.job_id not in moved]
    assert statuses[stayed.job_id] is RunStatus.SUCCEEDED, errors
    assert "could not move at step 1" in (errors[moved[0]] or ""), errors
    assert_alone(stayed, [m.loss for m in trainer.report(stayed.job_id, 0).metrics])


class RebuildFailingPool(LosingPool):
    """A LosingPool (the device where the first model placed lives is lost at its 12th
    call) whose workers cannot build that model's shards again after the loss: each of its
    loads from then on fails on the worker."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method in ("add", "take") and args[0][0] == "bad" and self.calls >= self.lose_at:
            error = ShardFailed(self.devices[host].id, method, "out of memory")
            return failed_call(host, method, error)
        return super().submit(host, method, *args)


@pytest.mark.unit
@pytest.mark.parametrize("task_copies", [True, False])
def test_a_model_that_cannot_be_re_formed_after_a_loss_fails_alone(
    tmp_path: Path, task_copies: bool
) -> None:
    """A device is lost with model bad's shards; the worker left cannot build them again
    (picking up where its tasks left them, with task copies; else back at its copy): bad
    fails, saying both, and the model on the other device trains on exactly (before, the
    executor failed with it)."""
    snaps = [
        model(tmp_path, "bad", seed=7, steps=6, keep_copies=True),
        model(tmp_path, "a", steps=4, keep_copies=True),
    ]
    pool = devices()
    budgets = {d.id: budget_for_shards(snaps[0], 3) for d in pool}
    trainer = SharpTrainer(
        snaps, pool, RebuildFailingPool, budgets=budgets, trades=False, task_copies=task_copies
    )
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    assert statuses == {"bad": RunStatus.FAILED, "a": RunStatus.SUCCEEDED}, errors
    assert "was lost" in (errors["bad"] or "") and "could not be re-formed" in (errors["bad"] or "")
    assert "out of memory" in (errors["bad"] or ""), errors
    assert_alone(snaps[1], [m.loss for m in trainer.report("a", 0).metrics])
