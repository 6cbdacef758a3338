"""Sharded replicas (ZeRO-1, ZeRO-2): each replica keeps its slice of every block's optimizer
state (and of the summed gradients), and the replicas train as whole ones do."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.scheduler.memory import replica_state_bytes
from shoal.scheduler.profile import BlockCost
from shoal.workers.blocks import Block, map_tensors, tensors_in
from shoal.workers.pipeline.collective import GlooCollective
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.local_ranks import run_ranks
from shoal.workers.pipeline.pieces import whole_states
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.sharding import StageShards, slice_of
from shoal.workers.snapshot import OptimizerConf, RunStatus
from tests.factories import ADAM, SGD, dp_plans, job
from tests.workers.runs import (
    assert_matches_reference,
    assert_same_state,
    final_states,
    metrics,
)


@pytest.mark.unit
def test_slices_cover_a_block_once_and_differ_by_at_most_one_value() -> None:
    for numel in (0, 1, 5, 16, 1001):
        for world in (1, 2, 3, 7):
            cuts = [slice_of(numel, r, world) for r in range(world)]
            assert cuts[0][0] == 0 and cuts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
            sizes = [hi - lo for lo, hi in cuts]
            assert max(sizes) - min(sizes) <= 1


def _blocks(conf: OptimizerConf) -> list[Block]:
    torch.manual_seed(0)  # identical parameters on every replica, as in training
    modules = [nn.Sequential(nn.Linear(13, 7), nn.ReLU()), nn.Linear(7, 3)]
    return [Block(i, m, conf) for i, m in enumerate(modules)]


def _backward(blocks: list[Block], rank: int, step: int) -> None:
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(100 * step + rank))
    for block in blocks:
        x = block.module(x)
    x.square().sum().backward()


def _ranks(world: int, body: Callable[[GlooCollective, int], Any]) -> list[Any]:
    """``body(collective, rank)`` on every rank of one gloo group, a thread each."""
    results = run_ranks(world, body, timeout_s=30, name="stage-0")
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results


@pytest.mark.unit
@settings(max_examples=6, deadline=None)
@given(
    world=st.integers(2, 4),
    mode=st.sampled_from(["optimizer", "gradients"]),
    conf=st.sampled_from([ADAM, SGD, OptimizerConf("adamw", 0.02, {"weight_decay": 0.1})]),
    unshard_at=st.integers(0, 4),
)
def test_sharded_updates_equal_whole_replicas_and_unshard_gives_the_whole_state_back(
    world: int, mode: str, conf: OptimizerConf, unshard_at: int
) -> None:
    """Six steps, unsharded after step ``unshard_at`` and sharded again, then one step of
    the blocks' own optimizers: every replica ends with the parameters and optimizer state
    of plain data parallelism, bitwise (the sums are the same replica-order fold and the
    updates element-wise), holding meanwhile 1/R of the optimizer state. The replicas'
    in-memory copies of their shares at step ``unshard_at`` make, merged, the whole
    replica's state of that step, bitwise."""

    # Built here: the ranks' threads would share torch's global generator.
    built = [(_blocks(conf), _blocks(conf)) for _ in range(world)]

    def body(collective: GlooCollective, rank: int) -> tuple[list[Block], list[Block], Any]:
        whole, sharded = built[rank]
        shards: StageShards | None = None
        share, copied, then = 1.0, {}, {}
        for step in range(6):
            _backward(whole, rank, step)
            collective.all_reduce(whole)
            for block in whole:
                block.step()
            _backward(sharded, rank, step)
            shards = shards or StageShards(sharded, mode, collective)
            if mode == "gradients":
                shards.reduce_scatter(collective)
                norms = shards.grad_norms(collective)
                assert len(norms) == 4 and bool((norms > 0).all())
            else:
                collective.all_reduce(sharded)
            shards.update(None)
            shards.gather(collective)
            if step == unshard_at:
                copied = {s.index: map_tensors(s.live_state(), torch.clone) for s in shards.shards}
                # A copy holds this replica's slice of the optimizer state, no more of it.
                sliced = [t for c in copied.values() for t in tensors_in(c["slice"]["state"])]
                assert sum(t.nbytes for t in sliced) == shards.nbytes()
                then = {b.index: b.state() for b in whole}
                share = shards.nbytes() / sum(b.nbytes() for b in whole)
                # The blocks keep their parameters alone, the slices no copy of them.
                params = sum(p.numel() for b in sharded for p in b.module.parameters())
                assert sum(b.nbytes() for b in sharded) == 4 * params
                shards.unshard(collective)
                shards = None
        assert shards is not None
        shards.unshard(collective)
        for blocks in (whole, sharded):  # whole again: a step of the blocks' own optimizers
            _backward(blocks, rank, 6)
            collective.all_reduce(blocks)
            for block in blocks:
                block.step()
        return whole, sharded, (share, copied, then)

    ranks = _ranks(world, body)
    merged = whole_states([copied for _, _, (_, copied, _) in ranks])
    assert_same_state(merged, ranks[0][2][2])
    # Together the replicas' copies hold each parameter once: a slice each.
    sliced = sum(
        c["slice"]["values"].nbytes for *_, (_, copied, _) in ranks for c in copied.values()
    )
    assert sliced == sum(p.nbytes for b in ranks[0][0] for p in b.module.parameters())
    for whole, sharded, (share, _, _) in ranks:
        for a, b in zip(whole, sharded, strict=True):
            for x, y in zip(a.module.parameters(), b.module.parameters(), strict=True):
                assert torch.equal(x, y)
            expected, got = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
            assert expected.keys() == got.keys()
            for i, entry in expected.items():
                for key, value in entry.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(got[i][key]))
        params = sum(p.numel() for b in whole for p in b.module.parameters())
        states = sum(
            torch.as_tensor(v).numel()
            for b in whole
            for entry in b.optimizer.state.values()
            for v in entry.values()
            if torch.as_tensor(v).dim() > 0
        )
        full = states / (params + states)  # the optimizer state's share of a whole replica
        assert share == pytest.approx(full / world, rel=0.15), (share, full)


