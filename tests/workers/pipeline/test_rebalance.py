"""Runtime repartitioning: blocks move between running stages and the math does not change."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.scheduler.devices import Device
from shoal.scheduler.elastic import (
    Decision,
    ElasticConfig,
    Keep,
    Repartition,
    StageSample,
    current_plan,
)
from shoal.scheduler.profile import uniform_costs
from shoal.scheduler.types import BlockRange
from shoal.workers.pipeline import group as group_module
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.rebalance import Layout, Rebalancer, snapshot_policy
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.worker_group import StageLost
from shoal.workers.snapshot import JobSnapshot, RunStatus, StagePlan, StageTiming, StepMetrics
from tests.factories import SGD, dp_plans, job, plans
from tests.workers.runs import assert_matches_reference, final_states, metrics


class ForcedMoves:
    """A policy that re-cuts at given steps, whatever the measurements: ``moves[k]`` is the
    (stage ranges, micro-batch split) to move to after the k-th step of the run."""

    def __init__(self, moves: dict[int, tuple[Sequence[BlockRange], Sequence[int]]]) -> None:
        self._moves = moves
        self._calls = 0

    def __call__(self, layout: Layout, history: Sequence[Sequence[StageSample]]) -> Decision:
        plan = layout.plan()
        self._calls += 1
        move = self._moves.get(self._calls)
        if move is None:
            return Keep("not asked to move")
        ranges, split = move
        target = current_plan(
            [(s.device_ids, r) for s, r in zip(plan.stages, ranges, strict=True)], split
        )
        return Repartition(target, 1.0, 0.5, (), 0, 0.0, {}, "forced by the test")


@st.composite
def cut_of(draw: st.DrawFn, stages: int, blocks: int = 4) -> list[BlockRange]:
    cuts = sorted(
        draw(st.sets(st.integers(1, blocks - 1), min_size=stages - 1, max_size=stages - 1))
    )
    return list(pairwise([0, *cuts, blocks]))


@st.composite
def split_of(draw: st.DrawFn, micro_batches: int, replicas: int) -> tuple[int, ...]:
    if replicas == 1:
        return (micro_batches,)
    bars = sorted(
        draw(
            st.sets(st.integers(1, micro_batches - 1), min_size=replicas - 1, max_size=replicas - 1)
        )
    )
    return tuple(b - a for a, b in pairwise([0, *bars, micro_batches]))


@st.composite
def elastic_runs(draw: st.DrawFn) -> dict[str, Any]:
    """1-2 replicas of 1-4 stages, re-cut (and re-split) after random steps."""
    replicas = draw(st.integers(1, 2))
    stages = draw(st.integers(1, 4 if replicas == 1 else 2))
    micro_batches = draw(st.sampled_from([2, 4]))
    steps = draw(st.integers(2, 4))
    at = draw(st.sets(st.integers(1, steps - 1), min_size=1))
    moves = {k: (draw(cut_of(stages)), draw(split_of(micro_batches, replicas))) for k in sorted(at)}
    fields = layout_fields(draw, replicas, stages, micro_batches, steps)
    return {
        "snapshot": {**fields, "checkpoint_every": draw(st.sampled_from([0, 1]))},
        "moves": moves,
    }


def layout_fields(
    draw: st.DrawFn, replicas: int, stages: int, micro_batches: int, steps: int
) -> dict[str, Any]:
    """A job's fields for ``replicas`` of ``stages`` stages cut at random, its micro-batches
    split among the replicas at random, a random schedule, recompute and clipping."""
    return {
        "stages": dp_plans(draw(cut_of(stages)), replicas),
        "replicas": replicas,
        "replica_micro_batches": draw(split_of(micro_batches, replicas)),
        "micro_batches": micro_batches,
        "steps": steps,
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "recompute": draw(st.booleans()),
        "optimizer": replace(SGD, clip_grad_norm=draw(st.sampled_from([None, 0.05]))),
    }


def run(snap: JobSnapshot, policy: Any = None) -> Trainer:
    trainer = Trainer(snap, LocalGroup, policy=policy)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    return trainer


@pytest.mark.unit
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elastic_runs())
def test_forced_repartitions_leave_the_math_unchanged(config: dict[str, Any]) -> None:
    """Against the single-process reference to rtol=1e-5, atol=1e-6 (replicas sum partial
    gradients in another order: tests/workers/runs.py); and a pipeline that is only
    re-cut, never re-split, equals the same run without moves *bitwise*."""
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as still_root:
        snap = job(root, [], **config["snapshot"])
        moved = run(snap, ForcedMoves(config["moves"]))
        events = [e for e in moved.report(0).events if e.kind == "repartition"]
        assert len(events) == len(config["moves"])
        assert_matches_reference(snap, metrics(moved))
        if snap.replicas == 1:
            still = run(replace(snap, checkpoint_root=still_root))
            assert [m.loss for m in metrics(moved)] == [m.loss for m in metrics(still)]
            a, b = final_states(snap), final_states(replace(snap, checkpoint_root=still_root))
            for i in b:
                for name, tensor in b[i]["module"].items():
                    assert torch.equal(a[i]["module"][name], tensor), (i, name)


@pytest.mark.unit
def test_a_repartition_is_an_event_with_both_layouts_and_the_checkpoint_follows(
    tmp_path: Path,
) -> None:
    snap = job(tmp_path, [(0, 1), (1, 4)], steps=3, checkpoint_every=1, checkpoint_keep=0)
    trainer = run(snap, ForcedMoves({1: ([(0, 3), (3, 4)], [2])}))
    (event,) = [e for e in trainer.report(0).events if e.kind == "repartition"]
    assert event.step == 1
    assert [r["blocks"] for r in event.data["from"]] == [[0, 1], [1, 4]]
    assert [r["blocks"] for r in event.data["to"]] == [[0, 3], [3, 4]]
    assert event.data["migration_s"] > 0 and event.data["predicted_gain"] == 0.5
    assert "re-cut 0-0@" in event.message and "forced by the test" in event.message
    from shoal.workers.checkpoints import CheckpointStore

    manifest, _ = CheckpointStore(tmp_path).read("job-1", 3)
    assert [s["blocks"] for s in manifest["layout"]["stages"]] == [[0, 3], [3, 4]]


@pytest.mark.unit
def test_a_straggler_is_measured_and_given_fewer_blocks(tmp_path: Path) -> None:
    """Stage 1's device is emulated 6x slower: after one window the policy moves blocks off
    it, the result is measured, and the parameters still equal the reference's."""
    node = "n0000000a"
    devices = [
        Device(f"{node}-cpu-{i}", node, i, "cpu", 2048, False, False, 6.0 if i == 1 else 1.0)
        for i in range(2)
    ]
    snap = job(
        tmp_path,
        [],
        stages=tuple(
            replace(p, device=d) for p, d in zip(plans([(0, 2), (2, 4)]), devices, strict=True)
        ),
        steps=8,
        micro_batches=4,
        elastic=ElasticConfig(window_steps=2, min_gain=0.1, horizon_steps=1000),
    )
    policy = snapshot_policy(snap)
    assert policy is not None
    trainer = run(snap, policy)
    events = trainer.report(0).events
    moves = [e for e in events if e.kind == "repartition"]
    assert moves, [e.message for e in events]
    first = moves[0]
    assert first.step == 2 and first.data["to"][1]["blocks"][0] > 2  # stage 1 holds fewer
    assert first.data["speeds"][devices[1].id] < first.data["speeds"][devices[0].id]
    assert "computes at" in first.message
    results = [e for e in events if e.kind == "repartition_result"]
    assert results and results[0].data["moved_at"] == 2
    assert_matches_reference(snap, metrics(trainer))


