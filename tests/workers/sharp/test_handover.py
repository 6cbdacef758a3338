"""A SHARP shard handed from one host to another between two of its model's tasks (a trade
of places): the model trains on there exactly as it would have where it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.scheduler.sharp import ModelPlan, Op, Shard
from shoal.workers.pipeline.stage_types import StageSetup, StageStateError
from shoal.workers.sharp.shard_host import ShardHost
from shoal.workers.sharp.shard_types import Handover, Inputs, Stashed
from shoal.workers.wire import Wire, receive_tree, send
from shoal.workers.zoo.data import make_data
from tests.workers.sharp.test_sharp_runner import devices, model

SHARDS = ((0, 2), (2, 4), (4, 6))
STEPS = 2


def train(
    root: Path, recompute: bool, hand_over_at: int | None
) -> tuple[list[float], dict[int, Any]]:
    """A three-shard model's losses and final block states, trained on one host, or moved
    to a second one before the task at chain position ``hand_over_at``. Each task's
    outputs stay on its host for the next (``keep``), so a hand-over carries them along."""
    snap = model(root, "a", recompute=recompute)
    data = make_data(snap.data, snap.seed)
    setup = StageSetup.of(snap, data.meta)
    plan = ModelPlan("a", tuple(Shard(i, b, 1.0, 2.0, 1, 1) for i, b in enumerate(SHARDS)), STEPS)
    here, there = (ShardHost(d, 2**40) for d in devices())
    for i, blocks in enumerate(SHARDS):
        here.add(("a", i), setup, blocks, 0)
    rows = snap.batch_size // snap.micro_batches
    scale = rows / snap.batch_size
    k, losses = len(SHARDS), []
    carry: Inputs = []
    targets: list[Wire] = []
    for position in range(plan.tasks):
        task = plan.task(position)
        if position == hand_over_at:
            stashed = position if isinstance(carry, Stashed) else None
            owner = plan.shard_at(position).index  # the shard whose task takes the stash
            for i, blocks in enumerate(SHARDS):
                handover, sent = here.give(("a", i), stashed if i == owner else None)
                assert sent > 0
                loss = targets if i == k - 1 else None
                there.take(("a", i), setup, blocks, 0, handover, loss, scale)
                # Its forwards ran again on the device, unless its backward recomputes them.
                ran = bool(handover.inputs) and not recompute
                assert (("a", i) in there.held()["resident"]) == ran, (position, i)
            assert here.held()["shards"] == [] and here.held()["stash_bytes"] == 0
            here = there
        key = ("a", task.shard)
        passes = task.shard > 0 if task.op is Op.BACKWARD else task.shard < k - 1
        keep = position + 1 if passes else None
        if task.op is Op.FORWARD:
            if task.shard == 0:
                x, y = data.batch(task.step, snap.batch_size)
                carry = [send(x[j * rows : (j + 1) * rows]) for j in range(snap.micro_batches)]
                targets = [send(y[j * rows : (j + 1) * rows]) for j in range(snap.micro_batches)]
            last = task.shard == k - 1
            _, result = here.forward(key, carry, targets if last else None, scale, None, keep)
            losses += result.losses
        else:
            grads = [None] * snap.micro_batches if task.shard == k - 1 else carry
            here.backward(key, grads, None, keep)
        carry = Stashed(keep) if keep is not None else []
    states: dict[int, Any] = {}
    for i in range(k):
        here.copy(("a", i), snap.steps, 1)
        states.update(receive_tree(here.copied(("a", i), 1, 10.0)[0], torch.device("cpu")))
    return losses, states


@pytest.mark.unit
@pytest.mark.parametrize("recompute", [False, True])
def test_a_model_handed_over_before_any_of_its_tasks_trains_on_exactly(
    tmp_path: Path, recompute: bool
) -> None:
    """Before every task of a step (forward or backward, shards with their graphs waiting
    for a backward, outputs kept for the next task), and at the step boundary: the losses
    and final states are bitwise those of the model trained on one host. A shard's open
    forwards run again where it goes, or with recompute only their inputs go (with the
    RNG states they ran under): its backward recomputes them anyway."""
    losses, states = train(tmp_path, recompute, None)
    for position in range(1, 2 * len(SHARDS) + 1):
        moved_losses, moved = train(tmp_path, recompute, position)
        assert moved_losses == losses, position
        for block, state in states.items():
            for name, expected in state["module"].items():
                assert torch.equal(moved[block]["module"][name], expected), (position, name)
            assert str(moved[block]["optimizer"]) == str(state["optimizer"]), position


@pytest.mark.unit
def test_a_last_shard_handed_over_between_its_loss_and_its_backward_needs_the_targets(
    tmp_path: Path,
) -> None:
    """Its forward runs again from the losses' targets, which the executor holds: without
    them the host says so instead of running a different forward."""
    snap = model(tmp_path, "a")
    data = make_data(snap.data, snap.seed)
    setup = StageSetup.of(snap, data.meta)
    handover = Handover({}, {0: send(torch.zeros(4, 16))}, True, None, {})
    host = ShardHost(devices()[1], 2**40)
    with pytest.raises(StageStateError, match="mid-loss without its targets"):
        host.take(("a", 2), setup, (4, 6), 0, handover)


@pytest.mark.unit
def test_a_hand_over_of_outputs_the_host_does_not_keep_is_refused(tmp_path: Path) -> None:
    """Named outputs that are not there are an error, not an empty input for the task."""
    snap = model(tmp_path, "a")
    setup = StageSetup.of(snap, make_data(snap.data, snap.seed).meta)
    host = ShardHost(devices()[0], 2**40)
    host.add(("a", 1), setup, (2, 4), 0)
    with pytest.raises(StageStateError, match=r"no outputs are kept .* for task 1 of model a"):
        host.give(("a", 1), 1)
    assert host.held()["shards"] == [("a", 1)]  # still held: nothing half-done
