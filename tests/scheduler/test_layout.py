"""Turning placed devices into a pipeline: order, cut and shares from costs and speeds."""

from __future__ import annotations

from functools import partial

import pytest

from shoal.scheduler.devices import Device
from shoal.scheduler.layout import AUTO_SHARDS, Layout, plan_layout, relative_speeds
from shoal.scheduler.partition import PartitionError
from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost, uniform_costs
from shoal.scheduler.workload import Workload
from tests.factories import device

pytestmark = pytest.mark.unit


def test_speeds_are_relative_to_the_reference_and_unmeasured_take_the_median() -> None:
    devices = [device("n1", 0), device("n1", 1), device("n1", 2), device("n1", 3)]
    gflops = {devices[0].id: 40.0, devices[1].id: 10.0, devices[2].id: 20.0}
    speeds = relative_speeds(devices, gflops)
    assert [speeds[d.id] * REFERENCE_GFLOPS for d in devices] == [40.0, 10.0, 20.0, 20.0]
    assert set(relative_speeds(devices, {}).values()) == {1.0}


def test_unmeasured_devices_get_an_even_cut() -> None:
    devices = (device("n1", 0), device("n1", 1))
    layout = plan_layout(
        devices, {}, costs=uniform_costs(4), stages=2, replicas=1, workload=Workload(4)
    )
    assert layout.ranges == ((0, 2), (2, 4))
    assert len(layout.devices) == 2


def test_a_device_measured_slower_gets_fewer_blocks() -> None:
    fast, slow = device("n1", 0), device("n1", 1)
    layout = plan_layout(
        (slow, fast),
        {fast.id: 30.0, slow.id: 10.0},
        costs=uniform_costs(8),
        stages=2,
        replicas=1,
        workload=Workload(micro_batches=4),
    )
    sizes = {d.id: r[1] - r[0] for d, r in zip(layout.devices, layout.ranges, strict=True)}
    assert sizes[fast.id] > sizes[slow.id]
    assert sum(sizes.values()) == 8


def test_costly_blocks_get_stages_of_their_own() -> None:
    # A cheap embedding, two costly layers, a cheap head: 2 stages cut between the layers.
    costs = tuple(BlockCost(i, t, 0, 0, 0) for i, t in enumerate([0.01, 1.0, 1.0, 0.01]))
    devices = (device("n1", 0), device("n1", 1))
    layout = plan_layout(devices, {}, costs=costs, stages=2, replicas=1, workload=Workload(4))
    assert layout.ranges == ((0, 2), (2, 4))
    skewed = tuple(BlockCost(i, t, 0, 0, 0) for i, t in enumerate([0.01, 0.01, 0.01, 3.0]))
    layout = plan_layout(devices, {}, costs=skewed, stages=2, replicas=1, workload=Workload(4))
    assert layout.ranges == ((0, 3), (3, 4))


def test_auto_counts_weigh_compute_against_per_stage_overhead() -> None:
    devices = tuple(device("n1", i) for i in range(4))
    costs = uniform_costs(4, fwd_bwd_s=0.001)  # a small model: one millisecond per block
    cheap = plan_layout(devices, {}, costs=costs, stages=None, replicas=1, workload=Workload(8))
    assert len(cheap.ranges) == 4  # free stages: use every device
    costly = plan_layout(
        devices,
        {},
        costs=costs,
        stages=None,
        replicas=1,
        workload=Workload(8, stage_overhead_s=0.02),
    )
    # (m + p - 1)(4 ms / p + 20 ms): 192 ms on one stage, 198 ms on two, 231 ms on four
    assert len(costly.ranges) == 1
    assert len(costly.devices) == 1  # the others go back to the pool


def test_auto_replicas_pay_for_their_all_reduce() -> None:
    devices = tuple(device("n1", i) for i in range(4))
    costs = tuple(BlockCost(i, 0.01, 10**8, 0, 0) for i in range(2))  # 100 MB per block
    free = plan_layout(devices, {}, costs=costs, stages=None, replicas=None, workload=Workload(8))
    assert free.plan.replicas > 1
    slow_sync = plan_layout(
        devices,
        {},
        costs=costs,
        stages=None,
        replicas=None,
        workload=Workload(8),
        sync_s_per_byte=1e-8,  # 1 s per 100 MB: never worth it for a 0.2 s step
    )
    assert slow_sync.plan.replicas == 1


def test_replicas_are_laid_out_replica_major_with_shares() -> None:
    devices = tuple(device("n1", i) for i in range(4))
    layout = plan_layout(
        devices, {}, costs=uniform_costs(3), stages=2, replicas=2, workload=Workload(4)
    )
    assert layout.plan.replicas == 2 and sum(layout.plan.micro_batches) == 4
    assert len(set(layout.devices)) == 4 and len(layout.ranges) == 2


def test_shard_auto_keeps_replicas_whole_where_they_fit_and_shards_where_only_that_fits() -> None:
    mib = 2**20
    costs = (BlockCost(0, 0.01, 400 * mib, 800 * mib, 0, 0),)  # Adam: moments 2x the block
    roomy = tuple(device("n1", i, memory_mb=4096) for i in range(2))
    tight = tuple(device("n1", i, memory_mb=2200) for i in range(2))
    auto = Workload(4, shard="auto")

    def layout(devices: tuple[Device, ...], workload: Workload) -> Layout:
        return plan_layout(devices, {}, costs=costs, stages=None, replicas=2, workload=workload)

    assert layout(roomy, auto).shard == "none"  # fits whole: stays whole
    with pytest.raises(PartitionError):
        layout(tight, Workload(4))  # whole, a replica needs 2.4 GiB
    sharded = layout(tight, auto)
    assert (sharded.shard, sharded.plan.replicas) == (AUTO_SHARDS[0], 2)
    assert sharded.sharded_note("auto") == (
        "; replicas sharded (gradients): whole, the model fits no layout"
    )
    assert layout(roomy, auto).sharded_note("auto") == ""
    assert sharded.sharded_note("gradients") == ""  # asked for: nothing to explain
    # An explicit mode is the layout's; too small even sharded, the sharded refusal.
    assert layout(roomy, Workload(4, shard="optimizer")).shard == "optimizer"
    small = tuple(device("n1", i, memory_mb=1500) for i in range(2))
    with pytest.raises(PartitionError, match="memory"):
        layout(small, auto)
    # Four devices of 1.7 GiB: ZeRO-2 needs 1.8 GiB each (whole parameters and gradients),
    # ZeRO-3 1.6 GiB (a quarter of everything, the block gathered): auto takes full.
    four = tuple(device("n1", i, memory_mb=1700) for i in range(4))
    by_four = partial(plan_layout, four, {}, costs=costs, stages=None, replicas=4)
    with pytest.raises(PartitionError):
        by_four(workload=Workload(4, shard="gradients"))
    assert by_four(workload=auto).shard == "full"
