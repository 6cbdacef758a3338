"""Tensor-parallel groups as the partitioner plans them: each device's share of a split
block, groups of one node, and layouts that fit a block no single device holds."""

from __future__ import annotations

import pytest

from shoal.scheduler.devices import Device
from shoal.scheduler.layout import Layout, plan_layout
from shoal.scheduler.partition import PartitionError
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.tensor import per_device, tensor_groups
from shoal.scheduler.workload import Workload

pytestmark = pytest.mark.unit

MB = 2**20


def device(node: str, index: int, memory_mb: int = 1000) -> Device:
    return Device(f"{node}-{index}", node, index, "cpu", memory_mb, gpu=False)


def test_a_device_of_a_group_holds_the_split_part_divided_and_the_rest_whole() -> None:
    split, whole = (
        BlockCost(1, 2.0, 1000, 2000, 10, 10, split_bytes=800),
        BlockCost(0, 1.0, 600, 1200, 10, 10),
    )
    assert per_device([split, whole], 1) == (split, whole)
    shared, kept = per_device([split, whole], 4)
    assert kept == whole  # a block with no split stays whole on the group's first device
    assert shared.param_bytes == 200 + 800 // 4
    assert shared.optim_bytes == 2000 * 400 // 1000  # the optimizer state in proportion
    assert shared.fwd_bwd_s == pytest.approx(2.0 * 400 / 1000)
    assert shared.activation_bytes_per_sample == split.activation_bytes_per_sample


def test_groups_are_whole_and_on_one_node() -> None:
    devices = [device("b", 1), device("a", 2), device("b", 0), device("a", 0), device("a", 1)]
    groups = tensor_groups(devices, 2)
    assert [[d.id for d in g] for g in groups] == [["b-0", "b-1"], ["a-0", "a-1"]]
    assert tensor_groups(devices, 1) == [(d,) for d in devices]  # alone, in the order given
    assert tensor_groups(devices, 4) == []


def test_a_block_larger_than_any_device_fits_split_over_a_group() -> None:
    # Block 1 keeps 2 x 600 MB (parameters, gradients) + 1200 MB of Adam state: no 1000 MB
    # device holds it, a device of a group of 4 holds a quarter of it.
    costs = [
        BlockCost(0, 1.0, 10 * MB, 20 * MB, 1000, 1000),
        BlockCost(1, 4.0, 600 * MB, 1200 * MB, 1000, 1000, split_bytes=600 * MB),
        BlockCost(2, 1.0, 10 * MB, 20 * MB, 1000, 1000, split_bytes=10 * MB),
    ]
    devices = [device("a", i) for i in range(4)] + [device("b", i) for i in range(3)]

    def layout(tensor: int) -> Layout:
        workload = Workload(micro_batches=2, tensor=tensor)
        return plan_layout(devices, {}, costs=costs, stages=1, replicas=1, workload=workload)

    with pytest.raises(PartitionError):
        layout(1)
    planned = layout(4)
    assert planned.tensor == 4 and planned.ranges == ((0, 3),)
    # Node b has three devices: no group of four there.
    assert [d.id for d in planned.devices] == ["a-0", "a-1", "a-2", "a-3"]
