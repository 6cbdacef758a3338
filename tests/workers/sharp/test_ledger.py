"""A device lost mid-step costs the SHARP executor's models the tasks in flight, not the
step: with copies at every step their tasks copy the step off the devices as they go
(``workers.sharp.ledger``), and the models pick up at their next task, exactly."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from shoal.scheduler.sharp import ModelPlan, Shard
from shoal.workers.sharp.ledger import Ledger
from shoal.workers.sharp.models import ModelRun
from shoal.workers.sharp.shard_pool import HostLost, LocalPool, _Local
from shoal.workers.sharp.shard_types import Drawn, Record
from shoal.workers.snapshot import RunStatus
from tests.workers.sharp.test_sharp_runner import (
    GonePool,
    LaggingCopyPool,
    LosingPool,
    assert_alone,
    budget_for_shards,
    lost_call,
    model,
    train,
)

PLAN = ModelPlan("a", tuple(Shard(i, (2 * i, 2 * i + 2), 1.0, 2.0, 1, 1) for i in range(3)), 2)
"""Three shards of two blocks; a step is tasks F0 F1 F2 B2 B1 B0 (positions 6-11 in step 1)."""


def record(position: int) -> Record:
    """A task's record whose every part names the task (its outputs, RNG)."""
    task = PLAN.task(position)
    replays: Any = {} if task.op.value == "backward" else {0: (f"rng @{position}", None)}
    outputs: Any = [f"out @{position}"]
    return Record(outputs, replays, 0.5, 100.0 + position)


def run(ledger: Ledger, position: int, arrived: float, *, states: bool = True) -> None:
    """The task at ``position`` ended (a record taken in 0.5 s), here at ``arrived``; a
    backward's stepped states, named after it, come apart (``states``: they have come)."""
    ledger.add(PLAN, position, record(position), arrived)
    task = PLAN.task(position)
    if task.op.value == "backward":
        blocks = range(*PLAN.shards[task.shard].blocks)
        call: Any = f"copied @{position}"
        ledger.expect(call, task.shard)
        if states:
            copied = {b: f"state {b} @{position}" for b in blocks}
            assert ledger.arrived(call, copied, 0.5, 100.0 + position, arrived)


@pytest.mark.unit
def test_the_ledger_rebuilds_each_shard_as_the_tasks_done_left_it() -> None:
    start = {b: f"state {b} @start" for b in range(6)}
    ledger = Ledger(1, lambda: ["batch"])  # type: ignore[list-item]
    for position in range(6, 11):  # every task of step 1 but the last (B0)
        run(ledger, position, 100.0 + position)
    # Picking up before B1 (position 10): B2 stepped shard 2; shards 0 and 1 still hold
    # their forwards, whose inputs are the batch and F0's outputs.
    assert ledger.covers(PLAN, 10, (1, start)) and not ledger.covers(PLAN, 10, (0, start))
    assert not ledger.covers(PLAN, 12, (1, start))  # the step's end: a step boundary
    zero, one, two = (ledger.handover(PLAN, 10, s, start) for s in PLAN.shards)
    assert zero.state == {0: "state 0 @start", 1: "state 1 @start"}
    assert zero.inputs == {0: "batch"} and zero.replays == {0: ("rng @6", None)}
    assert one.inputs == {0: "out @6"} and not one.loss
    assert two.state == {4: "state 4 @9", 5: "state 5 @9"} and two.inputs == {}
    assert ledger.carry(PLAN, 10) == ["out @9"]  # B2's gradients
    # Before B2 (position 9) the last shard holds its loss's forward and takes no input.
    assert ledger.handover(PLAN, 9, PLAN.shards[2], start).loss
    assert ledger.carry(PLAN, 9) is None
    assert ledger.copy(PLAN) is None  # B0's states are still to come
    assert not ledger.arrived("copied @99", {}, 0.5, 0.0, 0.0)  # not one it waits for
    run(ledger, 11, 111.25)  # a quarter of a second on its way, states and record each
    assert ledger.copy(PLAN) == {b: f"state {b} @{11 - b // 2}" for b in range(6)}
    assert ledger.seconds == 3 * 1.0 + 3 * 0.5 + 2 * 0.25 and not ledger.waiting
    with pytest.raises(ValueError, match="not 1"):
        ledger.add(PLAN, 12, record(12), 112.0)


