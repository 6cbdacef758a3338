"""A SHARP host's copy of a shard is started on its task queue and made beside the tasks
after it (``ShardHost.copy``, ``ShardHost.copied``): it is the shard's state at the call,
whatever ran meanwhile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.workers.pipeline.stage_types import StageSetup, StageStateError
from shoal.workers.sharp.shard_host import ShardHost
from shoal.workers.sharp.shard_pool import LocalPool, await_all
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.wire import receive_tree, send
from shoal.workers.zoo.data import make_data
from tests.workers.runs import assert_bitwise_equal
from tests.workers.sharp.test_sharp_runner import devices, model

KEY = ("a", 0)


class OneShard:
    """A model held whole as one shard on its own host, trained a step at a time."""

    def __init__(self, root: Path) -> None:
        self.snap = model(root, "a")
        self.data = make_data(self.snap.data, self.snap.seed)
        self.host = ShardHost(devices()[0], 2**40)
        setup = StageSetup.of(self.snap, self.data.meta)
        self.host.add(KEY, setup, (0, self.snap.num_blocks), 0)
        self.steps = 0

    def step(self) -> None:
        snap = self.snap
        rows = snap.batch_size // snap.micro_batches
        x, y = self.data.batch(self.steps, snap.batch_size)
        cut = [slice(j * rows, (j + 1) * rows) for j in range(snap.micro_batches)]
        self.host.forward(KEY, [send(x[c]) for c in cut], [send(y[c]) for c in cut], 1 / 2)
        self.host.backward(KEY, [None] * snap.micro_batches)
        self.steps += 1

    def copy(self, number: int) -> dict[int, Any]:
        self.host.copy(KEY, self.steps, number)
        states, _, _ = self.host.copied(KEY, number, 10.0)
        return {i: receive_tree(s, torch.device("cpu")) for i, s in states.items()}


@pytest.mark.unit
def test_a_copy_is_the_state_at_its_call_though_the_next_step_ran_before_it_was_handed_over(
    tmp_path: Path,
) -> None:
    ahead, reference = OneShard(tmp_path / "ahead"), OneShard(tmp_path / "reference")
    for run in (ahead, reference):
        run.step()
    ahead.host.copy(KEY, 1, 1)
    ahead.step()  # its optimizer step waits for the copy: the copy holds step 1's state
    states, seconds, _ = ahead.host.copied(KEY, 1, 10.0)
    at_one = {i: receive_tree(s, torch.device("cpu")) for i, s in states.items()}
    assert_bitwise_equal(at_one, reference.copy(1))
    assert seconds > 0.0  # a CPU device: the copying thread's time is the device's
    reference.step()
    at_two = ahead.copy(2)
    assert_bitwise_equal(at_two, reference.copy(2))
    with pytest.raises(AssertionError):  # the copies differ: the test can tell them apart
        assert_bitwise_equal(at_one, at_two)


@pytest.mark.unit
def test_a_hand_over_takes_the_copy_its_call_started_and_one_never_started_says_why(
    tmp_path: Path,
) -> None:
    """``copied`` runs once the call that was to start its copy has ended (the pool's
    ``submit_after``), so a copy not started by then never will be: it says so at once, not
    after its timeout, which would hold every later hand-over of the host."""
    run = OneShard(tmp_path)
    run.step()
    asked = time.monotonic()
    with pytest.raises(LookupError, match=r"copy 1 of shard .* was not started"):
        run.host.copied(KEY, 1, 60.0)
    assert time.monotonic() - asked < 5.0
    run.host.copy(KEY, 1, 1)
    states, _, _ = run.host.copied(KEY, 1, 60.0)
    assert set(states) == set(range(run.snap.num_blocks))
    with pytest.raises(StageStateError, match="not held"):
        run.host.copy(("b", 0), 1, 2)
    with pytest.raises(LookupError, match="was not started"):
        run.host.copied(("b", 0), 2, 60.0)


@pytest.mark.unit
def test_a_hand_over_after_a_call_that_failed_ends_with_its_error_and_the_next_one_runs() -> None:
    """``LocalPool.submit_after``: a hand-over after a call that failed does not run and
    ends with that call's error at once (not after its 60 s timeout), and the host's next
    hand-over beside the tasks runs."""
    pool = LocalPool(devices(), dict.fromkeys([d.id for d in devices()], 2**30))
    try:
        failed = pool.submit(0, "copy", KEY, 1, 1)  # no shard is held: it fails
        hand = pool.submit_after(0, failed, "copied", KEY, 1, 60.0)
        with pytest.raises(ShardFailed) as first:
            await_all(pool, [hand], 10.0)
        assert first.value.method == "copy", first.value
        after = pool.submit_after(0, pool.submit(0, "pid"), "copied", KEY, 2, 60.0)
        with pytest.raises(ShardFailed) as second:  # it ran, and found no copy started
            await_all(pool, [after], 10.0)
        assert second.value.method == "copied" and "not started" in second.value.reason
    finally:
        pool.shutdown()
