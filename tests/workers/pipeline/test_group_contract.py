"""One contract, two worker groups: the same tests run in-process and on Ray actors."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.scheduler.types import BlockRange
from shoal.workers.pipeline.batch_rows import Rows
from shoal.workers.pipeline.clipping import clip_coefficient
from shoal.workers.pipeline.group import NEW_NODE_S, RayGroup
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.recovery import survey
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import MOOT, StageFailed
from shoal.workers.pipeline.worker_group import (
    DeviceSetAside,
    GroupFactory,
    GroupTimeout,
    Handle,
    StageLost,
    WorkerGroup,
)
from shoal.workers.reference import train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf, StagePlan
from shoal.workers.wire import Bits, send
from shoal.workers.zoo.data import make_data

MODEL = ModelRef("mlp", None, {"hidden": 16, "layers": 3})
DATA = DataRef("synthetic-regression", None, {"features": 8, "outputs": 2})
OPTIMIZER = OptimizerConf("adam", 0.01)
SEED = 7
BLOCKS = 4

MakeGroup = Callable[..., WorkerGroup]
States = dict[int, dict[str, Any]]


@pytest.fixture(
    params=[
        pytest.param("local", marks=pytest.mark.unit),
        pytest.param("ray", marks=pytest.mark.integration),
    ]
)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_address")
    return str(request.param)


@pytest.fixture
def node_id(kind: str) -> str:
    if kind == "local":
        return "n0000000a"
    import ray

    return str(ray.get_runtime_context().get_node_id())


@pytest.fixture
def setup() -> StageSetup:
    meta = make_data(DATA, SEED).meta
    return StageSetup(MODEL, meta, OPTIMIZER, SEED, BLOCKS, data=DATA, batch_size=2)


@pytest.fixture
def make_group(kind: str, node_id: str) -> Iterator[MakeGroup]:
    factory: GroupFactory = LocalGroup if kind == "local" else RayGroup
    groups: list[WorkerGroup] = []

    def make(ranges: list[BlockRange], setup: StageSetup, *, slowdown: float = 1.0) -> WorkerGroup:
        group = factory(plans(ranges, node_id, slowdown), setup)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.shutdown()


def plans(ranges: list[BlockRange], node_id: str, slowdown: float = 1.0) -> list[StagePlan]:
    return [
        StagePlan(
            i,
            r,
            Device(f"{node_id[:8]}-cpu-{i}", node_id, i, "cpu", 2048, False, False, slowdown),
        )
        for i, r in enumerate(ranges)
    ]


def reference_states(
    micro_batches: int, optimizer: OptimizerConf = OPTIMIZER, precision: str = "fp32"
) -> States:
    ref = train_reference(
        MODEL, DATA, optimizer, batch_size=8, micro_batches=micro_batches, steps=1, seed=SEED,
        precision=precision,
    )  # fmt: skip
    return {b.index: b.state() for b in ref.blocks}


def gpipe(group: WorkerGroup, micro_batches: int) -> tuple[list[Handle], list[Handle]]:
    """GPipe by hand on a two-stage group, up to the step: stage 0's outputs go straight to
    stage 1. The handles of stage 0's outputs and of the losses."""
    x, y = make_data(DATA, SEED).batch(0, 8)
    rows = 8 // micro_batches
    part = [slice(j * rows, (j + 1) * rows) for j in range(micro_batches)]
    outs = [group.submit(0, "forward", j, send(x[part[j]])) for j in range(micro_batches)]
    losses = [
        group.submit(1, "forward_loss", j, outs[j], send(y[part[j]]), rows / 8)
        for j in range(micro_batches)
    ]
    grads = [group.submit(1, "backward", j, None) for j in range(micro_batches)]
    firsts = [group.submit(0, "backward", j, grads[j]) for j in range(micro_batches)]
    assert group.get(firsts, 60) == [None] * micro_batches
    return outs, losses


def one_step(group: WorkerGroup, micro_batches: int) -> list[float]:
    """One GPipe step by hand on a two-stage group; the micro-batches' losses."""
    _, losses = gpipe(group, micro_batches)
    group.get([group.submit(s, "apply_step") for s in (0, 1)], 60)
    return list(group.get(losses, 60))


