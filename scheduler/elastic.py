"""The elastic policy: when a running job should re-cut its blocks over its devices.

Elasticpipe-style dynamic repartitioning, as a pure decision: per-step measurements in, a
``Repartition`` or a ``Keep`` out. Nothing here trusts what a device is *said* to be (its
kind, its emulation label): a device's speed is what its stage measured, the reference
seconds of the blocks it ran over the seconds it spent on them (``measured_speeds``), the
median over the last ``window_steps`` steps so one noisy step does not move blocks.

With those speeds the current cut and the best cut over the same devices, in the same order
(``partition.order_partition``: exact for a fixed order), are both predicted. A new cut is
returned only when

- it is at least ``min_gain`` faster per step than the current one (the hysteresis band:
  a cut that is only a little better stays put, so measurement noise cannot make it flap),
- and the seconds it saves over ``horizon_steps`` steps exceed the migration's cost: the
  parameter and optimizer bytes of every block that changes device, over the transfer
  bandwidth, plus a fixed cost per migration (the step boundary's round trips).

The caller adds the other half of the hysteresis: it asks again only after ``window_steps``
fresh steps, so each decision rests on measurements of the layout then running.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.scheduler.partition import (
    PartitionPlan,
    StageAssignment,
    evaluate,
    order_partition,
)
from shoal.scheduler.profile import BlockCost, range_time
from shoal.scheduler.types import BlockRange, DeviceId
from shoal.scheduler.workload import DeviceCapacity, Workload


@dataclass(frozen=True)
class ElasticConfig:
    window_steps: int = 10
    """Steps of measurements behind a decision (their median)."""
    min_gain: float = 0.1
    """The least predicted step-time saving, as a fraction of the current step, worth a move."""
    horizon_steps: int = 100
    """Steps within which the saved seconds must repay the migration."""
    transfer_bytes_per_s: float = 0.7e9
    """Block-state bandwidth between devices (measured gloo/Ray figures: docs/benchmarks.md)."""
    migration_overhead_s: float = 0.5
    """Fixed seconds of one migration: the calls that export and adopt blocks."""

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.horizon_steps < 1:
            raise ValueError("window_steps and horizon_steps must be >= 1")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.transfer_bytes_per_s <= 0 or self.migration_overhead_s < 0:
            raise ValueError("transfer_bytes_per_s must be > 0 and migration_overhead_s >= 0")


@dataclass(frozen=True)
class StageSample:
    """What one worker measured in one step: it ran ``micro_batches`` micro-batches through
    ``blocks`` on ``device_id`` and computed for ``compute_s`` seconds."""

    device_id: DeviceId
    blocks: BlockRange
    micro_batches: int
    compute_s: float


@dataclass(frozen=True)
class Keep:
    """No move: why, and the current layout's predicted step seconds (0 while measuring)."""

    reason: str
    current_step_s: float = 0.0


@dataclass(frozen=True)
class Repartition:
    """Move to ``plan``: the predictions behind it and what the move costs."""

    plan: PartitionPlan
    current_step_s: float
    predicted_step_s: float
    moved_blocks: tuple[int, ...]
    moved_bytes: int
    migration_s: float
    speeds: Mapping[DeviceId, float]
    reason: str

    @property
    def predicted_gain(self) -> float:
        """The predicted step-time saving as a fraction of the current step."""
        return 1.0 - self.predicted_step_s / self.current_step_s


Decision = Keep | Repartition


def current_plan(
    stages: Sequence[tuple[Sequence[DeviceId], BlockRange]], micro_batches: Sequence[int]
) -> PartitionPlan:
    """The running layout as a plan: each stage's device per replica and its blocks, and each
    replica's micro-batches (what ``evaluate`` needs; the predictions are left empty)."""
    return PartitionPlan(
        stages=tuple(StageAssignment(tuple(ids), blocks) for ids, blocks in stages),
        replicas=len(micro_batches),
        micro_batches=tuple(micro_batches),
        predicted_step_s=0.0,
        bottleneck_s=(),
        reason="running",
    )


