"""The runner hands out several steps per call, and the next call before collecting the
last, where the boundaries between them need nothing of it; the math is unchanged."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shoal.scheduler.copies import LONGEST_INTERVAL
from shoal.scheduler.elastic import Decision, ElasticConfig, Keep, StageSample
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.stage_types import StepOutcome
from shoal.workers.pipeline.step_driver import Flight, finish_step
from shoal.workers.pipeline.timing import StepClock
from shoal.workers.pipeline.worker_group import Handle
from shoal.workers.snapshot import JobSnapshot, RunStatus
from shoal.workers.wire import Bits
from tests.factories import SGD, job, plans
from tests.workers.pipeline.test_rebalance import ForcedMoves
from tests.workers.runs import assert_bitwise_equal, final_states

STEP_CALLS = {"step", "steps"}


class Spy(RayGroup):
    """A RayGroup that records, at every collection of a call, how many calls its workers
    had been handed (the one collected included) and how many steps that call carried;
    every method it was handed; and any data (tensors, arrays) a step call carried."""

    def __init__(self, *args: Any) -> None:
        self.handed: list[int] = []
        self.collected: list[tuple[int, int]] = []
        self.methods: list[str] = []
        self.data: list[Any] = []
        super().__init__(*args)

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        self.methods.append(method)
        if method in STEP_CALLS and stage == 0:
            self.handed.append(len(args[3]) if method == "steps" else 1)
        if method in STEP_CALLS:
            values = [v for a in args for v in (a if isinstance(a, list) else [a])]
            self.data += [v for v in values if isinstance(v, torch.Tensor | np.ndarray | Bits)]
        return super().submit(stage, method, *args)

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        if handles and all(h.method in STEP_CALLS for h in handles):
            self.collected.append((len(self.handed), self.handed.pop(0)))
        return super().get(handles, timeout)

    @property
    def steps_collected(self) -> int:
        return sum(steps for _, steps in self.collected)


def _spied(snap: JobSnapshot, cores: int = 2, policy: Any = None) -> tuple[Trainer, list[Spy]]:
    """Run ``snap`` with a runner that sees ``cores`` cores (one CPU stage leaves it one)."""
    spies: list[Spy] = []

    def make(*args: Any) -> Spy:
        spies.append(Spy(*args))
        return spies[-1]

    trainer = Trainer(snap, make, cores=cores, policy=policy)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    return trainer, spies


@pytest.fixture
def one_stage(ray_address: str, tmp_path: Path) -> JobSnapshot:
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    return job(tmp_path / "ray", [(0, 4)], stages=plans([(0, 4)], node), steps=6, optimizer=SGD)


@pytest.mark.integration
def test_steps_are_handed_out_together_and_early_except_where_a_boundary_needs_the_workers(
    one_stage: JobSnapshot, tmp_path: Path
) -> None:
    snap = replace(one_stage, checkpoint_every=3, checkpoint_keep=0)
    trainer, (spy,) = _spied(snap)
    # (calls handed out, steps in the call collected): steps 1 and 2 go one per call (no
    # step time is known yet when they are handed out), each collected with the next call
    # already handed out; step 3 ends at a checkpoint (its states must be those of that
    # step); steps 4-6 then go in one call, up to the run's end.
    assert spy.collected == [(2, 1), (2, 1), (1, 1), (1, 3)]
    assert spy.data == []  # the stage draws its batches: the runner relays no data
    metrics = trainer.report(0).metrics
    assert [m.step for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m.step_time_s > 0 for m in metrics)
    local = replace(snap, checkpoint_root=str(tmp_path / "local"), stages=plans([(0, 4)]))
    reference = Trainer(local, LocalGroup)
    assert reference.run() is RunStatus.SUCCEEDED
    assert [m.loss for m in metrics] == [m.loss for m in reference.report(0).metrics]
    assert_bitwise_equal(final_states(snap), final_states(local))
    assert_bitwise_equal(
        CheckpointStore(snap.checkpoint_root).read(snap.job_id, 3)[1],
        CheckpointStore(local.checkpoint_root).read(local.job_id, 3)[1],
    )


@pytest.mark.integration
def test_clipping_collects_every_step_before_the_next(one_stage: JobSnapshot) -> None:
    clipped = replace(one_stage, optimizer=replace(SGD, clip_grad_norm=0.05), steps=3)
    _, (spy,) = _spied(clipped)
    assert spy.collected == [(1, 1)] * 3  # the update waits for every stage's norms


@pytest.mark.integration
def test_copies_are_queued_between_step_calls_handed_out_early(
    one_stage: JobSnapshot, tmp_path: Path
) -> None:
    # Copies that may cost the whole training time: one at every boundary, each handed out
    # behind the step call before it and ahead of the next, which need not wait for the
    # runner to collect the first.
    copied = replace(one_stage, keep_copies=True, copy_budget=1.0, steps=3, job_id="job-copies")
    trainer, (spy,) = _spied(copied)
    assert spy.collected == [(2, 1), (2, 1), (1, 1)]
    calls = [
        "step" if m in STEP_CALLS else m for m in spy.methods if m in STEP_CALLS | {"snapshot"}
    ]
    assert calls == ["snapshot", "step"] * 3  # the start's copy, then one after steps 1, 2
    # A lone worker has no buddy to hold its copy: the state stays with it, never shipped.
    assert "shipment" not in spy.methods
    local = replace(copied, checkpoint_root=str(tmp_path / "local"), stages=plans([(0, 4)]))
    reference = Trainer(local, LocalGroup)
    assert reference.run() is RunStatus.SUCCEEDED
    assert [m.loss for m in trainer.report(0).metrics] == [
        m.loss for m in reference.report(0).metrics
    ]
    assert_bitwise_equal(final_states(copied), final_states(local))


@pytest.mark.integration
def test_copies_costlier_than_their_budget_are_taken_less_often(one_stage: JobSnapshot) -> None:
    # Any copy is over a budget of 1e-9 of the training time. The start's copy is not
    # measured (the first step's time holds the workers' start); once step 2 has measured
    # step 1's, the next copy is the longest interval away and the rest of the run is one
    # call (until then one step per call: a copy at every boundary).
    sparse = replace(one_stage, keep_copies=True, copy_budget=1e-9, steps=6, job_id="job-sparse")
    trainer, (spy,) = _spied(sparse)
    assert spy.collected == [(2, 1), (2, 1), (1, 4)]
    assert spy.methods.count("snapshot") == 3  # at the start and after steps 1 and 2
    (event,) = [e for e in trainer.report(0).events if e.kind == "copies"]
    assert (event.step, event.data["interval"]) == (2, LONGEST_INTERVAL), event
    assert event.data["copy_s"] > 0 and event.data["overhead"] > 1e-9
    copy_s = [t.copy_s for m in trainer.report(0).metrics for t in m.stages]
    # Each copy is booked on the step after it.
    assert min(copy_s[:3]) > 0 and copy_s[3:] == [0.0] * 3, copy_s


@pytest.mark.integration
def test_calls_do_not_overlap_where_the_cpu_workers_take_every_core(
    one_stage: JobSnapshot,
) -> None:
    _, (spy,) = _spied(replace(one_stage, steps=6, checkpoint_every=3), cores=1)
    # The runner's work would take the stage's core: one call at a time, still several
    # steps in one where no boundary between them needs the runner.
    assert spy.collected == [(1, 1), (1, 2), (1, 3)]


@pytest.mark.integration
def test_a_call_ends_where_the_policy_is_asked(one_stage: JobSnapshot) -> None:
    spies: list[Spy] = []

    def policy(layout: Layout, history: Sequence[Sequence[StageSample]]) -> Decision:
        asked.append((len(history), spies[0].steps_collected))
        return Keep("test")

    asked: list[tuple[int, int]] = []
    snap = replace(one_stage, steps=8, elastic=ElasticConfig(window_steps=3))

    def make(*args: Any) -> Spy:
        spies.append(Spy(*args))
        return spies[-1]

    trainer = Trainer(snap, make, cores=1, policy=policy)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    # Asked after steps 3 and 6, each time with exactly those steps collected: no call
    # carried steps past an ask (the policy may move blocks there).
    assert asked == [(3, 3), (6, 6)]
    assert spies[0].collected == [(1, 1), (1, 2), (1, 3), (1, 2)]


@pytest.mark.integration
def test_a_new_layouts_first_step_is_handed_out_alone(one_stage: JobSnapshot) -> None:
    """The last step's time says how long a call of several takes only on the layout it
    ran on: after a move (here a forced re-cut at the first ask) the new layout's first
    step goes alone, and the calls after it carry several steps again."""
    stages = [(0, 1), (1, 4)]
    node = one_stage.stages[0].device.node_id
    snap = replace(
        one_stage,
        stages=plans([(0, 2), (2, 4)], node),
        steps=9,
        elastic=ElasticConfig(window_steps=3),
    )
    trainer, (spy,) = _spied(
        snap, cores=1, policy=ForcedMoves({1: (stages, (snap.micro_batches,))})
    )
    moves = [e for e in trainer.report(0).events if e.kind == "repartition"]
    assert [e.step for e in moves] == [3], moves
    # Step 1 alone (no time yet), 2-3 up to the ask, the move; then step 4 alone on the new
    # cut, 5-6 up to the next ask, 7-9 to the end.
    assert spy.collected == [(1, 1), (1, 2), (1, 1), (1, 2), (1, 3)]


class Canned:
    """A worker group whose calls have already run: ``get`` returns each worker's outcomes."""

    def __init__(self, outcomes: list[list[StepOutcome]]) -> None:
        self.outcomes = outcomes

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        return self.outcomes