@pytest.mark.unit
def test_a_ledger_whose_stepped_states_are_still_on_their_way_cannot_be_picked_up_from() -> None:
    start = {b: f"state {b} @start" for b in range(6)}
    ledger = Ledger(1, lambda: ["batch"])  # type: ignore[list-item]
    for position in range(6, 10):  # up to B2, whose states have not come
        run(ledger, position, 100.0 + position, states=position != 9)
    assert ledger.covers(PLAN, 9, (1, start))  # before B2: nothing stepped yet
    assert not ledger.covers(PLAN, 10, (1, start))  # B2 stepped shard 2: its states are out
    assert list(ledger.waiting.values()) == [2]
    ledger.arrived("copied @9", {4: "s4", 5: "s5"}, 0.5, 109.0, 109.0)  # type: ignore[arg-type]
    assert ledger.covers(PLAN, 10, (1, start))


class MidStepLosingPool(LosingPool):
    # Mid-step, after a step, whether the models live on one device or two (the cut, 3-5
    # shards, and the placement depend on the devices' measured overhead and speed): the
    # 23rd task there is the 5th, 7th or 3rd of step 3, 3 or 2 (6, 8 or 10 tasks a step)
    # alone, and of the models' step 2 together.
    lose_at = 23
    counted = frozenset({"forward", "backward"})