@pytest.mark.unit
def test_elastic_off_means_no_policy(tmp_path: Path) -> None:
    assert snapshot_policy(job(tmp_path, [(0, 4)])) is None


@pytest.mark.unit
def test_a_layout_only_takes_a_plan_over_its_own_devices() -> None:
    layout = Layout(plans([(0, 2), (2, 4)]), (2,))
    assert layout.plan().device_ids == ("n0000000-cpu-0", "n0000000-cpu-1")
    other = current_plan([(("x",), (0, 2)), (("y",), (2, 4))], [2])
    with pytest.raises(ValueError, match="only a re-cut over the same devices"):
        layout.with_plan(other)
    moved = layout.with_plan(
        current_plan([(("n0000000-cpu-0",), (0, 1)), (("n0000000-cpu-1",), (1, 4))], [2])
    )
    assert [p.blocks for p in moved.plans] == [(0, 1), (1, 4)]


def on_devices(
    ranges: Sequence[BlockRange], replicas: int, first_device: int
) -> tuple[StagePlan, ...]:
    """``dp_plans`` on devices ``first_device ..``: a layout sharing some devices with another."""
    node = "n0000000a"
    depth = len(ranges)
    return tuple(
        StagePlan(
            s,
            r,
            Device(
                f"{node[:8]}-cpu-{first_device + k}", node, first_device + k, "cpu", 2048, False
            ),
            replica=k // depth,
        )
        for k, (s, r) in enumerate((s, r) for _ in range(replicas) for s, r in enumerate(ranges))
    )


