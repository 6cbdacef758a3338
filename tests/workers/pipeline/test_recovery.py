"""A worker lost at any step, in any layout, costs no exactness and replays no more than the
copies allow; a loss while copies are still on their way: the survivors restore the
latest step that every one of them and every lost block's holder keeps, never older than
the latest copy the runner confirmed held; and a worker lost with the buddy holding its
copies: the job is given back and resumes from its checkpoint, exactly."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.workers.pipeline.local_group import LocalGroup, _Done
from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.recovery import Copies, buddies, recover
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.worker_group import StageLost
from shoal.workers.snapshot import RunStatus, StageTiming, StepMetrics
from shoal.workers.zoo.data import make_data
from tests.factories import SGD, job, plans
from tests.workers.pipeline.test_copier import assert_states_equal
from tests.workers.pipeline.test_rebalance import LoseDevices, layout_fields
from tests.workers.runs import assert_matches_reference, metrics

pytestmark = pytest.mark.unit


@st.composite
def losses(draw: st.DrawFn) -> dict[str, Any]:
    """2-4 workers (1-2 replicas of 1-4 stages), one of them lost once a random number of
    steps were applied, copies taken at every boundary or as their budget allows."""
    replicas = draw(st.integers(1, 2))
    stages = draw(st.integers(2, 4) if replicas == 1 else st.integers(1, 2))
    micro_batches = draw(st.sampled_from([2, 4]))
    steps = draw(st.integers(3, 5))
    fields = layout_fields(draw, replicas, stages, micro_batches, steps)
    return {
        "snapshot": {
            **fields,
            "keep_copies": True,
            "copy_budget": draw(st.sampled_from([1.0, 0.05])),
        },
        "lose": draw(st.integers(0, stages * replicas - 1)),
        "after": draw(st.integers(0, steps - 1)),
    }


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(losses())
def test_a_worker_lost_at_any_step_in_any_layout_leaves_the_math_unchanged(
    config: dict[str, Any],
) -> None:
    """Against the single-process reference (``tests/workers/runs.py``): the run recovers in
    place from the copies, replays at most what its ``device_lost`` event allowed and says it
    replayed, and every step's metrics (a replayed step's rerun) are the reference's."""
    with tempfile.TemporaryDirectory() as root:
        snap = job(root, [], **config["snapshot"])
        dead = snap.stages[config["lose"]].device.id
        after = config["after"]
        trainer = Trainer(snap, lambda plans, setup: LoseDevices({dead}, after, plans, setup))
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        events = trainer.report(0).events
        (lost,) = [e.data for e in events if e.kind == "device_lost"]
        assert lost["devices"] == [dead], lost
        assert lost["steps_replayed"] <= lost["most_replayed"], lost
        if snap.copy_budget >= 1.0:  # a copy at every boundary: the interval never changes
            assert lost["most_replayed"] <= lost["copy_interval"] == 1, lost
        steps = metrics(trainer)
        kept = {m.step: m for m in steps}  # as the service stores them: a rerun replaces
        assert sorted(kept) == list(range(1, snap.steps + 1)), [m.step for m in steps]
        assert len(steps) - len(kept) == lost["steps_replayed"], ([m.step for m in steps], lost)
        assert_matches_reference(snap, list(kept.values()))


class InTransit(LocalGroup):
    """A LocalGroup whose ``hold`` of worker ``late``'s copy of step ``step`` at worker
    ``at`` never runs (the copy is still on its way), and whose worker ``lost`` answers
    nothing once lost."""

    def __init__(self, late: int, at: int, step: int, *args: Any) -> None:
        self.lost: int | None = None
        self.withheld: tuple[Any, ...] = ()
        super().__init__(*args)
        self.withheld = (at, "hold", (self._plans[late].device.id, step))

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        if stage == self.lost:
            plan = self._plans[stage]
            return _Done(stage, method, error=StageLost(plan.index, plan.device.id, "node lost"))
        if (stage, method, args[:2]) == self.withheld:
            return _Done(stage, method)  # never confirmed: the runner has not got to it
        return super().submit(stage, method, *args)

    def train(self, seed: int) -> dict[int, Any]:
        """Change every worker's blocks as a step would (once their copies are made); the
        blocks' states after it."""
        assert self._workers is not None
        generator = torch.Generator().manual_seed(seed)
        states: dict[int, Any] = {}
        for worker in self._workers:
            stage = worker.stage
            stage.copier.settle()
            with torch.no_grad():
                for block in stage.blocks:
                    for parameter in block.module.parameters():
                        parameter.add_(torch.randn(parameter.shape, generator=generator))
            states.update(stage.state())
        return states


