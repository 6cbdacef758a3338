"""Once Ray has found a device's node gone for ``shard_pool.NODE_CHECK_S``, a RayPool call
of that device's worker that never ended ends ``HostLost``, and a call waiting on another
worker's queue for that device's outputs ends ``InputLost``, so that worker's later calls
run."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import ray

from shoal.workers import launch
from shoal.workers.sharp import shard_pool
from shoal.workers.sharp.shard_pool import (
    Call,
    HostLost,
    InputLost,
    PoolTimeout,
    RayPool,
    await_all,
)
from shoal.workers.sharp.shard_worker import ShardFailed
from tests.workers.sharp.test_sharp_runner import devices

KEY = ("a", 0)


@ray.remote(num_cpus=0)
def _late(seconds: float) -> list[object]:
    """A task's inputs, ``seconds`` late."""
    time.sleep(seconds)
    return []


def lost_then_input_lost(
    pool: RayPool, lost: Call, why: str, then: Callable[[], None], taker: Call, ping: Call
) -> None:
    """``lost`` ends ``HostLost`` saying ``why``; after ``then``, ``taker`` (waiting on
    another worker's queue for the lost device's outputs) ends ``InputLost``, and ``ping``,
    queued behind it there, runs."""
    assert pool.wait([lost], 30.0) == [lost]
    with pytest.raises(HostLost, match=why):
        pool.result(lost)
    then()
    assert pool.wait([taker], 30.0) == [taker]
    with pytest.raises(InputLost):
        pool.result(taker)
    (pid,) = await_all(pool, [ping], 30.0)
    assert isinstance(pid, int)


@pytest.mark.integration
def test_the_calls_of_a_gone_node_and_those_waiting_for_its_outputs_end(
    ray_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = ray.get_runtime_context().get_node_id()
    pool_devices = devices(node)
    pool = RayPool(pool_devices, {d.id: 2**30 for d in pool_devices})
    inputs = _late.remote(60.0)
    try:
        # Device 0's first task waits a minute for its inputs, so the outputs of the forward
        # queued behind it do not come: device 1's task taking them waits on its worker's
        # queue, and that worker's next call behind it.
        blocker = pool.submit(0, "forward", KEY, inputs)
        made = pool.submit(0, "forward", KEY, [])
        taker = pool.submit(1, "forward", KEY, pool.outputs(made))
        ping = pool.submit(1, "pid")
        with pytest.raises(PoolTimeout):  # the node is alive: they wait
            pool.wait([blocker, taker, ping], 3.0)
        monkeypatch.setattr(shard_pool, "NODE_CHECK_S", 0.5)
        gone = {node}  # Ray lists the node dead (both devices' here: the pool asks for 0's)
        monkeypatch.setattr(launch, "alive_nodes", lambda: {node} - gone)
        lost_then_input_lost(pool, blocker, "its node is gone", gone.clear, taker, ping)
    finally:
        pool.shutdown()
        ray.cancel(inputs, force=True)


@pytest.mark.integration
def test_a_hand_over_after_a_call_that_failed_or_never_ran_ends_as_that_call_did(
    ray_address: str,
) -> None:
    """``RayPool.submit_after``: a hand-over beside the tasks runs once the call it follows
    has ended; after one that failed it ends with that call's error, and after one that
    never ran (cancelled, as a call waiting for a lost device's outputs is) ``InputLost``,
    each at once, not after its 60 s timeout, and the worker's next hand-over runs."""
    node = ray.get_runtime_context().get_node_id()
    pool_devices = devices(node)
    pool = RayPool(pool_devices, {d.id: 2**30 for d in pool_devices})
    inputs = _late.remote(60.0)
    try:
        failed = pool.submit(0, "copy", KEY, 1, 1)  # no shard is held: it fails
        blocker = pool.submit(1, "forward", KEY, inputs)  # its inputs come in a minute
        never = pool.submit(1, "copy", KEY, 1, 2)  # queued behind it, then cancelled
        ray.cancel(never.ref)  # type: ignore[attr-defined]
        hands = [
            pool.submit_after(0, failed, "copied", KEY, 1, 60.0),
            pool.submit_after(1, never, "copied", KEY, 2, 60.0),
        ]
        with pytest.raises(ShardFailed) as first:
            await_all(pool, hands[:1], 20.0)
        assert first.value.method == "copy", first.value
        with pytest.raises(InputLost):
            await_all(pool, hands[1:], 20.0)
        after = pool.submit_after(0, pool.submit(0, "pid"), "copied", KEY, 3, 60.0)
        with pytest.raises(ShardFailed) as ran:  # it ran, and found no copy started
            await_all(pool, [after], 20.0)
        assert ran.value.method == "copied" and "not started" in ran.value.reason
        assert blocker not in pool.wait([blocker, after], 0.1)
    finally:
        pool.shutdown()
        ray.cancel(inputs, force=True)


@pytest.mark.integration
def test_a_device_given_up_ends_its_calls_and_those_waiting_for_its_outputs(
    ray_address: str,
) -> None:
    """``RayPool.give_up`` (a worker hung in a call: ``scheduler.silence``): the device's
    calls end ``HostLost`` with the reason at once, its worker is stopped, so a call on
    another worker's queue waiting for its outputs ends ``InputLost`` and that worker's
    next call runs."""
    node = ray.get_runtime_context().get_node_id()
    pool_devices = devices(node)
    pool = RayPool(pool_devices, {d.id: 2**30 for d in pool_devices})
    inputs = _late.remote(60.0)
    try:
        hung = pool.submit(0, "forward", KEY, inputs)  # as if hung: a minute before it runs
        made = pool.submit(0, "forward", KEY, [])
        taker = pool.submit(1, "forward", KEY, pool.outputs(made))
        ping = pool.submit(1, "pid")
        with pytest.raises(PoolTimeout):
            pool.wait([hung, taker, ping], 2.0)
        pool.give_up(0, "none of its calls ended for 2 s: its worker hangs")
        assert pool.wait([hung, taker], 30.0) == [hung]  # at once
        lost_then_input_lost(pool, hung, "its worker hangs", lambda: None, taker, ping)
    finally:
        pool.shutdown()
        ray.cancel(inputs, force=True)
