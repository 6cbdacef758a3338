"""Turning placed devices into a pipeline: order, cut and shares from measured speeds."""

from __future__ import annotations

import pytest

from scheduler.layout import plan_layout, relative_speeds
from scheduler.partition import Workload
from tests.factories import device

pytestmark = pytest.mark.unit


def test_speeds_are_relative_to_the_fastest_and_unmeasured_take_the_median() -> None:
    devices = [device("n1", 0), device("n1", 1), device("n1", 2), device("n1", 3)]
    speeds = relative_speeds(
        devices, {devices[0].id: 40.0, devices[1].id: 10.0, devices[2].id: 20.0}
    )
    assert [speeds[d.id] for d in devices] == [1.0, 0.25, 0.5, 0.5]
    assert set(relative_speeds(devices, {}).values()) == {1.0}


def test_unmeasured_devices_get_an_even_cut() -> None:
    devices = (device("n1", 0), device("n1", 1))
    layout = plan_layout(
        devices, {}, num_blocks=4, stages=2, replicas=1, workload=Workload(micro_batches=4)
    )
    assert layout.ranges == ((0, 2), (2, 4))
    assert len(layout.devices) == 2


def test_a_device_measured_slower_gets_fewer_blocks() -> None:
    fast, slow = device("n1", 0), device("n1", 1)
    layout = plan_layout(
        (slow, fast),
        {fast.id: 30.0, slow.id: 10.0},
        num_blocks=8,
        stages=2,
        replicas=1,
        workload=Workload(micro_batches=4),
    )
    sizes = {d.id: r[1] - r[0] for d, r in zip(layout.devices, layout.ranges, strict=True)}
    assert sizes[fast.id] > sizes[slow.id]
    assert sum(sizes.values()) == 8


def test_replicas_are_laid_out_replica_major_with_shares() -> None:
    devices = tuple(device("n1", i) for i in range(4))
    layout = plan_layout(
        devices, {}, num_blocks=3, stages=2, replicas=2, workload=Workload(micro_batches=4)
    )
    assert layout.plan.replicas == 2 and sum(layout.plan.micro_batches) == 4
    assert len(set(layout.devices)) == 4 and len(layout.ranges) == 2
