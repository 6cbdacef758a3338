"""Tensor-parallel stages: a worker whose plan names a tensor group splits its blocks over
the group's devices (``workers.tensor_split``) and trains as the single-process reference
does, within the DESIGN tolerance; its checkpoints and moves hold whole blocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.devices import Device
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.recovery import plan_survivors
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.snapshot import ModelRef, RunStatus, StagePlan, stage_plans
from shoal.workers.tensor_split import TensorBlock
from tests.factories import ADAM, GPT, TOKENS, job, plans
from tests.workers.runs import assert_bitwise_equal, assert_matches_reference, final_states, metrics


def _grouped(stages: tuple[StagePlan, ...], ways: int, node: str) -> tuple[StagePlan, ...]:
    """``stages`` each given ``ways - 1`` more CPU devices of ``node`` as its tensor group."""
    count = len(stages)
    return tuple(
        replace(
            plan,
            tensor_devices=tuple(
                Device(f"{node[:8]}-cpu-{count + s * (ways - 1) + k}", node, 0, "cpu", 2048, False)
                for k in range(ways - 1)
            ),
        )
        for s, plan in enumerate(stages)
    )


DECLARED = ModelRef(None, "tests.workers.test_factories:residual_mlp", {"hidden": 6})
"""A factory's model whose middle block declares its own split."""


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model", "ways"),
    [("mlp", 2), ("gpt", 2), ("declared", 2)],
    ids=["mlp-2-way", "gpt-2-way", "declared-2-way"],
)
def test_tensor_parallel_stages_train_as_the_reference(
    tmp_path: Path, model: str, ways: int
) -> None:
    """Two stages, each split, gradient clipping on, a checkpoint every 2 steps: losses,
    gradient norms and the final (whole) parameters are the reference's."""
    fields: dict[str, Any] = {"optimizer": replace(ADAM, clip_grad_norm=0.5)}
    if model == "gpt":
        fields |= {"model": GPT, "data": TOKENS, "num_blocks": 4}
    if model == "declared":
        allowed = ("tests.workers.test_factories",)
        fields |= {"model": DECLARED, "num_blocks": 3, "allowed_factories": allowed}
    ranges = [(0, 2), (2, fields.get("num_blocks", 4))]
    snap = job(tmp_path, ranges, steps=4, checkpoint_every=2, checkpoint_keep=2, **fields)
    snap = replace(snap, stages=_grouped(snap.stages, ways, "n0000000a"))
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert_matches_reference(snap, metrics(trainer))
    # Checkpoints hold the whole blocks: a run without the split resumes from them.
    tail = replace(snap, steps=6, stages=plans(ranges))
    resumed = Trainer(tail, LocalGroup)
    assert resumed.run() is RunStatus.SUCCEEDED, resumed.report(0).error
    assert_matches_reference(tail, metrics(resumed))


@pytest.mark.unit
def test_a_split_stage_splits_what_has_a_split_and_keeps_the_rest_whole(tmp_path: Path) -> None:
    from shoal.workers.pipeline.stage import Stage
    from shoal.workers.pipeline.stage_types import StageSetup
    from shoal.workers.zoo.data import make_data

    snap = job(tmp_path, [(0, 4)], model=GPT, data=TOKENS, num_blocks=4)
    (plan,) = _grouped(snap.stages, 2, "n0000000a")
    meta = make_data(snap.data, snap.seed, ()).meta
    stage = Stage(plan, StageSetup.of(snap, meta))
    kinds = [isinstance(b, TensorBlock) for b in stage.blocks]
    assert kinds == [False, True, True, True]  # the embedding has no split
    with pytest.raises(ValueError, match="not built"):
        Stage(plan, replace(StageSetup.of(snap, meta), shard="gradients"))


@pytest.mark.integration
def test_a_tensor_parallel_worker_takes_its_groups_devices_on_ray(
    ray_address: str, tmp_path: Path
) -> None:
    """On Ray the worker of a tensor group (launched asking one device resource for each
    of its devices) trains as the reference does."""
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    snap = job(tmp_path, [(0, 4)], steps=3, checkpoint_every=3, checkpoint_keep=1)
    snap = replace(snap, stages=_grouped(plans([(0, 4)], node), 2, node))
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert_matches_reference(snap, metrics(trainer))
    assert sorted(final_states(snap)) == [0, 1, 2, 3]


@pytest.mark.unit
def test_recovery_plans_on_the_survivors_whole_tensor_groups(tmp_path: Path) -> None:
    """A lost worker takes its whole group: the survivors' groups are planned again as
    groups, and each survivor keeps the group it holds."""
    node = "n0000000a"
    devices = [Device(f"{node[:8]}-cpu-{i}", node, i, "cpu", 2048, False) for i in range(4)]
    snap = job(tmp_path, [(0, 2), (2, 4)])
    snap = replace(snap, stages=stage_plans(devices, [(0, 2), (2, 4)], 2))
    assert snap.tensor == 2 and snap.workload().tensor == 2
    layout = Layout(snap.stages, (snap.micro_batches,))
    for alive, group in (([0], devices[:2]), ([1], devices[2:])):
        new, keep = plan_survivors(snap, layout, alive, {})
        assert [p.group for p in new.plans] == [tuple(group)], new.plans
        assert new.plans[0].blocks == (0, 4) and keep == {0: alive[0]}


@pytest.mark.unit
@settings(max_examples=4, deadline=None)
@given(
    model=st.sampled_from(["mlp", "gpt"]),
    cut=st.sampled_from([((0, 4),), ((0, 2), (2, 4))]),
    moved_at=st.sampled_from([10, 25, 40]),
    after=st.integers(1, 2),
)
def test_split_runs_stay_within_tolerance_over_50_steps_across_moves_and_repeat_bitwise(
    tmp_path_factory: pytest.TempPathFactory,
    model: str,
    cut: tuple[tuple[int, int], ...],
    moved_at: int,
    after: int,
) -> None:
    """A run split 2 ways, checkpointed at ``moved_at`` and resumed on one stage split
    ``after`` ways (1: whole), stays within the DESIGN tolerance of the reference for 50
    steps; the same split run again gives bitwise the same state. (2 ways: the test GPT
    has 2 heads, the test MLP 2 outputs.)"""
    fields: dict[str, Any] = {"model": GPT, "data": TOKENS} if model == "gpt" else {}
    ways = 2
    node = "n0000000a"
    devices = [Device(f"{node[:8]}-cpu-{i}", node, i, "cpu", 2048, False) for i in range(6)]

    def split(root: Path, steps: int, ranges: tuple[tuple[int, int], ...], n: int) -> Trainer:
        snap = job(root, ranges, steps=steps, checkpoint_every=moved_at, checkpoint_keep=2)
        snap = replace(snap, **fields, stages=stage_plans(devices[: len(ranges) * n], ranges, n))
        trainer = Trainer(snap, LocalGroup)
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        return trainer

    first, again = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("again")
    before = split(first, moved_at, cut, ways)
    states = final_states(before.snapshot)
    assert_bitwise_equal(states, final_states(split(again, moved_at, cut, ways).snapshot))
    resumed = split(first, 50, ((0, 4),), after)
    assert_matches_reference(resumed.snapshot, metrics(before) + metrics(resumed))