@st.composite
def relayouts(draw: st.DrawFn) -> dict[str, Any]:
    """A run that moves, after its first step, to other devices (some shared), stages and
    replicas."""
    micro_batches = draw(st.sampled_from([2, 4]))
    layouts = []
    for _ in range(2):
        replicas = draw(st.integers(1, 2))
        stages = draw(st.integers(1, 4 if replicas == 1 else 2))
        layouts.append(
            (
                on_devices(draw(cut_of(stages)), replicas, draw(st.integers(0, 3))),
                draw(split_of(micro_batches, replicas)),
            )
        )
    return {"layouts": layouts, "micro_batches": micro_batches, "steps": draw(st.integers(2, 3))}


@pytest.mark.unit
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(relayouts())
def test_a_relayout_onto_other_devices_stages_and_replicas_keeps_the_math(
    config: dict[str, Any],
) -> None:
    (first, split), (second, new_split) = config["layouts"]
    with tempfile.TemporaryDirectory() as root:
        snap = job(
            root,
            [],
            stages=first,
            replicas=len(split),
            replica_micro_batches=split,
            micro_batches=config["micro_batches"],
            steps=config["steps"],
            optimizer=SGD,
        )
        trainer = Trainer(snap, LocalGroup)
        trainer.relayout(second, new_split)  # carried out after the first step
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        (event,) = [e for e in trainer.report(0).events if e.kind == "relayout"]
        assert event.step == 1 and len(event.data["to"]) == len(second)
        added = {p.device.id for p in second} - {p.device.id for p in first}
        assert event.data["added"] == sorted(added)
        assert_matches_reference(snap, metrics(trainer))


@pytest.mark.unit
def test_a_requested_relayout_waits_for_its_workers_while_the_job_trains_on(
    tmp_path: Path,
) -> None:
    """The runner asks the group to start a requested relayout's workers
    (``WorkerGroup.prepare``) and trains on its layout until they are started; the first
    boundary after that moves."""
    log: list[tuple[str, list[str]]] = []

    class Watched(LocalGroup):
        applied = 0

        def submit(self, stage: int, method: str, *args: Any) -> Any:
            if method == "apply_step" and stage == 0:
                self.applied += 1
            return super().submit(stage, method, *args)

        def prepare(self, plans: Sequence[StagePlan]) -> bool:
            log.append(("prepare", [p.device.id for p in plans]))
            return self.applied >= 3  # started as the third step is applied

        def regroup(self, plans: Sequence[StagePlan], keep: Any) -> None:
            log.append(("regroup", [p.device.id for p in plans]))
            super().regroup(plans, keep)

    first, second = on_devices([(0, 2), (2, 4)], 1, 0), on_devices([(0, 1), (1, 4)], 1, 2)
    snap = job(tmp_path, [], stages=first, steps=5, optimizer=SGD)
    trainer = Trainer(snap, Watched)
    trainer.relayout(second, (2,))
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    ids = [p.device.id for p in second]
    asked = len(log) - 1
    assert asked >= 3 and log == [("prepare", ids)] * asked + [("regroup", ids)], log
    (event,) = [e for e in trainer.report(0).events if e.kind == "relayout"]
    assert event.step == 3, event  # steps 1-3 on the old layout, 4-5 on the new
    assert_matches_reference(snap, metrics(trainer))