def replicated(ranges: list[BlockRange], node_id: str, replicas: int) -> list[StagePlan]:
    """Replica-major plans: worker ``r * len(ranges) + s`` is stage s of replica r."""
    depth = len(ranges)
    return [
        replace(p, index=p.index % depth, blocks=ranges[p.index % depth], replica=p.index // depth)
        for p in plans(ranges * replicas, node_id)
    ]


def dp_step(group: WorkerGroup, split: list[int]) -> list[float]:
    """One GPipe step by hand on 2 replicas x 2 stages, replica r taking split[r] of the
    4 micro-batches, then each stage's gradients summed over its replicas."""
    x, y = make_data(DATA, SEED).batch(0, 8)
    rows, losses, firsts, offset = 2, [], [], 0
    for r, count in enumerate(split):
        first, last = 2 * r, 2 * r + 1
        part = [slice((offset + j) * rows, (offset + j + 1) * rows) for j in range(count)]
        outs = [group.submit(first, "forward", j, send(x[part[j]])) for j in range(count)]
        losses += [
            group.submit(last, "forward_loss", j, outs[j], send(y[part[j]]), rows / 8)
            for j in range(count)
        ]
        grads = [group.submit(last, "backward", j, None) for j in range(count)]
        firsts += [group.submit(first, "backward", j, grads[j]) for j in range(count)]
        offset += count
    reduces = group.all_reduce([0, 2]) + group.all_reduce([1, 3])
    group.get([*firsts, *reduces], 60)
    group.get([group.submit(w, "apply_step") for w in range(4)], 60)
    return list(group.get(losses, 60))


def assert_same_states(actual: States, expected: States) -> None:
    assert actual.keys() == expected.keys()
    for i in expected:
        for name, tensor in expected[i]["module"].items():
            torch.testing.assert_close(actual[i]["module"][name], tensor, rtol=1e-5, atol=1e-6)


def gather(group: WorkerGroup, stages: int) -> States:
    states: States = {}
    for part in group.get([group.submit(s, "state") for s in range(stages)], 60):
        states.update(part)
    return states


@pytest.mark.parametrize("recompute", [False, True])
def test_two_stages_train_like_one_process(
    make_group: MakeGroup, setup: StageSetup, recompute: bool
) -> None:
    group = make_group([(0, 2), (2, 4)], replace(setup, recompute=recompute))
    losses = one_step(group, micro_batches=2)
    assert len(losses) == 2 and all(v > 0 for v in losses)
    assert_same_states(gather(group, 2), reference_states(micro_batches=2))


def test_blocks_move_between_stages_bit_for_bit_and_train_on(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    """A re-cut between steps, actor to actor: stage 1 hands block 1 to stage 0 (whose
    ``adopt`` takes the export's handle), parameters and Adam state unchanged; the next step
    on the new cut is bitwise the step the old cut would have made."""
    group = make_group([(0, 1), (1, 4)], setup)
    one_step(group, micro_batches=2)
    before = gather(group, 2)
    moved = group.submit(1, "export", [1])
    sizes = group.get(
        [group.submit(0, "adopt", 0, (0, 2), moved), group.submit(1, "adopt", 1, (2, 4))], 60
    )
    assert all(size > 0 for size in sizes)
    after = group.get([group.submit(s, "state") for s in (0, 1)], 60)
    assert sorted(after[0]) == [0, 1] and sorted(after[1]) == [2, 3]
    for i in range(BLOCKS):
        held = after[0] if i < 2 else after[1]
        for name, tensor in before[i]["module"].items():
            assert torch.equal(held[i]["module"][name], tensor), (i, name)
        steps = [s["step"] for s in held[i]["optimizer"]["state"].values()]
        assert all(float(step) == 1.0 for step in steps)
    # The next step on the new cut equals a second step on the old one, bit for bit.
    still = make_group([(0, 1), (1, 4)], setup)
    one_step(still, micro_batches=2)
    assert one_step(group, micro_batches=2) == one_step(still, micro_batches=2)
    moved_on, stayed = gather(group, 2), gather(still, 2)
    for i in range(BLOCKS):
        for name, tensor in stayed[i]["module"].items():
            assert torch.equal(moved_on[i]["module"][name], tensor), (i, name)


def test_a_copy_goes_to_the_buddy_beside_training_as_the_snapshot_state(
    make_group: MakeGroup, setup: StageSetup, kind: str
) -> None:
    """Stage 0 snapshots after a step, ships the copy and stage 1 holds it: the held copy
    is the state the snapshot was of, though stage 0 trains a step more first. On Ray the
    shipping runs beside the training calls: a shipment waiting for a copy that never comes
    holds up none of them, and gives up naming the step."""
    group = make_group([(0, 2), (2, 4)], setup)
    one_step(group, micro_batches=2)
    (state,) = group.get([group.submit(0, "state")], 60)
    group.submit(0, "snapshot", 1, 1)
    shipped = group.submit(0, "shipment", 1, 30.0)
    held = group.submit(1, "hold", "cpu-0", 1, shipped)
    one_step(group, micro_batches=2)
    group.get([held], 60)
    (copy,) = group.get([group.submit(1, "export_copy", "cpu-0", 1, [0, 1])], 60)
    assert_same_states(copy, state)
    if kind == "ray":
        stuck = group.submit(0, "shipment", 2, 10.0)
        started = time.monotonic()
        group.get([group.submit(0, "pid")], 60)
        assert time.monotonic() - started < 8.0  # not after the shipment's 10 s
        with pytest.raises(StageFailed, match="copy 2 did not start within 10 s"):
            group.get([stuck], 60)


@pytest.mark.integration
def test_a_hold_still_waiting_when_a_loss_is_surveyed_gives_up_and_frees_the_copies_behind_it(
    ray_address: str, setup: StageSetup
) -> None:
    """A buddy's hold waits, on the thread beside training, for a copy that does not come
    (as one cut off when its shipper's node is lost mid-transfer). Once the worker is
    surveyed after a loss, the hold gives up, and the copy queued behind it (a recovery's
    fresh one) is held at once, not after the first one's wait."""
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    group = RayGroup(plans([(0, 1), (1, 2), (2, 4)], node), setup)
    try:
        never = group.submit(0, "shipment", 1, 60.0)  # copy 1 of stage 0 is never started
        stale = group.submit(1, "hold", "cpu-0", 0, never)
        group.submit(2, "snapshot", 0, 1)
        fresh = group.submit(1, "hold", "cpu-2", 0, group.submit(2, "shipment", 1, 30.0))
        started = time.monotonic()
        surveys = 0
        while surveys < 20:  # again until the hold has begun before one (it starts at once)
            group.get([group.submit(1, MOOT)], 60)
            surveys += 1
            try:
                group.get([stale], 1.0)
            except GroupTimeout:
                continue
            except StageFailed as exc:
                assert re.search(r"stage 1 failed in hold: gave up .* surveyed", str(exc)), exc
                break
            pytest.fail("the stale hold kept a copy that never came")
        else:
            pytest.fail(f"the stale hold still waited after {surveys} surveys")
        group.get([fresh], 60)
        waited = time.monotonic() - started
        assert waited < 20.0, f"the fresh copy was held {waited:.1f} s later: after the stale"
        (held,) = group.get([group.submit(1, "saved_steps")], 60)
        assert list(held["copies"]) == ["cpu-2"], held
    finally:
        group.shutdown()


@pytest.mark.integration
def test_a_survey_answers_at_once_though_a_training_call_waits_for_a_result_that_never_comes(
    ray_address: str, setup: StageSetup
) -> None:
    """A relayed forward waits for its input (as one cut off when the stage before's node
    is lost mid-transfer), holding its worker's training thread. Told the loss is
    surveyed, the forward gives up, and the worker answers the survey behind it: it is
    not counted lost with the worker it waited for."""
    import ray

    node = str(ray.get_runtime_context().get_node_id())
    stages = plans([(0, 2), (2, 4)], node)
    group = RayGroup(stages, setup)
    try:
        never = group.submit(0, "shipment", 1, 60.0)  # copy 1 of stage 0 is never started
        waiting = group.submit(1, "forward", 0, never)
        started = time.monotonic()
        for _ in range(4):  # again until the forward had begun before one (it starts at once)
            answers = survey(group, Layout(tuple(stages), (2,)), timeout=5.0)
            if sorted(answers) == [0, 1]:
                break
        waited = time.monotonic() - started
        assert sorted(answers) == [0, 1], f"answered: {sorted(answers)} in {waited:.1f} s"
        with pytest.raises(StageFailed, match=r"stage 1 failed in forward: gave up .* surveyed"):
            group.get([waiting], 60)
    finally:
        group.shutdown()


def test_a_stage_whose_step_failed_takes_no_copy_until_its_blocks_are_restored(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    """A copy handed out behind a step call (the runner queues it there) must not label a
    failed step's leftovers as that step's state: it is refused, and its shipment gives
    up at once rather than wait out its timeout."""
    group = make_group([(0, 4)], setup)
    (state,) = group.get([group.submit(0, "state")], 60)
    past = Rows(0, 2, 4)  # the batch has 2 rows
    with pytest.raises(StageFailed, match=r"stage 0 failed in step: .*it has 2 rows"):
        group.get([group.submit(0, "step", "1f1b", 1, 1, past, 1.0, True)], 60)
    with pytest.raises(StageFailed, match="failed a step since its blocks were restored"):
        group.get([group.submit(0, "snapshot", 1, 1)], 60)
    started = time.monotonic()
    with pytest.raises(StageFailed, match="copy 1 was dropped"):
        group.get([group.submit(0, "shipment", 1, 30.0)], 60)
    assert time.monotonic() - started < 20.0  # not after the shipment's 30 s
    group.get([group.submit(0, "load", state)], 60)
    group.get([group.submit(0, "snapshot", 0, 2)], 60)
    (shipped,) = group.get([group.submit(0, "shipment", 2, 30.0)], 60)
    assert sorted(shipped) == [0, 1, 2, 3]


def test_a_stage_refuses_to_adopt_blocks_it_has_no_state_for(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    group = make_group([(0, 2), (2, 4)], setup)
    with pytest.raises(StageFailed, match=r"stage 0 failed in adopt: .*no state for blocks \[2\]"):
        group.get([group.submit(0, "adopt", 0, (0, 3))], 60)
    with pytest.raises(
        StageFailed, match=r"stage 1 failed in export: .*does not hold blocks \[0\]"
    ):
        group.get([group.submit(1, "export", [0])], 60)


def test_clipping_reduces_the_gradient_norm_over_the_stages(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    """Each stage's per-gradient norms, folded by the caller, give the coefficient every
    stage applies: torch.nn.utils.clip_grad_norm_ over the whole model in one process."""
    sgd = OptimizerConf("sgd", 0.1, clip_grad_norm=0.01)
    group = make_group([(0, 2), (2, 4)], replace(setup, optimizer=sgd))
    gpipe(group, micro_batches=2)
    parts = group.get([group.submit(s, "grad_norms") for s in (0, 1)], 60)
    norm, clip = clip_coefficient(parts, sgd.clip_grad_norm)
    assert clip is not None and clip < 1.0 and norm > 0.01
    group.get([group.submit(s, "apply_step", clip) for s in (0, 1)], 60)
    expected = reference_states(micro_batches=2, optimizer=sgd)
    assert_same_states(gather(group, 2), expected)
    unclipped = reference_states(micro_batches=2, optimizer=replace(sgd, clip_grad_norm=None))
    assert not torch.allclose(expected[0]["module"]["0.weight"], unclipped[0]["module"]["0.weight"])


def test_bf16_stages_train_like_a_bf16_process(make_group: MakeGroup, setup: StageSetup) -> None:
    """Forward, loss and the recomputed forward under bfloat16 autocast; activations cross
    between the stages as bfloat16. SGD, whose step shows the precision (Adam's first step
    is about lr times the gradient's sign, whatever its rounding)."""
    sgd = OptimizerConf("sgd", 0.1)
    group = make_group(
        [(0, 2), (2, 4)], replace(setup, optimizer=sgd, precision="bf16", recompute=True)
    )
    outs, _ = gpipe(group, micro_batches=2)
    assert all(isinstance(o, Bits) and o.dtype == torch.bfloat16 for o in group.get(outs, 60))
    group.get([group.submit(s, "apply_step") for s in (0, 1)], 60)
    expected = reference_states(micro_batches=2, optimizer=sgd, precision="bf16")
    assert_same_states(gather(group, 2), expected)
    fp32 = reference_states(micro_batches=2, optimizer=sgd)
    assert not torch.allclose(expected[0]["module"]["0.weight"], fp32[0]["module"]["0.weight"])


def test_replicas_sum_their_gradients_and_train_like_one_process(
    kind: str, node_id: str, setup: StageSetup
) -> None:
    """2 stages x 2 replicas (the Ray session's four devices), an uneven 3 + 1 split. SGD:
    exact to float tolerance, not bitwise (the replicas' partial sums are added in another
    order than the reference's micro-batch-by-micro-batch accumulation)."""
    sgd = OptimizerConf("sgd", 0.1)
    factory: GroupFactory = LocalGroup if kind == "local" else RayGroup
    group = factory(replicated([(0, 2), (2, 4)], node_id, 2), replace(setup, optimizer=sgd))
    try:
        losses = dp_step(group, [3, 1])
        assert len(losses) == 4
        expected = reference_states(micro_batches=4, optimizer=sgd)
        replica_0 = gather(group, 2)
        replica_1: States = {}
        for part in group.get([group.submit(w, "state") for w in (2, 3)], 60):
            replica_1.update(part)
        assert_same_states(replica_0, expected)
        for i, state in replica_0.items():  # replicas step identically: bitwise equal
            for name, tensor in state["module"].items():
                assert torch.equal(replica_1[i]["module"][name], tensor)
        seconds = group.get(group.all_reduce([0, 2]), 60)  # no gradients left: a no-op
        assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    finally:
        group.shutdown()


def test_state_loads_into_another_partition(make_group: MakeGroup, setup: StageSetup) -> None:
    trained = make_group([(0, 2), (2, 4)], setup)
    one_step(trained, micro_batches=1)
    states = gather(trained, 2)
    trained.shutdown()  # frees its two devices: the test cluster has four
    other = make_group([(0, 1), (1, 3), (3, 4)], setup)
    loads = [other.submit(s, "load", states) for s in range(3)]
    assert other.get(loads, 60) == [None] * 3
    assert_same_states(gather(other, 3), states)


def test_a_stage_error_names_the_stage_and_call(make_group: MakeGroup, setup: StageSetup) -> None:
    group = make_group([(0, 2), (2, 4)], setup)
    bad = group.submit(0, "forward", 0, send(torch.zeros(2, 3)))  # 3 features, the model wants 8
    fed = group.submit(1, "forward", 0, bad)
    for handle in (bad, fed):  # a call fed by a failed call fails with the original error
        with pytest.raises(StageFailed, match=r"stage 0 failed in forward: RuntimeError") as e:
            group.get([handle], 60)
        assert (e.value.stage, e.value.method) == (0, "forward")
    with pytest.raises(StageFailed, match=r"stage 1 failed in backward: .*no forward of micro"):
        group.get([group.submit(1, "backward", 5, None)], 60)
    with pytest.raises(StageFailed, match="no such stage method 'shutdown'"):
        group.get([group.submit(1, "shutdown")], 60)
    # The group is still usable after its stages raised.
    assert len(one_step(group, micro_batches=1)) == 1


def test_a_step_with_work_in_flight_is_refused(make_group: MakeGroup, setup: StageSetup) -> None:
    group = make_group([(0, 4)], setup)
    x, y = make_data(DATA, SEED).batch(0, 4)
    group.get([group.submit(0, "forward_loss", 0, send(x), send(y), 1.0)], 60)
    with pytest.raises(StageFailed, match=r"still holds micro-batches \[0\]"):
        group.get([group.submit(0, "apply_step")], 60)


def test_a_stage_that_cannot_build_fails_the_group(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    broken = replace(setup, model=ModelRef("mlp", None, {"hidden": 0}))
    with pytest.raises(
        StageFailed, match=r"stage [01] failed in build: RegistryError: model.config.hidden"
    ):
        make_group([(0, 2), (2, 4)], broken)


def test_compute_time_is_measured_and_slowed(make_group: MakeGroup, setup: StageSetup) -> None:
    fast = make_group([(0, 4)], setup)
    slow = make_group([(0, 4)], setup, slowdown=4.0)
    # Best of three: contention from other processes only ever lowers a measured speed.
    fast_speed = max(
        s for (s,) in fast.get([fast.submit(0, "measure_speed") for _ in range(3)], 60)
    )
    slow_speed = max(
        s for (s,) in slow.get([slow.submit(0, "measure_speed") for _ in range(3)], 60)
    )
    assert 0 < slow_speed < 0.6 * fast_speed
    x, y = make_data(DATA, SEED).batch(0, 4)
    slow.get([slow.submit(0, "forward_loss", 0, send(x), send(y), 1.0)], 60)
    slow.get([slow.submit(0, "backward", 0, None)], 60)
    first, second = (slow.get([slow.submit(0, "apply_step")], 60)[0] for _ in range(2))
    assert first.compute_s > 0 and first.transfer_s > 0
    assert second.compute_s < first.compute_s  # the count restarts at every step
    assert second.transfer_s == 0.0


def test_calls_after_shutdown_report_the_stage_lost(
    make_group: MakeGroup, setup: StageSetup
) -> None:
    group = make_group([(0, 2), (2, 4)], setup)
    group.shutdown()
    group.shutdown()  # idempotent
    with pytest.raises(StageLost, match=r"stage 1 on device \w+-cpu-1 was lost") as e:
        group.get([group.submit(1, "nbytes")], 60)
    assert e.value.stage == 1


@pytest.mark.integration
def test_a_crashed_stage_worker_is_reported_lost(ray_address: str, setup: StageSetup) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    group = RayGroup(plans([(0, 2), (2, 4)], node), setup)
    try:
        victim: Any = group._actors[0]
        pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGKILL)
        x = send(make_data(DATA, SEED).batch(0, 4)[0])
        fed = group.submit(1, "forward", 0, group.submit(0, "forward", 0, x))
        # Waiting on stage 1's call, fed by the dead stage 0: the loss is blamed on stage 0.
        with pytest.raises(StageLost) as e:
            group.get([fed], 60)
        assert (e.value.stage, e.value.device_id) == (0, f"{node[:8]}-cpu-0")
        assert "died" in e.value.reason
    finally:
        group.shutdown()


class _BrokenRay:
    """Ray as a worker whose node is going down sees it: its raylet's pipe is broken."""

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError(32, "Broken pipe")


def _break_ray(_actor: Any) -> None:
    from shoal.workers.pipeline import awaited

    awaited.ray = _BrokenRay()  # type: ignore[attr-defined,assignment]


@pytest.mark.integration
def test_a_worker_that_loses_its_connection_to_ray_while_it_waits_is_reported_lost(
    ray_address: str, setup: StageSetup
) -> None:
    """A relayed forward waits for the stage before's activation when its own node goes
    down: Ray's wait raises ``OSError`` (broken pipe) in the worker. That stage is lost
    (the job recovers), not failed with Ray's error as if it were the model's."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    group = RayGroup(plans([(0, 2), (2, 4)], node), setup)
    try:
        victim: Any = group._actors[1]
        ray.get(victim.__ray_call__.remote(_break_ray), timeout=60)
        x = send(make_data(DATA, SEED).batch(0, 4)[0])
        fed = group.submit(1, "forward", 0, group.submit(0, "forward", 0, x))
        with pytest.raises(StageLost) as e:
            group.get([fed], 60)
        assert (e.value.stage, e.value.device_id) == (1, f"{node[:8]}-cpu-1")
        assert "lost its connection to Ray" in e.value.reason, e.value.reason
    finally:
        group.shutdown()


def _break_benchmark(_actor: Any) -> None:
    from shoal.workers import device_speed

    def timer(*_: Any) -> Any:
        raise RuntimeError("CUDA error: unspecified launch failure")

    device_speed.StepTimer = timer  # type: ignore[attr-defined,assignment]


@pytest.mark.integration
def test_a_device_that_fails_its_benchmark_on_ray_is_set_aside_by_the_group(
    ray_address: str, setup: StageSetup
) -> None:
    """Its worker's error crosses Ray as the stage lost with that device set aside."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    group = RayGroup(plans([(0, 2), (2, 4)], node), setup)
    try:
        victim: Any = group._actors[1]
        ray.get(victim.__ray_call__.remote(_break_benchmark), timeout=60)
        with pytest.raises(DeviceSetAside) as e:
            group.get([group.submit(1, "measure_speed")], 60)
        assert (e.value.stage, e.value.device_id) == (1, f"{node[:8]}-cpu-1")
        assert "failed as it measured it (RuntimeError: CUDA error" in e.value.reason
    finally:
        group.shutdown()


def test_a_worker_refused_a_place_on_a_node_ray_lists_alive_is_started_again(
    ray_address: str, setup: StageSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that has just joined is in Ray's cluster table before every scheduler knows
    it: a worker refused there is started again until ``NEW_NODE_S``, then the stage is
    lost. (Here the node never comes: Ray's table is made to list it alive.)"""
    import ray

    from shoal.workers import launch
    from shoal.workers.pipeline import group

    starts: list[str] = []
    start = launch.start_stage_worker

    def counted(plan: StagePlan, stage_setup: StageSetup) -> Any:
        starts.append(plan.device.id)
        return start(plan, stage_setup)

    monkeypatch.setattr(launch, "start_stage_worker", counted)
    monkeypatch.setattr(launch, "node_alive", lambda _: True)
    monkeypatch.setattr(group, "NEW_NODE_S", 1.5)
    node = ray.get_runtime_context().get_node_id()
    joining = plans([(2, 4)], "cd" * 28)[0]
    with pytest.raises(StageLost, match="its node is gone or cannot host it"):
        RayGroup([plans([(0, 2)], node)[0], replace(joining, index=1)], setup)
    assert starts.count(joining.device.id) >= 2, starts


@pytest.mark.integration
def test_a_regroup_takes_the_workers_prepared_for_its_plans_and_stops_the_others(
    ray_address: str, setup: StageSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relayout's new workers start while the old layout still trains (``prepare`` says
    when they are built): the regroup to those plans starts none of its own; a worker
    prepared for plans replaced since is stopped, not left holding its device. The moved
    job trains on exactly."""
    import ray

    from shoal.workers import launch
    from shoal.workers.pipeline.rebalance import Layout, move_blocks

    starts: list[tuple[str, BlockRange]] = []
    actors: list[Any] = []
    start = launch.start_stage_worker

    def counted(plan: StagePlan, stage_setup: StageSetup) -> Any:
        starts.append((plan.device.id, plan.blocks))
        actors.append(start(plan, stage_setup))
        return actors[-1]

    monkeypatch.setattr(launch, "start_stage_worker", counted)
    node = ray.get_runtime_context().get_node_id()
    old = plans([(0, 2), (2, 4)], node)
    spare = replace(old[1].device, id=f"{node[:8]}-cpu-2", index=2)
    first, then = (plans([(0, 2), r], node)[1] for r in ((1, 4), (2, 4)))
    new = [old[0], replace(then, device=spare)]
    group = RayGroup(old, setup)
    reference = LocalGroup(old, setup)
    try:
        assert one_step(group, micro_batches=2) == one_step(reference, micro_batches=2)
        group.prepare([old[0], replace(first, device=spare)])  # replaced before its boundary
        assert not group.prepare(new)  # just started: an actor takes seconds to build
        assert starts[2:] == [(spare.id, (1, 4)), (spare.id, (2, 4))], starts
        deadline = time.monotonic() + 60
        while not group.prepare(new):
            assert time.monotonic() < deadline, "the prepared worker was not built in 60 s"
            time.sleep(0.05)
        assert len(starts) == 4, starts  # asked again: nothing more started
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actors[2].call.remote("pid"), timeout=60)  # replaced: stopped
        move_blocks(group, Layout(tuple(old), (2,)), Layout(tuple(new), (2,)), 60, {0: 0})
        group.retire()
        assert len(starts) == 4, starts  # the regroup took the prepared worker
        assert one_step(group, micro_batches=2) == one_step(reference, micro_batches=2)
        assert_same_states(gather(group, 2), gather(reference, 2))
    finally:
        group.shutdown()
        reference.shutdown()


@pytest.mark.integration
def test_a_stage_placed_on_a_vanished_node_is_reported_lost(
    ray_address: str, setup: StageSetup
) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    gone = plans([(2, 4)], "ab" * 28)[0]
    started = time.monotonic()
    with pytest.raises(StageLost, match="stage 1 on device abababab-cpu-0 was lost: its node is"):
        RayGroup([plans([(0, 2)], node)[0], replace(gone, index=1)], setup)
    # Not started again as on a node that has just joined: Ray has no such node alive.
    assert time.monotonic() - started < NEW_NODE_S
