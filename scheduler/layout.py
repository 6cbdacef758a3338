"""How a placed job's devices become its pipeline: the partitioner over measured speeds.

Placement chose *which* devices a job gets; this decides their order, each stage's block
range and each replica's share of the micro-batches, so that a device measured slower gets
fewer blocks (heterogeneity-aware partitioning). Block costs are the job's traced costs
(``workers.profiler``: seconds on the reference device), or equal when the model did not trace;
device speeds come from each device's measured GFLOP/s (never its emulation label) relative to
the reference device's, and a device not measured yet counts as the median of those that are.
A tensor-parallel job is cut over groups of its devices as over devices (``scheduler.tensor``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from shoal.scheduler.devices import Device
from shoal.scheduler.partition import PartitionError, PartitionPlan, plan_partition
from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost
from shoal.scheduler.tensor import per_device, tensor_groups
from shoal.scheduler.types import BlockRange, DeviceId
from shoal.scheduler.workload import DeviceCapacity, Workload


@dataclass(frozen=True)
class Layout:
    """The plan, with its devices replica-major (``devices[r * p + s]`` runs stage s of r)."""

    plan: PartitionPlan
    devices: tuple[Device, ...]
    ranges: tuple[BlockRange, ...]
    shard: str = "none"
    """How its replicas split their state: the workload's mode, ``auto`` decided."""
    tensor: int = 1
    """Devices per stage: ``devices`` holds each stage's tensor group, consecutively."""

    def sharded_note(self, asked: str) -> str:
        """What ``shard: auto`` (``asked``) decided, said where it sharded; else nothing."""
        if asked != "auto" or self.shard == "none":
            return ""
        return f"; replicas sharded ({self.shard}): whole, the model fits no layout"


AUTO_SHARDS = ("gradients", "full")
"""What ``shard: auto`` shards with where only sharding fits, in order: ZeRO-2 moves the
bytes of an all-reduce (a reduce-scatter and an all-gather) and keeps what ZeRO-1 keeps;
ZeRO-3 keeps a share of the parameters too but gathers them for every micro-batch."""


def relative_speeds(
    devices: Sequence[Device], gflops: Mapping[DeviceId, float]
) -> dict[DeviceId, float]:
    """Speeds relative to the reference device (``REFERENCE_GFLOPS``); unmeasured devices get
    the median of the measured ones, and with none measured all run at the reference speed."""
    measured = [gflops[d.id] for d in devices if gflops.get(d.id, 0.0) > 0.0]
    if not measured:
        return {d.id: 1.0 for d in devices}
    typical = statistics.median(measured)
    return {d.id: (gflops.get(d.id) or typical) / REFERENCE_GFLOPS for d in devices}


def plan_layout(
    devices: Sequence[Device],
    gflops: Mapping[DeviceId, float],
    *,
    costs: Sequence[BlockCost],
    stages: int | None,
    replicas: int | None,
    workload: Workload,
    sync_s_per_byte: float = 0.0,
) -> Layout:
    """Cut the blocks of ``costs`` into ``stages`` x ``replicas`` over ``devices`` (None: the
    partitioner chooses). A workload's ``shard: auto`` keeps replicas whole where the model
    fits so and shards them (``AUTO_SHARDS``, the first that fits) where only that fits;
    refused every way, the last refusal is raised, the one with the most room."""
    cut = partial(_cut, devices, gflops, costs, stages, replicas, sync_s_per_byte=sync_s_per_byte)
    if workload.shard != "auto":
        return cut(workload)
    *tries, last = ("none", *AUTO_SHARDS)
    for mode in tries:
        try:
            return cut(replace(workload, shard=mode))
        except PartitionError:
            pass
    return cut(replace(workload, shard=last))


def _cut(
    devices: Sequence[Device],
    gflops: Mapping[DeviceId, float],
    costs: Sequence[BlockCost],
    stages: int | None,
    replicas: int | None,
    workload: Workload,
    *,
    sync_s_per_byte: float,
) -> Layout:
    speeds = relative_speeds(devices, gflops)
    # A tensor group is planned as one device: its first one's id, its slowest speed and
    # smallest memory, and each block as one of its devices holds it.
    groups = {group[0].id: group for group in tensor_groups(devices, workload.tensor)}
    capacities = [
        DeviceCapacity(first, min(speeds[d.id] for d in group), min(d.usable_bytes for d in group))
        for first, group in groups.items()
    ]
    plan = plan_partition(
        per_device(costs, workload.tensor),
        capacities,
        workload,
        stages=stages,
        replicas=replicas,
        sync_s_per_byte=sync_s_per_byte,
    )
    ordered = tuple(
        d for r in range(plan.replicas) for first, _ in plan.replica(r) for d in groups[first]
    )
    ranges = tuple(stage.blocks for stage in plan.stages)
    return Layout(plan, ordered, ranges, workload.shard, workload.tensor)
