"""Models trading places in the SHARP executor (``trades``): a model on a slow device takes
a faster one that falls empty, or trades places with a model there that has less work to
go, between any two of its tasks, and every model still trains exactly as alone."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from shoal.scheduler.devices import Device
from shoal.workers.sharp import trading
from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.placing import arrive
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import Call, LocalPool, PoolFactory, RayPool
from shoal.workers.sharp.trading import Trading
from shoal.workers.snapshot import JobSnapshot, RunStatus
from tests.workers.sharp.test_sharp_runner import (
    assert_alone,
    budget_for_shards,
    devices,
    lost_call,
    model,
)


class Trained(NamedTuple):
    pool: list[Device]
    placed: dict[str, set[str]]
    """Where each model was placed."""
    moves: dict[str, list[str]]
    """Each model's moves, as its events say them."""
    lost: dict[str, list[list[str]]]
    """The devices each model lost, loss by loss."""


def trained(snaps: list[JobSnapshot], make_pool: PoolFactory, node: str) -> Trained:
    """``snaps`` trained, trading places, on a device and one three times slower (by
    measured speeds: the slowness is acted out, never read), each exactly as alone."""
    fast, slow = devices(node)
    pool = [fast, replace(slow, emulate_slowdown=3.0)]
    budgets = {d.id: budget_for_shards(snaps[0], 3) for d in pool}
    trainer = SharpTrainer(snaps, pool, make_pool, budgets=budgets, trades=True)
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    assert statuses == {s.job_id: RunStatus.SUCCEEDED for s in snaps}, errors
    placed, moves, lost = {}, {}, {}
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        (placement,) = [e for e in report.events if e.kind == "placement"]
        placed[snap.job_id] = {row["device_id"] for row in placement.data["stages"]}
        moves[snap.job_id] = [e.message for e in report.events if e.kind == "relayout"]
        losses = [e.data for e in report.events if e.kind == "device_lost"]
        lost[snap.job_id] = [data["devices"] for data in losses]
        assert all(data["steps_replayed"] <= data["most_replayed"] for data in losses), losses
        # A replayed step is recorded again, and its record replaces the one before.
        replayed = sum(data["steps_replayed"] for data in losses)
        assert len(report.metrics) == snap.steps + replayed, (report.metrics, losses)
        latest = {m.step: m.loss for m in report.metrics}
        assert sorted(latest) == list(range(1, snap.steps + 1)), (report.metrics, losses)
        assert_alone(snap, [latest[s] for s in sorted(latest)])
    return Trained(pool, placed, moves, lost)


@pytest.mark.unit
def test_a_model_with_more_to_go_trades_places_with_one_on_a_faster_device(
    tmp_path: Path,
) -> None:
    """Placed heaviest first, an empty device first: b on the fast device, c on the slow
    one, and a, short, beside b (the fast device shared still gives it more). c has far
    more to go than a: they trade places before their first tasks."""
    snaps = [
        model(tmp_path, "a", steps=2),
        model(tmp_path, "b", seed=9, steps=8),
        model(tmp_path, "c", seed=5, steps=8),
    ]
    pool, placed, moves, _ = trained(snaps, LocalPool, "n0000000a")
    assert placed == {"a": {pool[0].id}, "b": {pool[0].id}, "c": {pool[1].id}}
    before = "before forward 0 of step 0"
    assert moves["a"] == [f"SHARP: moved from {pool[0].id} to {pool[1].id} {before}:"
                          " traded places with c"]  # fmt: skip
    assert moves["c"] == [f"SHARP: moved from {pool[1].id} to {pool[0].id} {before}:"
                          " a faster device for it, traded with a"]  # fmt: skip
    assert moves["b"] == []


@pytest.mark.integration
def test_a_model_on_a_slow_ray_shard_worker_takes_a_faster_one_mid_run_exactly(
    ray_address: str, tmp_path: Path
) -> None:
    """b, the heavier, placed on the fast device, runs three times faster than c on the
    slow one (actors run at once: in-process workers take turns); c takes the fast device
    mid-run, from b (a trade) or once b has ended, each shard handed from one ShardWorker
    actor to the other through Ray with its micro-batches' inputs (c's forwards run again
    there: its ``recompute`` is off) and the outputs kept for its next task."""
    import ray

    snaps = [
        model(tmp_path, "b", seed=9, steps=8, recompute=False),
        model(tmp_path, "c", seed=5, steps=6, recompute=False),
    ]
    node = ray.get_runtime_context().get_node_id()
    pool, placed, moves, _ = trained(snaps, RayPool, node)
    assert placed == {"b": {pool[0].id}, "c": {pool[1].id}}
    assert any(f"to {pool[0].id} before" in m and "a faster device" in m for m in moves["c"])


