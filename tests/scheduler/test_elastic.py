"""The elastic policy on recorded timing traces (no Ray, no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from shoal.scheduler.elastic import (
    ElasticConfig,
    Keep,
    Repartition,
    StageSample,
    current_plan,
    decide,
    measured_speeds,
    moved_blocks,
)
from shoal.scheduler.profile import BlockCost, uniform_costs
from shoal.scheduler.workload import DeviceCapacity, Workload

pytestmark = pytest.mark.unit

GiB = 2**30
MB_S = 0.01  # reference seconds of one micro-batch through one block
COSTS = uniform_costs(6, fwd_bwd_s=MB_S, param_bytes=1000, optim_bytes=1000)
W = Workload(micro_batches=8)
DEVICES = [DeviceCapacity(d, 1.0, GiB) for d in ("d0", "d1", "d2")]
EVEN = current_plan([(("d0",), (0, 2)), (("d1",), (2, 4)), (("d2",), (4, 6))], [8])


def trace(
    plan_stages: Sequence[tuple[str, tuple[int, int]]],
    speeds: dict[str, float],
    steps: int,
    micro_batches: int = 8,
    noise: dict[int, dict[str, float]] | None = None,
) -> list[list[StageSample]]:
    """Steps of samples as a stage would report them: reference time / speed (x noise)."""
    out = []
    for step in range(steps):
        bump = (noise or {}).get(step, {})
        out.append(
            [
                StageSample(
                    device,
                    blocks,
                    micro_batches,
                    (blocks[1] - blocks[0])
                    * MB_S
                    * micro_batches
                    / speeds[device]
                    * bump.get(device, 1.0),
                )
                for device, blocks in plan_stages
            ]
        )
    return out


EVEN_STAGES = [("d0", (0, 2)), ("d1", (2, 4)), ("d2", (4, 6))]


def test_speeds_are_reference_time_over_measured_time_median_over_steps() -> None:
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 0.5, "d2": 2.0}, 3, noise={1: {"d0": 10.0}})
    speeds = measured_speeds(COSTS, history)
    assert speeds == pytest.approx({"d0": 1.0, "d1": 0.5, "d2": 2.0})  # the outlier step ignored


def test_it_measures_a_full_window_before_deciding() -> None:
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1 / 3, "d2": 1.0}, 4)
    decision = decide(EVEN, COSTS, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert decision == Keep("measuring: 4 of 5 steps")


def test_a_balanced_pipeline_stays() -> None:
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1.0, "d2": 1.0}, 5)
    decision = decide(EVEN, COSTS, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Keep) and "the cut is the best" in decision.reason
    assert math.isclose(decision.current_step_s, (8 + 2) * 2 * MB_S)


def test_a_straggler_gets_fewer_blocks_with_the_gain_predicted() -> None:
    # d1 runs 3x slower: its 2 blocks take 0.06 s a micro-batch, the step (8+2) x 0.06.
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1 / 3, "d2": 1.0}, 5)
    decision = decide(EVEN, COSTS, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Repartition)
    assert [s.blocks for s in decision.plan.stages] in (
        [(0, 3), (3, 4), (4, 6)],
        [(0, 2), (2, 3), (3, 6)],
    )
    assert [s.device_ids for s in decision.plan.stages] == [("d0",), ("d1",), ("d2",)]
    assert math.isclose(decision.current_step_s, 10 * 0.06)
    # Best: 3 blocks on a fast device (0.03 s) against 1 on d1 (0.03 s): (8+2) x 0.03.
    assert math.isclose(decision.predicted_step_s, 10 * 0.03)
    assert decision.predicted_gain == pytest.approx(0.5)
    assert len(decision.moved_blocks) == 1 and decision.moved_bytes == 2000
    assert "device d1 computes at 0.33 of the median device speed" in decision.reason


def test_a_gain_under_the_threshold_does_not_move_anything() -> None:
    # 20 blocks on 2 devices, b 10% slower: one block from b to a saves ~1%.
    costs = uniform_costs(20, fwd_bwd_s=MB_S)
    devices = [DeviceCapacity("a", 1.0, GiB), DeviceCapacity("b", 1.0, GiB)]
    stages = [("a", (0, 10)), ("b", (10, 20))]
    plan = current_plan([(("a",), (0, 10)), (("b",), (10, 20))], [8])
    history = trace(stages, {"a": 1.0, "b": 0.9}, 5)
    decision = decide(plan, costs, devices, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Keep) and "less than 10% faster" in decision.reason
    eager = ElasticConfig(window_steps=5, min_gain=0.0)
    moved = decide(plan, costs, devices, W, history, eager)
    assert isinstance(moved, Repartition) and moved.moved_blocks == (10,)


def test_a_move_that_would_not_repay_within_the_horizon_waits() -> None:
    heavy = uniform_costs(6, fwd_bwd_s=MB_S, param_bytes=GiB, optim_bytes=GiB)
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1 / 3, "d2": 1.0}, 5)
    slow_link = ElasticConfig(window_steps=5, horizon_steps=10, transfer_bytes_per_s=1e8)
    big = [DeviceCapacity(d, 1.0, 100 * GiB) for d in ("d0", "d1", "d2")]
    decision = decide(EVEN, heavy, big, W, history, slow_link)
    assert isinstance(decision, Keep) and "repays it only after" in decision.reason
    patient = ElasticConfig(window_steps=5, horizon_steps=10_000, transfer_bytes_per_s=1e8)
    assert isinstance(decide(EVEN, heavy, big, W, history, patient), Repartition)


def test_one_slow_step_in_the_window_does_not_trigger_a_move() -> None:
    noise = {2: {"d1": 5.0}}
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1.0, "d2": 1.0}, 5, noise=noise)
    decision = decide(EVEN, COSTS, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Keep)


def test_after_the_move_the_new_cut_is_kept_under_the_same_speeds() -> None:
    # No flapping: measured on the new layout, the same speeds give no reason to move back.
    speeds = {"d0": 1.0, "d1": 1 / 3, "d2": 1.0}
    first = decide(EVEN, COSTS, DEVICES, W, trace(EVEN_STAGES, speeds, 5), ElasticConfig(5))
    assert isinstance(first, Repartition)
    moved = [(s.device_ids[0], s.blocks) for s in first.plan.stages]
    again = decide(first.plan, COSTS, DEVICES, W, trace(moved, speeds, 5), ElasticConfig(5))
    assert isinstance(again, Keep) and "the cut is the best" in again.reason


def test_a_slow_replica_gets_fewer_micro_batches_without_moving_blocks() -> None:
    costs = uniform_costs(2, fwd_bwd_s=MB_S)
    devices = [DeviceCapacity("a", 1.0, GiB), DeviceCapacity("b", 1.0, GiB)]
    plan = current_plan([(("a", "b"), (0, 2))], [4, 4])
    history = [
        [StageSample("a", (0, 2), 4, 4 * 2 * MB_S), StageSample("b", (0, 2), 4, 4 * 2 * MB_S * 3)]
    ] * 5
    decision = decide(plan, costs, devices, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Repartition)
    assert decision.moved_blocks == () and decision.moved_bytes == 0
    assert sum(decision.plan.micro_batches) == 8
    assert decision.plan.micro_batches[0] > decision.plan.micro_batches[1]


def test_moved_blocks_are_those_whose_device_changes() -> None:
    after = current_plan([(("d0",), (0, 3)), (("d1",), (3, 4)), (("d2",), (4, 6))], [8])
    assert moved_blocks(EVEN, after) == (2,)
    assert moved_blocks(EVEN, EVEN) == ()


def test_unmeasured_devices_keep_the_layout() -> None:
    history = [[StageSample("d0", (0, 2), 8, 0.1)]] * 5
    decision = decide(EVEN, COSTS, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert decision == Keep("devices ['d1', 'd2'] have no compute measurements yet")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_gain"):
        ElasticConfig(min_gain=1.5)
    with pytest.raises(ValueError, match="window_steps"):
        ElasticConfig(window_steps=0)


def test_costs_need_not_be_uniform() -> None:
    # Block 0 is 4x the others: the even cut by count is not balanced even on equal devices.
    costs = [BlockCost(0, 4 * MB_S, 0, 0, 0), *uniform_costs(6, fwd_bwd_s=MB_S)[1:]]
    history = trace(EVEN_STAGES, {"d0": 1.0, "d1": 1.0, "d2": 1.0}, 5)
    history = [
        [
            StageSample(s.device_id, s.blocks, 8, s.compute_s * (2.5 if s.device_id == "d0" else 1))
            for s in step
        ]
        for step in history
    ]
    decision = decide(EVEN, costs, DEVICES, W, history, ElasticConfig(window_steps=5))
    assert isinstance(decision, Repartition)
    assert decision.plan.stages[0].blocks == (0, 1)