@pytest.mark.unit
def test_a_calls_time_is_shared_among_its_steps_as_their_slowest_workers_measured_them() -> None:
    import torch

    from shoal.workers.wire import send

    two = plans([(0, 2), (2, 4)])

    def outcome(seconds: float, losses: tuple[float, ...] = ()) -> StepOutcome:
        return StepOutcome(losses, send(torch.tensor([3.0])), StepClock(0.1, 0.0), seconds)

    # Steps 4-6 in one call; the last stage was the slower in step 5, the first in step 6.
    group: Any = Canned(
        [
            [outcome(1.0), outcome(1.5), outcome(3.0)],
            [outcome(0.5, (0.1, 0.2)), outcome(3.0, (0.3, 0.4)), outcome(1.0, (0.5, 0.6))],
        ]
    )
    flight = Flight(3, 3, Layout(two, (2,)), started=10.0, handles=(), one_call=True)
    snap = job("unused", [], stages=two, steps=6, optimizer=SGD)
    metrics, ended = finish_step(snap, group, flight, timeout=1.0, clock=lambda: 17.0, since=9.0)
    assert ended == 17.0
    assert [m.step for m in metrics] == [4, 5, 6]
    assert [m.step_time_s for m in metrics] == pytest.approx([1.0, 3.0, 3.0])  # 7 s: 1:3:3
    assert [m.loss for m in metrics] == pytest.approx([0.3, 0.7, 1.1])
    assert all(m.grad_norm == pytest.approx(math.hypot(3.0, 3.0)) for m in metrics)
    # A call handed out while the last was still running is timed from the last one's end.
    later, _ = finish_step(snap, group, flight, timeout=1.0, clock=lambda: 17.0, since=13.0)
    assert sum(m.step_time_s for m in later) == pytest.approx(4.0)