# ------------------------------------------------------------------------------ on Ray


@pytest.fixture
def node(ray_address: str) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


pytest_ray = pytest.mark.integration


class MeasureHeld(RayGroup):
    """A RayGroup that asks every worker for the bytes it holds (``Stage.nbytes``) right
    after its ``at``-th step call, before anything else reaches it."""

    def __init__(self, at: int, *args: Any) -> None:
        self.at, self.calls = at, 0
        self.held: list[Any] = []
        super().__init__(*args)

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        handle = super().submit(stage, method, *args)
        if method in ("step", "steps") and stage == len(self._plans) - 1:
            self.calls += 1
            if self.calls == self.at:
                self.held = [RayGroup.submit(self, w, "nbytes") for w in range(len(self._plans))]
            elif self.calls == self.at + 1:
                self.held = self.get(self.held, 60)
        return handle


@pytest_ray
@pytest.mark.parametrize("mode", ["optimizer", "gradients", "full"])
def test_sharded_replicas_train_as_the_single_process_reference(
    node: str, tmp_path: Path, mode: str
) -> None:
    """2 replicas x 2 stages, gradient clipping on: the losses, gradient norms and final
    parameters equal one process's within the DESIGN tolerance, and a checkpoint written
    sharded holds the whole state: the reference's. Between steps each worker holds what
    ``scheduler.memory.replica_state_bytes`` predicts for its mode (within 10%)."""
    snap = job(
        tmp_path,
        [],
        stages=dp_plans([(0, 2), (2, 4)], 2, node),
        replicas=2,
        micro_batches=4,
        steps=6,
        shard=mode,
        optimizer=replace(ADAM, clip_grad_norm=0.5),
        checkpoint_every=3,
        checkpoint_keep=2,
    )
    groups: list[MeasureHeld] = []

    def make(plans: Any, setup: Any) -> MeasureHeld:
        groups.append(MeasureHeld(2, plans, setup))
        return groups[-1]

    trainer = Trainer(snap, make)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert all(t.allreduce_s > 0 for m in metrics(trainer) for t in m.stages)
    assert_matches_reference(snap, metrics(trainer))
    states = final_states(snap)

    def cost(index: int) -> BlockCost:
        def size(tensors: Any) -> int:
            return sum(t.nbytes for t in tensors_in(tensors))

        state = states[index]
        return BlockCost(index, 1.0, size(state["module"]), size(state["optimizer"]["state"]), 0)

    for plan, held in zip(snap.stages, groups[0].held, strict=True):
        predicted = replica_state_bytes([cost(i) for i in range(*plan.blocks)], 2, mode)
        assert held == pytest.approx(predicted, rel=0.1), (plan, held, predicted)


@pytest_ray
def test_a_checkpoint_moves_between_sharded_and_whole_replicas(node: str, tmp_path: Path) -> None:
    """Three steps in each mode in turn, each resumed from the checkpoint the last one
    wrote: ZeRO-3 to ZeRO-2, sharded to whole, whole to sharded (ZeRO-1). After every move
    the run equals one process's."""
    fields: dict[str, Any] = {
        "stages": dp_plans([(0, 2), (2, 4)], 2, node),
        "replicas": 2,
        "micro_batches": 4,
        "checkpoint_every": 3,
        "checkpoint_keep": 2,
    }
    snap = job(tmp_path, [], steps=3, shard="full", **fields)
    assert Trainer(snap, RayGroup).run() is RunStatus.SUCCEEDED
    for shard in ("gradients", "none", "optimizer"):
        snap = replace(snap, steps=snap.steps + 3, shard=shard)
        trainer = Trainer(snap, RayGroup)
        assert trainer.run() is RunStatus.SUCCEEDED, (shard, trainer.report(0).error)
        assert [e.kind for e in trainer.report(0).events].count("resumed") == 1, shard
        assert_matches_reference(snap, metrics(trainer))