class CountingMidStepPool(MidStepLosingPool):
    """A MidStepLosingPool that counts each model's tasks (forward and backward calls)
    submitted to it, on any device, those cut off by the loss too."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.tasks: Counter[str] = Counter()

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method in ("forward", "backward"):
            self.tasks[args[0][0]] += 1
        return super().submit(host, method, *args)


@pytest.mark.unit
@pytest.mark.parametrize("recompute", [True, False])
def test_a_device_lost_mid_step_costs_only_the_tasks_in_flight_and_the_math_stays_exact(
    tmp_path: Path, recompute: bool
) -> None:
    """The first model's device is lost mid-step: each model with shards there picks up at
    its next task on the device left (no step replayed, no step recorded twice), its shards
    rebuilt from the copies its tasks made (their forwards' inputs and RNG; run again where
    they keep graphs), and trains exactly as alone (a model the loss finds at a step's
    boundary, with that step copied, goes on from the copy). The loss costs the tasks in
    flight and nothing else: fewer than a step's, at least the one it cut off, and each
    model's tasks run, as the pool counts them, are its steps' and those it reported redone."""
    snaps = [
        model(tmp_path, "a", steps=6, keep_copies=True, copy_budget=1.0, recompute=recompute),
        model(tmp_path, "b", seed=9, steps=6, keep_copies=True, copy_budget=1.0),
    ]
    pools: list[CountingMidStepPool] = []

    def counting(devices: Any, budgets: Any) -> CountingMidStepPool:
        pools.append(CountingMidStepPool(devices, budgets))
        return pools[-1]

    trainer = train(snaps, counting, budget_for_shards(snaps[0], 3), task_copies=True)
    (dead,) = trainer.lost_devices()
    ran = sum((pool.tasks for pool in pools), Counter[str]())
    picked = []
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        assert report.status is RunStatus.SUCCEEDED, report.error
        (placed,) = [e for e in report.events if e.kind == "placement"]
        per_step = 2 * len(placed.data["stages"])  # each shard's forward and backward
        losses = [e for e in report.events if e.kind == "device_lost"]
        for lost in losses:
            assert lost.data["devices"] == [dead] and lost.data["steps_replayed"] == 0, lost
            assert lost.data["resume_step"] == lost.data["step"], lost
            if "tasks_redone" not in lost.data:  # the loss found it at a step's boundary
                assert "from the copy in host memory" in lost.message, lost
                continue
            assert "picking up at" in lost.message, lost
            assert 0 <= lost.data["tasks_redone"] < per_step, (per_step, lost)
            picked.append(lost)
        redone = sum(e.data.get("tasks_redone", 0) for e in losses)
        expected = snap.steps * per_step + redone
        assert ran[snap.job_id] == expected, (snap.job_id, dict(ran), per_step, losses)
        assert [m.step for m in report.metrics] == list(range(1, 7))  # none replayed
        assert_alone(snap, [m.loss for m in report.metrics])
    assert picked, "the device was never lost mid-step"
    assert any(0 < e.step < 6 for e in picked), [e.data for e in picked]
    assert sum(e.data["tasks_redone"] for e in picked) > 0, [e.data for e in picked]


class CutCopyPool(LocalPool):
    """A LocalPool whose device handing over shard 0's ``cut_at``-th copy (the last part
    of a step's copy: its last backward's) is lost with it on its way, once the step has
    ended and the next begun (its first forward is submitted): every later call there
    fails too."""

    cut_at = 3  # step 2's: the first is of the placement's copy

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.handed = 0
        self.cut: tuple[int, Future[Any]] | None = None
        self.gone: int | None = None

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        if method == "copied" and args[0][1] == 0 and self.gone is None:
            self.handed += 1
            if self.handed == self.cut_at:
                self.cut = (host, Future())
                return _Local(host, method, self.cut[1])
        if host == self.gone:
            return lost_call(self, host, method)
        return super().submit_after(host, after, method, *args)

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if self.cut is not None and self.gone is None and method == "forward":
            self.gone, cut = self.cut
            cut.set_exception(HostLost(self.devices[self.gone].id, "its node was preempted"))
        if host == self.gone:
            return lost_call(self, host, method)
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_a_device_lost_with_a_steps_last_copy_on_its_way_costs_that_steps_tail_not_the_step(
    tmp_path: Path,
) -> None:
    """Step 2 has ended and been recorded, but the copy of its last backward's shard is
    still on its way when its device is lost (step 3 has begun): the model picks up at
    that backward of step 2 from the copy of step 1 and what step 2's tasks copied off,
    replaying no step and recording step 2 once, and trains exactly as alone."""
    snap = model(tmp_path, "a", steps=6, keep_copies=True, copy_budget=1.0)
    trainer = train([snap], CutCopyPool, budget_for_shards(snap, 3), task_copies=True)
    report = trainer.report("a", 0)
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert lost.data["step"] == 2 and lost.data["resume_step"] == 1, lost
    assert lost.data["steps_replayed"] == 0 and lost.data["tasks_redone"] >= 1, lost
    assert "picking up at backward 0 of step 2" in lost.message, lost.message
    assert [m.step for m in report.metrics] == list(range(1, 7))  # step 3 recorded once
    assert_alone(snap, [m.loss for m in report.metrics])


@pytest.mark.unit
def test_a_loss_while_the_first_copy_comes_in_picks_up_in_its_step_and_replays_the_next(
    tmp_path: Path,
) -> None:
    """With the default budget the first copy's cost is a guess until it is in: step 1's
    tasks copy it off, but a part of it is still on its way (held back) through step 2,
    which takes no copy, until its device is lost as step 3 begins. The model picks up in
    step 1 at the backward whose shard's part was lost (the losses of the last shard's
    backward compare with step 1's targets, not step 3's), runs step 2 again and says so,
    within the bound it gives, and trains exactly as alone."""
    snap = model(tmp_path, "a", steps=4, keep_copies=True)
    trainer = train([snap], LaggingCopyPool, budget_for_shards(snap, 3), task_copies=True)
    report = trainer.report("a", 0)
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert lost.data["step"] == 2 and lost.data["resume_step"] == 0, lost
    assert lost.data["steps_replayed"] == 1 <= lost.data["most_replayed"], lost
    assert "of step 1 from the copies its tasks made" in lost.message, lost.message
    assert [m.step for m in report.metrics] == [1, 2, 2, 3, 4]  # step 1 recorded once
    latest = {m.step: m.loss for m in report.metrics}
    assert_alone(snap, [latest[s] for s in range(1, 5)], lost)


class FirstShardLosingPool(GonePool):
    """A pool whose device running model a's first shard is lost as the backward of its
    second shard in step 2 (the third) is submitted, and every later call there fails: the
    first shard then holds its forward's micro-batches, whose inputs its host drew itself
    (``Drawn``) and lost with it."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.first: int | None = None

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if method in ("forward", "backward") and self.gone is None:
            key, inputs = args[0], args[1]
            if key == ("a", 0) and isinstance(inputs, Drawn) and inputs.step == 2:
                self.first = host
            elif method == "backward" and key == ("a", 1) and self.first is not None:
                self.gone = self.first
        return super().submit(host, method, *args)


@pytest.mark.unit
def test_a_first_shard_lost_mid_step_is_given_the_batch_its_host_drew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device of a model's first shard is lost between that shard's forward and its
    backward: the shard is rebuilt on the device left with the step's inputs, which only
    its host had drawn; the executor draws them (``ModelRun.batch``) for that step, and
    the model trains exactly as alone, picking up mid-step."""
    drawn: list[int] = []
    batch = ModelRun.batch

    def counted(run: ModelRun, step: int) -> Any:
        drawn.append(step)
        return batch(run, step)

    monkeypatch.setattr(ModelRun, "batch", counted)
    snap = model(tmp_path, "a", steps=4, keep_copies=True, copy_budget=1.0)
    trainer = train([snap], FirstShardLosingPool, budget_for_shards(snap, 3), task_copies=True)
    report = trainer.report("a", 0)
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert "picking up at" in lost.message and lost.data["steps_replayed"] == 0, lost
    assert drawn == [2], (drawn, lost)  # the lost step's inputs, drawn once, by the executor
    assert [m.step for m in report.metrics] == list(range(1, 5))
    assert_alone(snap, [m.loss for m in report.metrics])