class HandOverLosingPool(LocalPool):
    """A LocalPool whose device 0 is lost as it is asked to hand a shard over: that call
    and every later one there fail (the shards it was to give never reach device 1)."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.gone = False

    def submit(self, host: int, method: str, *args: Any) -> Any:
        self.gone = self.gone or (host == 0 and method == "give")
        if host != 0 or not self.gone:
            return super().submit(host, method, *args)
        return lost_call(self, host, method)


@pytest.mark.unit
def test_a_device_lost_as_models_trade_places_rolls_them_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast device is lost as a and c trade places: a's shards never leave it, c's
    never arrive, b's are lost with it. Each rolls back to its copy on the slow device
    left and trains on exactly as alone; the lost device is named. (The trade is made
    and handed over at the first chance, as the policy would with speeds and costs
    measured as they mostly are: measured under load, they kept c home in 1-3 runs in 25.)"""

    def to_the_fast_device(_left: float, _rate: float, devices: Any) -> Any:
        return next((d for d in devices if d.place == 0), None)

    monkeypatch.setattr(trading, "trade_target", to_the_fast_device)
    monkeypatch.setattr(trading, "trade_pays", lambda *_: True)
    monkeypatch.setattr(trading, "hand_over_now", lambda *_: True)
    snaps = [
        model(tmp_path, "a", steps=2, keep_copies=True),
        model(tmp_path, "b", seed=9, steps=8, keep_copies=True),
        model(tmp_path, "c", seed=5, steps=8, keep_copies=True),
    ]
    pool, placed, moves, lost = trained(snaps, HandOverLosingPool, "n0000000a")
    assert placed == {"a": {pool[0].id}, "b": {pool[0].id}, "c": {pool[1].id}}
    assert [len(moves[m]) for m in "abc"] == [1, 0, 1]  # the trade, cut short
    assert lost == {m: [[pool[0].id]] for m in "abc"}


class Recording:
    """A pool that records the calls submitted to it and runs none."""

    def __init__(self, devices: list[Device]) -> None:
        self.devices = devices
        self.calls: list[Call] = []

    def submit(self, host: int, method: str, *args: Any) -> Call:
        self.calls.append(Call(host, method))
        return self.calls[-1]

    def outputs(self, call: Call) -> Call:
        return call


@pytest.mark.unit
@pytest.mark.parametrize(("cost", "moves"), [(2.2, True), (2.5, False)])
def test_a_model_takes_a_faster_empty_device_only_where_that_pays_for_the_move(
    tmp_path: Path, cost: float, moves: bool
) -> None:
    """c, timed, lives on a device 0.3 times as fast as the empty one: its work to go W
    ends there in W plus the move, at home in W / 0.3 = 3.33 W. Holding its shards there
    costs ``cost`` W (as the devices' calls measured it): it goes at 2.2, stays at 2.5."""
    snap = model(tmp_path, "c", seed=5, steps=6)
    pool = devices("n0000000a")
    homes = Homes(pool, spread=True)
    homes.measured({0: 10.0, 1: 3.0})
    run = arrive(snap, budget_for_shards(snap, 3), 0, homes, task_copies=False)
    homes.move(run, 1)
    run.timed = True
    left, nbytes = run.plan.remaining_s(0), sum(s.bytes for s in run.plan.shards)
    homes.held([(nbytes, cost * left)])
    recording = Recording(pool)
    Trading(homes).consider(recording, {"c": run}, [], 0.0)  # type: ignore[arg-type]
    handed = [(c.host, c.method) for c in recording.calls]
    shards = len(run.plan.shards)
    assert handed == ([(1, "give"), (0, "take")] * shards if moves else []), handed
    assert run.homes == [0 if moves else 1] * shards


@pytest.mark.unit
def test_holding_a_shard_costs_its_device_from_its_sending_or_the_call_before_it(
    tmp_path: Path,
) -> None:
    """``add`` and ``take`` come with the seconds they cost the worker: the wait for their
    inputs where the worker was idle (here a second since the sending), or from the end of
    the worker's call before, if that ended after the sending."""
    from shoal.workers.pipeline.stage_types import StageSetup
    from shoal.workers.sharp.shard_worker import ShardWorker
    from shoal.workers.zoo.data import make_data

    snap = model(tmp_path, "a")
    setup = StageSetup.of(snap, make_data(snap.data, snap.seed).meta)
    worker = ShardWorker(devices()[0], 2**40)
    held, seconds = worker.call("add", ("a", 0), setup, (0, 1), 0, None, False, time.time() - 1)
    assert held > 0 and 1.0 <= seconds < 60.0, seconds
    sent = time.time() - 1
    worker.call("drop", ("a", 0))  # it ends after the sending: the next call counts from it
    _, seconds = worker.call("add", ("a", 0), setup, (0, 1), 0, None, False, sent)
    assert seconds < 1.0, seconds


@pytest.mark.unit
def test_a_run_of_tasks_queued_ends_as_a_whole_counted_from_when_it_was_queued() -> None:
    """A run's tasks end together (one call): a model's queued work ends when the runs up
    to its own do, the first run's counted from when it was queued, whatever its tasks
    did meanwhile."""
    from types import SimpleNamespace

    from shoal.scheduler.sharp import ModelPlan, Shard
    from shoal.workers.sharp.models import Task
    from shoal.workers.sharp.trading import _ends_in

    shards = tuple(Shard(i, (i, i + 1), 1.0, 1.0, 1, 1) for i in range(2))
    a, b = (SimpleNamespace(plan=ModelPlan(m, shards, steps=2), ratio=1.0) for m in "ab")
    queued = [Task(a, 0, p, p, 0) for p in range(3)]  # type: ignore[arg-type]
    queued += [Task(b, 0, p, 3 + p, 3) for p in range(2)]  # type: ignore[arg-type]
    assert _ends_in(a, queued, 1.5) == pytest.approx(1.5)  # type: ignore[arg-type]
    assert _ends_in(b, queued, 1.5) == pytest.approx(3.5)  # type: ignore[arg-type]