def measured_speeds(
    costs: Sequence[BlockCost], history: Sequence[Sequence[StageSample]]
) -> dict[DeviceId, float]:
    """Each device's speed relative to the cost model's reference device: per step, the
    reference seconds of what it computed over the seconds it took; the median over steps.
    Samples without compute (a stage that ran nothing) are skipped."""
    per_device: dict[DeviceId, list[float]] = {}
    for step in history:
        for sample in step:
            expected = range_time(costs, sample.blocks) * sample.micro_batches
            if sample.compute_s > 0 and expected > 0:
                per_device.setdefault(sample.device_id, []).append(expected / sample.compute_s)
    return {device: statistics.median(v) for device, v in per_device.items()}


def moved_blocks(old: PartitionPlan, new: PartitionPlan) -> tuple[int, ...]:
    """Blocks that some replica holds on another device after the move, in block order."""

    def holders(plan: PartitionPlan) -> dict[int, tuple[DeviceId, ...]]:
        return {block: stage.device_ids for stage in plan.stages for block in range(*stage.blocks)}

    before, after = holders(old), holders(new)
    return tuple(b for b in sorted(after) if before.get(b) != after[b])


def decide(
    current: PartitionPlan,
    costs: Sequence[BlockCost],
    devices: Sequence[DeviceCapacity],
    workload: Workload,
    history: Sequence[Sequence[StageSample]],
    config: ElasticConfig = ElasticConfig(),
    *,
    sync_s_per_byte: float = 0.0,
) -> Decision:
    """Repartition ``current`` over its own devices if the measured speeds say it pays."""
    if len(history) < config.window_steps:
        return Keep(f"measuring: {len(history)} of {config.window_steps} steps")
    speeds = measured_speeds(costs, history[-config.window_steps :])
    unmeasured = sorted(set(current.device_ids) - set(speeds))
    if unmeasured:
        return Keep(f"devices {unmeasured} have no compute measurements yet")
    by_id = {
        d.device_id: DeviceCapacity(d.device_id, speeds.get(d.device_id, d.speed), d.memory_bytes)
        for d in devices
    }
    now = evaluate(current, costs, list(by_id.values()), workload, sync_s_per_byte=sync_s_per_byte)
    groups = [[by_id[d] for d in stage.device_ids] for stage in current.stages]
    candidate = order_partition(costs, groups, workload, sync_s_per_byte=sync_s_per_byte)
    moved = moved_blocks(current, candidate)
    if not moved and candidate.micro_batches == current.micro_batches:
        return Keep(f"the cut is the best for the measured speeds ({now:.4g} s per step)", now)
    saved = now - candidate.predicted_step_s
    if saved < config.min_gain * now:
        return Keep(
            f"the best re-cut predicts {candidate.predicted_step_s:.4g} s per step against"
            f" {now:.4g} s now: less than {config.min_gain:.0%} faster",
            now,
        )
    replicas = len(current.micro_batches)
    moved_bytes = replicas * sum(costs[b].param_bytes + costs[b].optim_bytes for b in moved)
    migration_s = config.migration_overhead_s + moved_bytes / config.transfer_bytes_per_s
    if saved * config.horizon_steps < migration_s:
        return Keep(
            f"moving {len(moved)} blocks ({moved_bytes} bytes) costs ~{migration_s:.3g} s;"
            f" saving {saved:.3g} s per step repays it only after"
            f" {migration_s / saved:.0f} steps (horizon {config.horizon_steps})",
            now,
        )
    return Repartition(
        plan=candidate,
        current_step_s=now,
        predicted_step_s=candidate.predicted_step_s,
        moved_blocks=moved,
        moved_bytes=moved_bytes,
        migration_s=migration_s,
        speeds=speeds,
        reason=_why(speeds, now, candidate.predicted_step_s),
    )


def _why(speeds: Mapping[DeviceId, float], now: float, predicted: float) -> str:
    """Name the straggler: the slowest device against the median speed."""
    typical = statistics.median(speeds.values())
    slowest = min(speeds, key=lambda d: speeds[d])
    share = speeds[slowest] / typical if typical > 0 else 1.0
    return (
        f"device {slowest} computes at {share:.2f} of the median device speed; re-cut"
        f" predicts {predicted:.4g} s per step instead of {now:.4g} s"
        f" ({1 - predicted / now:.0%} faster)"
    )
