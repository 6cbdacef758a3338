"""How a placed job's devices become its pipeline: the partitioner over measured speeds.

Placement chose *which* devices a job gets; this decides their order, each stage's block
range and each replica's share of the micro-batches, so that a device measured slower gets
fewer blocks (heterogeneity-aware partitioning). Until blocks are profiled every block costs
the same; device speeds come from each device's measured GFLOP/s (never its emulation label),
and a device not measured yet counts as the median of those that are.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.devices import Device
from scheduler.partition import DeviceCapacity, PartitionPlan, Workload, plan_partition
from scheduler.profile import uniform_costs
from scheduler.types import BlockRange, DeviceId


@dataclass(frozen=True)
class Layout:
    """The plan, with its devices replica-major (``devices[r * p + s]`` runs stage s of r)."""

    plan: PartitionPlan
    devices: tuple[Device, ...]
    ranges: tuple[BlockRange, ...]


def relative_speeds(
    devices: Sequence[Device], gflops: Mapping[DeviceId, float]
) -> dict[DeviceId, float]:
    """Speeds relative to the fastest measured device; unmeasured ones get the median."""
    measured = [gflops[d.id] for d in devices if gflops.get(d.id, 0.0) > 0.0]
    if not measured:
        return {d.id: 1.0 for d in devices}
    fastest, typical = max(measured), statistics.median(measured)
    return {d.id: (gflops.get(d.id) or typical) / fastest for d in devices}


def plan_layout(
    devices: Sequence[Device],
    gflops: Mapping[DeviceId, float],
    *,
    num_blocks: int,
    stages: int,
    replicas: int,
    workload: Workload,
) -> Layout:
    """Cut ``num_blocks`` equal blocks into ``stages`` x ``replicas`` over ``devices``."""
    speeds = relative_speeds(devices, gflops)
    capacities = [DeviceCapacity(d.id, speeds[d.id], d.memory_mb * 2**20) for d in devices]
    plan = plan_partition(
        uniform_costs(num_blocks), capacities, workload, stages=stages, replicas=replicas
    )
    by_id = {d.id: d for d in devices}
    ordered = tuple(
        by_id[device_id] for r in range(plan.replicas) for device_id, _ in plan.replica(r)
    )
    return Layout(plan, ordered, tuple(stage.blocks for stage in plan.stages))