@pytest_ray
@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_sharded_replicas_relayout_into_a_pipeline_as_whole_ones_do(
    node: str, tmp_path: Path, mode: str
) -> None:
    """2 sharded replicas x 2 stages, then one 2-stage pipeline after step 1: every replica
    gives its blocks their whole state back before the move, and the run equals the same
    moves made in-process with whole replicas."""
    fields: dict[str, Any] = {"replicas": 2, "micro_batches": 4, "steps": 3}

    def run(root: Path, make: Any, shard: str, where: str | None) -> Trainer:
        stages = dp_plans([(0, 2), (2, 4)], 2, *([where] if where else []))
        trainer = Trainer(job(root, [], stages=stages, shard=shard, **fields), make)
        trainer.relayout([replace(p, replica=0) for p in stages[2:]], (4,))
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        return trainer

    sharded = run(tmp_path / "ray", RayGroup, mode, node)
    whole = run(tmp_path / "local", LocalGroup, "none", None)
    assert [e.kind for e in sharded.report(0).events].count("relayout") == 1
    losses = [m.loss for m in metrics(sharded)]
    assert losses == pytest.approx([m.loss for m in metrics(whole)], rel=1e-5, abs=1e-6)
    snap = job(tmp_path / "ray", [], **fields)
    ours, theirs = (
        final_states(snap),
        final_states(replace(snap, checkpoint_root=str(tmp_path / "local"))),
    )
    for i, state in theirs.items():
        for name, tensor in state["module"].items():
            assert torch.allclose(ours[i]["module"][name], tensor, rtol=1e-5, atol=1e-6)


class KillReplica(RayGroup):
    """A RayGroup whose worker at position ``victim`` is killed (SIGKILL, as a lost node's
    process ends) once worker 0 was handed its ``after``-th step call; it records the
    rollbacks that were given other replicas' slices, and where slices were fetched."""

    def __init__(self, victim: int, after: int, *args: Any) -> None:
        self.victim, self.after, self.calls = victim, after, 0
        self.merged: list[int] = []
        self.fetched: set[str] = set()
        super().__init__(*args)
        self.pids = self.get([self.submit(w, "pid") for w in range(len(self._plans))], 60)

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        handle = super().submit(stage, method, *args)
        if method == "rollback" and len(args) > 1:
            self.merged.append(stage)
        if method == "export_copy":  # from a survivor's own copy, or one held for another
            self.fetched.add("own" if args[0] is None else "held")
        if method in ("step", "steps") and stage == 0:
            self.calls += 1
            if self.calls == self.after:
                os.kill(self.pids[self.victim], signal.SIGKILL)
        return handle


@pytest_ray
@pytest.mark.parametrize(
    ("mode", "ranges", "replicas", "victim", "merged"),
    [
        ("gradients", [(0, 4)], 3, 1, [0, 2]),
        ("optimizer", [(0, 2), (2, 4)], 2, 3, [0, 1, 2]),
        ("full", [(0, 4)], 3, 2, [0, 1]),
    ],
    ids=["3-replicas", "2x2-pipeline", "zero3"],
)
def test_a_lost_sharded_replica_is_recovered_in_place_from_the_replicas_copies(
    node: str,
    tmp_path: Path,
    mode: str,
    ranges: list[tuple[int, int]],
    replicas: int,
    victim: int,
    merged: list[int],
) -> None:
    """Sharded replicas (ZeRO-2 over 3 replicas of one stage; ZeRO-1 over 2 replicas of a
    2-stage pipeline) with Adam, a copy at every step: the worker at ``victim`` is killed
    mid-run. Each copy held one slice per block, so every survivor of a sharded stage
    rolls back with the other slices (a lost replica's from the copy its buddy held, a
    surviving one's from that replica's own copy), the blocks are re-cut over the devices
    left and the run ends as one process's. At most the steps the runner says it may
    replay are (the lost worker's latest copy may not have reached its buddy: then the
    copy before)."""
    snap = job(
        tmp_path,
        [],
        stages=dp_plans(ranges, replicas, node),
        replicas=replicas,
        batch_size=4 * replicas,
        micro_batches=2 * replicas,
        steps=8,
        shard=mode,
        keep_copies=True,
        copy_budget=1.0,
    )
    groups: list[KillReplica] = []

    def make(plans: Any, setup: Any) -> KillReplica:
        groups.append(KillReplica(victim, 4, plans, setup))
        return groups[-1]

    trainer = Trainer(snap, make)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    events = trainer.report(0).events
    lost = [e for e in events if e.kind == "device_lost"]
    assert [e.data["devices"] for e in lost] == [[snap.stages[victim].device.id]], events
    assert lost[0].data["steps_replayed"] <= lost[0].data["most_replayed"], lost[0].data
    assert sorted(groups[0].merged) == merged, groups[0].merged
    assert groups[0].fetched == {"own", "held"}, groups[0].fetched
    latest = {m.step: m for m in metrics(trainer)}
    assert sorted(latest) == list(range(1, 9))
    assert_matches_reference(snap, [latest[s] for s in range(1, 9)])