def test_a_survivor_that_copied_ahead_of_its_buddys_copy_restores_the_copy_confirmed(
    tmp_path: Path,
) -> None:
    """Worker 0 runs its copy of step 3 (handed out ahead) while worker 1's copy of step 2
    is still on its way to it; worker 1 is then lost. Worker 0's own copies of steps 2 and
    3 are younger than anything it holds for worker 1: the restore step is 1, the copy
    the runner confirmed held, and the blocks come back exactly as they were after it."""
    snap = job(tmp_path, [(0, 2), (2, 4)], optimizer=SGD, keep_copies=True, copy_budget=1.0)
    layout = Layout(snap.stages, (snap.micro_batches,))
    setup = StageSetup.of(snap, make_data(snap.data, 0).meta)
    group = InTransit(1, 0, 2, snap.stages, setup)
    copies = Copies(snap.copy_budget, 30.0)

    group.train(seed=0)
    after_1 = group.train(seed=1)
    copies.refresh(group, layout, 1)  # held both ways
    group.train(seed=2)
    copies.refresh(group, layout, 2)  # worker 1's copy of it not at worker 0 yet
    copies.confirm(group, 2, 30.0)  # the copies of step 1 are held
    group.train(seed=3)
    group.get([group.submit(0, "snapshot", 3, 3)], 30.0)  # the copy handed out ahead
    group.lost = 1

    assert copies.most_replayed(2) == 1  # lost during step 3: back to step 1 at most
    found = recover(group, layout, snap, {}, 30.0)
    assert found.restore_step == 1 and found.lost == (snap.stages[1].device.id,)
    (plan,) = found.layout.plans
    assert plan.blocks == (0, 4)
    (restored,) = group.get([group.submit(0, "state")], 30.0)
    assert restored.keys() == after_1.keys()
    for index, state in after_1.items():
        assert_states_equal(restored[index]["module"], state["module"])


@pytest.mark.unit
def test_a_step_pays_every_stages_copy_where_the_stages_share_the_machines_cores() -> None:
    """The runner tells the copies whether the stages' CPU devices take every core; where
    they do, a copy costs the step the sum of the workers' seconds, else the slowest's."""
    timings = tuple(
        StageTiming(i, f"n0-cpu-{i}", 0.1, 0.0, copy_s=seconds)
        for i, seconds in enumerate((0.020, 0.030))
    )
    step = StepMetrics(step=3, loss=0.0, samples_per_s=1.0, step_time_s=0.2, stages=timings)
    apart, shared = Copies(0.05, 30.0), Copies(0.05, 30.0)
    apart.observe(step)
    shared.observe(step, cores_shared=True)
    assert apart.cadence.copy_s == pytest.approx(0.030)
    assert shared.cadence.copy_s == pytest.approx(0.050)


def test_a_workers_copy_goes_to_the_next_worker_on_another_node_where_there_is_one() -> None:
    here, there = plans([(0, 1), (1, 2)], "n000000a"), plans([(2, 3), (3, 4)], "n000000b")
    stages = tuple(replace(p, index=i) for i, p in enumerate([*here, *there]))
    assert buddies(Layout(stages, (4,))) == [2, 2, 0, 0]
    assert buddies(Layout(here, (4,))) == [1, 0]  # one node: the next worker
    assert buddies(Layout(here[:1], (4,))) == [None]  # a lone worker keeps its own


def test_a_worker_lost_with_its_buddy_gives_the_job_back_to_resume_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Workers 0 and 1 die together in step 4. Worker 0's copies were held by worker 1 (its
    buddy), so no survivor holds block 0 at any step: the runner gives the job back (LOST,
    saying why) rather than guess. Placed again on the device left, as the controller
    places a lost job (a new attempt, ``service.controller``), it resumes from its latest
    checkpoint, of step 2, and ends as one process would: every step's loss and the final
    parameters are the single-process run's."""
    stages = plans([(0, 1), (1, 2), (2, 4)])
    snap = job(
        tmp_path,
        [],
        stages=stages,
        steps=6,
        micro_batches=4,
        optimizer=SGD,
        keep_copies=True,
        copy_budget=1.0,
        checkpoint_every=2,
        checkpoint_keep=2,
    )
    assert buddies(Layout(stages, (4,))) == [1, 2, 0]
    dead = {stages[0].device.id, stages[1].device.id}
    first = Trainer(snap, lambda plans, setup: LoseDevices(dead, 3, plans, setup))
    assert first.run() is RunStatus.LOST, first.report(0).error
    report = first.report(0)
    assert "no step whose state every block kept" in (report.error or ""), report.error
    assert set(report.lost_devices) <= dead, report.lost_devices
    assert not [e for e in report.events if e.kind == "recovered"], report.events

    survivor = replace(stages[2], index=0, blocks=(0, 4))
    second = Trainer(replace(snap, attempt=2, stages=(survivor,)), LocalGroup)
    assert second.run() is RunStatus.SUCCEEDED, second.report(0).error
    (resumed,) = [e for e in second.report(0).events if e.kind == "resumed"]
    assert resumed.data["step"] == 2, resumed.data
    latest = {m.step: m for m in metrics(first) + metrics(second)}  # a rerun replaces
    assert sorted(latest) == list(range(1, 7)), sorted(latest)
    assert_matches_reference(snap, [latest[s] for s in range(1, 7)])