@pytest.mark.unit
def test_a_relayout_that_does_not_cover_the_model_fails_the_run_with_why(tmp_path: Path) -> None:
    trainer = Trainer(job(tmp_path, [(0, 2), (2, 4)], steps=2), LocalGroup)
    trainer.relayout(on_devices([(0, 3)], 1, 5), (2,))
    assert trainer.run() is RunStatus.FAILED
    assert "must cover [0, 4)" in (trainer.report(0).error or "")


@pytest.mark.integration
def test_ray_stages_move_blocks_and_train_exactly(ray_address: str, tmp_path: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = job(tmp_path, [], stages=plans([(0, 1), (1, 2), (2, 4)], node), steps=4, micro_batches=4)
    moves = {1: ([(0, 2), (2, 3), (3, 4)], [4]), 2: ([(0, 1), (1, 3), (3, 4)], [4])}
    trainer = Trainer(snap, RayGroup, policy=ForcedMoves(moves))
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert len([e for e in trainer.report(0).events if e.kind == "repartition"]) == 2
    assert_matches_reference(snap, metrics(trainer))


def two_stages_here(root: Path, node: str, **fields: Any) -> JobSnapshot:
    """A 3-step job of 2 stages on ``node``'s devices, 4 micro-batches, SGD."""
    stages = dp_plans([(0, 2), (2, 4)], 1, node)
    return job(root, [], stages=stages, steps=3, micro_batches=4, optimizer=SGD, **fields)


class Patient(RayGroup):
    """A RayGroup whose ``prepare`` waits until the workers are built: the relayout is
    carried out at the first boundary, however fast the job's steps."""

    def prepare(self, plans: Sequence[StagePlan]) -> bool:
        deadline = time.monotonic() + 120
        while not super().prepare(plans):
            assert time.monotonic() < deadline, "the prepared workers were not built in 120 s"
            time.sleep(0.05)
        return True


@pytest.mark.integration
def test_ray_job_grows_onto_new_workers_and_replicas(ray_address: str, tmp_path: Path) -> None:
    """2 stages on 2 actors, then 2 stages x 2 replicas on 4: two actors start, the kept
    ones hand blocks over, the replicas form their gloo groups; the math holds."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = two_stages_here(tmp_path, node)
    trainer = Trainer(snap, Patient)
    trainer.relayout(dp_plans([(0, 1), (1, 4)], 2, node), (2, 2))
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    report = trainer.report(0)
    (event,) = [e for e in report.events if e.kind == "relayout"]
    assert len(event.data["added"]) == 2 and event.data["removed"] == []
    assert all(t.allreduce_s > 0 for t in report.metrics[-1].stages)
    assert_matches_reference(snap, report.metrics)


def copied_each_step(root: Path, stages: Sequence[StagePlan], **fields: Any) -> JobSnapshot:
    """A 5-step job on ``stages``, 4 micro-batches, SGD, a copy at every boundary (copies
    may cost the whole step)."""
    return job(
        root,
        [],
        stages=tuple(stages),
        micro_batches=4,
        steps=5,
        optimizer=SGD,
        keep_copies=True,
        copy_budget=1.0,
        **fields,
    )


class LoseDevices(LocalGroup):
    """A LocalGroup whose workers on ``devices`` die once ``after`` steps were applied (every
    call to them fails as StageLost from then on, as a lost node's would)."""

    def __init__(self, devices: Collection[str], after: int, *args: Any) -> None:
        self.devices, self.after, self.steps = frozenset(devices), after, 0
        super().__init__(*args)

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        plan = self._plans[stage]
        if method == "apply_step" and stage == 0:
            self.steps += 1
        if plan.device.id in self.devices and self.steps > self.after:
            from shoal.workers.pipeline.local_group import _Done

            return _Done(stage, method, error=StageLost(plan.index, plan.device.id, "node lost"))
        return super().submit(stage, method, *args)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("ranges", "replicas", "lose"),
    [([(0, 2), (2, 4)], 1, 1), ([(0, 1), (1, 2), (2, 4)], 1, 0), ([(0, 2), (2, 4)], 2, 3)],
)
def test_a_lost_worker_is_recovered_in_place_from_memory_copies(
    tmp_path: Path, ranges: list[BlockRange], replicas: int, lose: int
) -> None:
    """Mid-step, the worker at position ``lose`` dies: the survivors roll back to the last
    step, the lost blocks come from their buddies' copies, the blocks are re-cut over the
    devices left, and the run ends exactly like one process, no step replayed (copies may
    cost the whole step here, so one is taken at every boundary)."""
    stages = dp_plans(ranges, replicas)
    snap = copied_each_step(tmp_path, stages, replicas=replicas)
    dead = stages[lose].device.id
    trainer = Trainer(snap, lambda plans, setup: LoseDevices({dead}, 2, plans, setup))
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    events = trainer.report(0).events
    (lost,) = [e for e in events if e.kind == "device_lost"]
    assert lost.data["devices"] == [dead] and lost.data["steps_replayed"] == 0
    assert lost.data["resume_step"] == 2
    (back,) = [e for e in events if e.kind == "recovered"]
    assert dead not in {row["device_id"] for row in back.data["to"]}
    assert [m.step for m in metrics(trainer)] == [1, 2, 3, 4, 5]
    assert_matches_reference(snap, metrics(trainer))


class MoveThenLose(LoseDevices):
    """A LoseDevices whose trainer is asked for ``move`` once 3 steps were applied, and which
    records the steps its stage-0 worker snapshots."""

    def __init__(self, trainer: list[Trainer], move: tuple[StagePlan, ...], *args: Any) -> None:
        self.trainer, self.move, self.copied = trainer, move, list[int]()
        super().__init__(*args)

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        if method == "snapshot" and stage == 0:
            self.copied.append(args[0])
        handle = super().submit(stage, method, *args)
        if method == "apply_step" and stage == 0 and self.steps == 3:
            self.trainer[0].relayout(self.move, (4,))
        return handle


@pytest.mark.unit
def test_a_move_copies_the_new_layout_at_once_and_a_later_loss_recovers_from_it(
    tmp_path: Path,
) -> None:
    """Copies are rare here (a budget of 1e-9: after step 2 the next is 100 steps away),
    but blocks that move drop their workers' copies: the runner copies the new layout at
    the move's boundary, and a worker lost two steps later is recovered from that copy,
    exactly."""
    stages = dp_plans([(0, 1), (1, 2), (2, 4)], 1)
    move = tuple(
        replace(p, blocks=b) for p, b in zip(stages, [(0, 2), (2, 3), (3, 4)], strict=True)
    )
    snap = job(
        tmp_path,
        [],
        stages=stages,
        micro_batches=4,
        steps=7,
        optimizer=SGD,
        keep_copies=True,
        copy_budget=1e-9,
    )
    dead = stages[1].device.id
    holder: list[Trainer] = []
    groups: list[MoveThenLose] = []

    def make(plans: Any, setup: Any) -> MoveThenLose:
        groups.append(MoveThenLose(holder, move, {dead}, 5, plans, setup))
        return groups[-1]

    holder.append(Trainer(snap, make))
    trainer = holder[0]
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    events = trainer.report(0).events
    (moved,) = [e for e in events if e.kind == "relayout"]
    (lost,) = [e for e in events if e.kind == "device_lost"]
    assert moved.step == 3 and groups[0].copied[:4] == [0, 1, 2, 3], groups[0].copied
    assert lost.data["resume_step"] == 3 and lost.data["steps_replayed"] == 2, lost.data
    latest = {m.step: m for m in metrics(trainer)}  # a replayed step's record replaces it
    assert sorted(latest) == list(range(1, 8))
    assert_matches_reference(snap, [latest[s] for s in range(1, 8)])


@pytest.mark.unit
def test_a_move_asked_for_before_a_loss_is_dropped_and_said_so(tmp_path: Path) -> None:
    """A move onto the devices of the first and last stage, asked for in step 3, as the
    middle one's worker dies in that step: the job recovers from the copies and does not
    move (the controller's view of its devices follows the recovery): a ``relayout_failed``
    event says the move is over, so the controller may ask again."""
    stages = dp_plans([(0, 1), (1, 2), (2, 4)], 1)
    move = (replace(stages[0], blocks=(0, 2)), replace(stages[2], index=1, blocks=(2, 4)))
    snap = copied_each_step(tmp_path, stages)
    dead = stages[1].device.id
    holder: list[Trainer] = []
    holder.append(Trainer(snap, lambda p, s: MoveThenLose(holder, move, {dead}, 2, p, s)))
    trainer = holder[0]
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    events = trainer.report(0).events
    kinds = [e.kind for e in events if e.kind in ("relayout_failed", "device_lost", "relayout")]
    assert kinds == ["relayout_failed", "device_lost"], kinds
    (dropped,) = [e for e in events if e.kind == "relayout_failed"]
    assert dropped.data["reason"] == f"the job lost {dead}", dropped.data
    assert [row["device_id"] for row in dropped.data["to"]] == [p.device.id for p in move]
    latest = {m.step: m for m in metrics(trainer)}
    assert_matches_reference(snap, [latest[s] for s in range(1, 6)])


@pytest.mark.unit
@pytest.mark.parametrize("planned_here", [True, False], ids=["planned-here", "stale"])
def test_a_move_planned_while_the_job_was_on_other_devices_is_dropped(
    tmp_path: Path, planned_here: bool
) -> None:
    """A move says which devices it was planned from (the controller's view of the job):
    a job on others by then (it recovered from a loss meanwhile) drops it, saying so, and
    trains on where it is; planned from where it is, it moves."""
    stages = dp_plans([(0, 2), (2, 4)], 1)
    snap = job(tmp_path, [], stages=stages, steps=3, micro_batches=4, optimizer=SGD)
    trainer = Trainer(snap, LocalGroup)
    since = [p.device.id for p in stages] if planned_here else [stages[0].device.id, "gone-0"]
    trainer.relayout((replace(stages[0], blocks=(0, 4)),), (4,), since)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    events = trainer.report(0).events
    kinds = [e.kind for e in events if e.kind in ("relayout_failed", "relayout")]
    assert kinds == (["relayout"] if planned_here else ["relayout_failed"]), kinds
    if not planned_here:
        (dropped,) = [e for e in events if e.kind == "relayout_failed"]
        assert dropped.data["reason"] == "the job is on other devices now", dropped.data
    assert_matches_reference(snap, metrics(trainer))


@pytest.mark.unit
def test_without_copies_a_lost_worker_ends_the_run_as_lost(tmp_path: Path) -> None:
    stages = plans([(0, 2), (2, 4)])
    snap = job(tmp_path, [], stages=stages, steps=4, keep_copies=False)
    trainer = Trainer(snap, lambda p, s: LoseDevices({stages[1].device.id}, 1, p, s))
    assert trainer.run() is RunStatus.LOST
    assert trainer.report(0).lost_devices == (stages[1].device.id,)


@pytest.mark.unit
def test_too_few_devices_left_gives_the_job_back(tmp_path: Path) -> None:
    stages = plans([(0, 2), (2, 4)])
    snap = job(tmp_path, [], stages=stages, steps=4, keep_copies=True, min_devices=2)
    trainer = Trainer(snap, lambda p, s: LoseDevices({stages[0].device.id}, 1, p, s))
    assert trainer.run() is RunStatus.LOST
    assert "1 devices left, min_devices is 2" in (trainer.report(0).error or "")


@pytest.mark.unit
def test_survivors_too_small_for_the_model_give_the_job_back_as_lost(tmp_path: Path) -> None:
    """Each 2 GB device holds half the model's measured bytes: with one lost, no layout of
    the rest fits, so the job is given back (LOST: it resumes from its checkpoint where it
    fits) instead of failing."""
    stages = plans([(0, 2), (2, 4)])
    snap = job(
        tmp_path,
        [],
        stages=stages,
        steps=4,
        keep_copies=True,
        block_costs=uniform_costs(4, param_bytes=150 * 2**20, optim_bytes=300 * 2**20),
    )
    trainer = Trainer(snap, lambda p, s: LoseDevices({stages[1].device.id}, 1, p, s))
    assert trainer.run() is RunStatus.LOST, trainer.report(0).error
    error = trainer.report(0).error or ""
    assert "the 1 devices left cannot hold the job" in error, error
    assert trainer.report(0).lost_devices == (stages[1].device.id,)


@pytest.mark.unit
def test_the_policy_is_asked_once_per_window_and_the_runner_knows_when() -> None:
    asked: list[int] = []

    def policy(layout: Layout, history: Sequence[Sequence[StageSample]]) -> Decision:
        asked.append(len(history))
        return Keep("test")

    rebalancer = Rebalancer(policy, 3, 1.0, lambda _: None)
    layout = Layout(plans([(0, 2), (2, 4)]), (2,))
    timings = tuple(StageTiming(p.index, p.device.id, 0.1, 0.0) for p in layout.plans)
    no_moves: Any = None  # a policy that keeps never touches the group
    announced, until, until_in_flight = [], [], []
    for step in range(1, 8):
        announced.append(rebalancer.asks_after(1))
        until.append(rebalancer.steps_to_ask())
        until_in_flight.append(rebalancer.steps_to_ask(unrecorded=1))
        rebalancer.after_step(no_moves, layout, StepMetrics(step, 1.0, 1.0, 0.2, timings))
    assert asked == [3, 6]
    assert announced == [False, False, True, False, False, True, False]
    assert until == [3, 2, 1, 3, 2, 1, 3]
    assert until_in_flight == [2, 1, 3, 2, 1, 3, 2]


class Hasty(Patient):
    """A Patient group whose new workers must start within 3 s (its first ones, 300 s)."""

    def __init__(self, plans: Sequence[StagePlan], setup: Any) -> None:
        super().__init__(plans, setup)
        self._start_timeout_s = 3.0


class Holder:
    """An actor that only holds the resources it was given."""


@pytest.fixture
def three_devices_free(ray_address: str) -> Iterator[None]:
    """Every virtual device of the shared Ray but three held by an actor of the test's own:
    a fourth stage worker waits for one."""
    import ray

    from shoal.scheduler.devices import DEVICE_RESOURCE

    total = ray.cluster_resources()[DEVICE_RESOURCE]
    deadline = time.monotonic() + 60  # the workers of the tests before may still be ending
    while ray.available_resources().get(DEVICE_RESOURCE, 0.0) < total:
        assert time.monotonic() < deadline, f"devices still taken: {ray.available_resources()}"
        time.sleep(0.2)
    held = total - 3
    holder = ray.remote(Holder).options(num_cpus=0, resources={DEVICE_RESOURCE: held}).remote()
    ray.get(holder.__ray_ready__.remote(), timeout=60)
    yield
    ray.kill(holder)


@pytest.mark.integration
@pytest.mark.parametrize("late", [False, True], ids=["refused", "late"])
def test_a_relayout_whose_new_worker_cannot_start_reports_its_device_lost(
    ray_address: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    late: bool,
) -> None:
    """A relayout onto a device whose worker cannot start (its node is gone: Ray refuses to
    place the worker; or it is not granted its device within the start timeout, every
    other device of the node taken) is reported as that device's loss once the step before
    it was trained, and the job trains on, exactly, on the devices it had."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = two_stages_here(tmp_path, node, keep_copies=True, copy_budget=1.0)
    *wanted, last = dp_plans([(0, 1), (1, 4)], 2, node)
    waits: list[float] = []  # how long each start of workers waited for them to be built
    if late:
        request.getfixturevalue("three_devices_free")
        waited = group_module.wait_ready
        monkeypatch.setattr(
            group_module,
            "wait_ready",
            lambda group, plans, timeout: waits.append(timeout) or waited(group, plans, timeout),
        )
    else:
        last = replace(last, device=replace(last.device, id="gone-cpu-3", node_id="ab" * 28))
    trainer = Trainer(snap, Hasty if late else Patient)
    trainer.relayout((*wanted, last), (2, 2))
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    report = trainer.report(0)
    events = [(e.kind, e.data) for e in report.events]
    (lost,) = [data for kind, data in events if kind == "device_lost"]
    assert lost["devices"] == [last.device.id], events
    (message,) = [e.message for e in report.events if e.kind == "device_lost"]
    assert ("did not start within 3 s" if late else "cannot host it") in message, message
    # A worker not started is said so: the control plane leaves its device alone a while.
    unready = [data["device_id"] for kind, data in events if kind == "worker_not_started"]
    assert unready == ([last.device.id] if late else []), events
    # The move (the second wait: the first is the job's start, the last its recovery's)
    # waited only what was left of the start timeout of the worker prepared for it (none:
    # a moment), not the whole timeout again.
    assert not late or waits[1] == group_module.LATE_CHECK_S < 3, waits
    assert not [kind for kind, _ in events if kind == "relayout"], events
    (failed,) = [data for kind, data in events if kind == "relayout_failed"]
    assert failed["device_id"] == last.device.id, failed
    # Step 1 was trained before the move failed, and is trained again: the event says so.
    steps = [m.step for m in report.metrics]
    assert lost["step"] == 1 and steps.count(1) == 2, (steps, lost)
    assert lost["steps_replayed"] == len(steps) - len(set(steps)) <= lost["most_replayed"], lost
    (back,) = [data for kind, data in events if kind == "recovered"]
    assert {row["device_id"] for row in back["to"]} <= {p.device.id for p in snap.stages}
    assert_matches_reference(snap, list({m.step: m for m in report.metrics}.values()))


@pytest.mark.integration
def test_a_job_whose_first_worker_cannot_start_is_given_back_as_that_devices_loss(
    ray_address: str, three_devices_free: None, tmp_path: Path
) -> None:
    """A job of 4 stages starting where only 3 devices are free: one worker is not granted
    its device within the start timeout. The runner stops the others and gives the job back
    as that device's loss (LOST, with a ``worker_not_started`` event), which the control
    plane places again elsewhere; it failed the job before."""
    import ray

    from shoal.scheduler.devices import DEVICE_RESOURCE

    node = ray.get_runtime_context().get_node_id()
    stages = dp_plans([(0, 1), (1, 2), (2, 3), (3, 4)], 1, node)
    snap = job(tmp_path, [], stages=stages, steps=2, micro_batches=4, optimizer=SGD)
    trainer = Trainer(snap, lambda p, s: RayGroup(p, s, start_timeout_s=3.0))
    assert trainer.run() is RunStatus.LOST, trainer.report(0).error
    report = trainer.report(0)
    (said,) = [e.data for e in report.events if e.kind == "worker_not_started"]
    assert said["device_id"] in {p.device.id for p in stages}, said
    assert report.lost_devices == (said["device_id"],), report
    assert "did not start within 3 s" in (report.error or ""), report.error
    deadline = time.monotonic() + 30  # the workers that did start are stopped
    while ray.available_resources().get(DEVICE_RESOURCE, 0.0) < 3:
        assert time.monotonic() < deadline, f"devices still taken: {ray.available_resources()}"
        time.sleep(0.2)
