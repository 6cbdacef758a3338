"""The runner hands out the next step before collecting the last one where nothing happens
between them: each worker starts it right away, and the math is unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.factories import SGD, job, plans
from tests.workers.runs import assert_bitwise_equal, final_states
from workers.checkpoints import CheckpointStore
from workers.group import Handle, LocalGroup, RayGroup
from workers.runner import Trainer
from workers.snapshot import JobSnapshot, RunStatus


class Spy(RayGroup):
    """A RayGroup that counts, at every collection of a step, how many steps its workers
    had been handed (the step being collected included)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.handed = 0
        self.outstanding: list[int] = []

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        if method == "step" and stage == 0:
            self.handed += 1
        return super().submit(stage, method, *args)

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        if handles and all(h.method == "step" for h in handles):
            self.outstanding.append(self.handed)
            self.handed -= 1
        return super().get(handles, timeout)


def _spied(snap: JobSnapshot, cores: int = 2) -> tuple[Trainer, list[Spy]]:
    """Run ``snap`` with a runner that sees ``cores`` cores (one CPU stage leaves it one)."""
    spies: list[Spy] = []

    def make(*args: Any) -> Spy:
        spies.append(Spy(*args))
        return spies[-1]

    trainer = Trainer(snap, make, cores=cores)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    return trainer, spies


@pytest.fixture
def one_stage(ray_address: str, tmp_path: Path) -> JobSnapshot:
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    return job(tmp_path / "ray", [(0, 4)], stages=plans([(0, 4)], node), steps=6, optimizer=SGD)


@pytest.mark.integration
def test_the_next_step_is_handed_out_except_where_a_boundary_needs_the_workers(
    one_stage: JobSnapshot, tmp_path: Path
) -> None:
    snap = replace(one_stage, checkpoint_every=3, checkpoint_keep=0)
    trainer, (spy,) = _spied(snap)
    # Steps 1, 2, 4 and 5 are collected with the next one already handed out; steps 3 and
    # 6 end at a checkpoint (its states must be those of that step), 6 is also the last.
    assert spy.outstanding == [2, 2, 1, 2, 2, 1]
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
def test_clipping_and_copies_collect_every_step_before_the_next(one_stage: JobSnapshot) -> None:
    clipped = replace(one_stage, optimizer=replace(SGD, clip_grad_norm=0.05), steps=3)
    _, (spy,) = _spied(clipped)
    assert spy.outstanding == [1, 1, 1]  # the update waits for every stage's norms
    copied = replace(one_stage, keep_copies=True, steps=3, job_id="job-copies")
    _, (spy,) = _spied(copied)
    assert spy.outstanding == [1, 1, 1]  # each boundary copies the step's state


@pytest.mark.integration
def test_steps_do_not_overlap_where_the_cpu_workers_take_every_core(
    one_stage: JobSnapshot,
) -> None:
    _, (spy,) = _spied(replace(one_stage, steps=3), cores=1)
    assert spy.outstanding == [1, 1, 1]  # the runner's work would take the stage's core