class KillAtCall(Spy):
    """A Spy whose worker at ``victim`` is killed (SIGKILL, as a lost node's process ends)
    once worker 0 was handed its ``after``-th step call."""

    def __init__(self, victim: int, after: int, *args: Any) -> None:
        self.victim, self.after, self.calls = victim, after, 0
        super().__init__(*args)
        self.pids = self.get([self.submit(w, "pid") for w in range(len(self._plans))], 60)

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        handle = super().submit(stage, method, *args)
        if method in STEP_CALLS and stage == 0:
            self.calls += 1
            if self.calls == self.after:
                os.kill(self.pids[self.victim], signal.SIGKILL)
        return handle


@pytest.mark.integration
@pytest.mark.parametrize("after", [2, 3, 4])
def test_a_worker_lost_while_the_next_call_is_handed_out_early_is_recovered_exactly(
    ray_address: str, tmp_path: Path, after: int
) -> None:
    """A 2-stage pipeline whose runner has cores to spare hands out each step call before
    collecting the last; the second worker is killed as the ``after``-th is handed out. The
    call handed out ahead dies with the step before it: the survivor rolls back, and the run
    goes on from the restore step (not from the call ahead) and ends as one process's."""
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    stages = [(0, 2), (2, 4)]
    snap = job(
        tmp_path / "ray",
        [],
        stages=plans(stages, node),
        steps=8,
        optimizer=SGD,
        keep_copies=True,
        copy_budget=1.0,
    )
    groups: list[KillAtCall] = []

    def make(*args: Any) -> KillAtCall:
        groups.append(KillAtCall(1, after, *args))
        return groups[-1]

    trainer = Trainer(snap, make, cores=8)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert groups[0].collected[0] == (2, 1), groups[0].collected  # a call was ahead
    lost = [e.data for e in trainer.report(0).events if e.kind == "device_lost"]
    assert len(lost) == 1, lost
    assert lost[0]["steps_replayed"] <= lost[0]["most_replayed"], lost[0]
    local = replace(snap, checkpoint_root=str(tmp_path / "local"), stages=plans(stages))
    assert Trainer(local, LocalGroup).run() is RunStatus.SUCCEEDED
    assert_bitwise_equal(final_states(snap), final_states(local))
