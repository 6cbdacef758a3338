"""What the partitioner plans for: the devices as it sees them and how a mini-batch runs.

Shared by the planner (``scheduler.partition``), its fixed-order cut (``scheduler.cut``),
SHARP's shard cutting and the layouts the workers are given.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.scheduler.types import DeviceId


@dataclass(frozen=True)
class DeviceCapacity:
    """A device as the partitioner sees it: measured relative speed, memory budget in bytes."""

    device_id: DeviceId
    speed: float
    memory_bytes: int


@dataclass(frozen=True)
class Workload:
    """How one mini-batch runs: ``micro_batches`` of ``micro_batch_size`` samples each."""

    micro_batches: int
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    recompute: bool = False
    precision: str = "fp32"
    stage_overhead_s: float = 0.0
    """Seconds a stage spends per micro-batch beyond its blocks' compute (framework calls,
    transfers): what makes one more stage cost more than it saves on a small model."""
    shard: str = "none"
    """How replicas split their optimizer state (``parallelism.shard``): sharded, a stage of
    R replicas keeps 1/R of it on each device (``scheduler.memory.replica_state_bytes``)."""
    tensor: int = 1
    """Devices per tensor-parallel group (``parallelism.tensor``): each stage runs on a
    group of this many devices of one node (``scheduler.tensor``)."""
