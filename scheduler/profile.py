"""Block cost profiles: what each block costs on a reference device, and how fast devices are.

A ``BlockCost`` is measured once, on one *reference* device, at the job's micro-batch size:
the forward+backward seconds of one micro-batch and the block's bytes. A ``DeviceSpeed`` says
how much faster a device runs the same work (1.0 = the reference), estimated from *measured*
times only: the stage speed benchmark (GFLOP/s) or the compute a stage really spent
(``scheduler.elastic.measured_speeds``). The
emulate-slowdown label of a virtual device is never read here; it shows up, as a real slow GPU
would, in what is measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.scheduler.types import BlockRange, DeviceId

REFERENCE_GFLOPS = 1000.0
"""The reference device's speed: traced block costs are seconds on a device doing this many
GFLOP/s, so a device measured at g GFLOP/s has relative speed g / REFERENCE_GFLOPS."""


class ProfileError(ValueError):
    """A cost or speed measurement is unusable; the message says which and how to fix it."""


@dataclass(frozen=True)
class BlockCost:
    """One block, measured on the reference device at the job's micro-batch size.

    ``activation_bytes_per_sample`` is what the block keeps for its backward per sample;
    ``input_bytes_per_sample`` is its input (the stage boundary when a stage starts here), which
    is all a stage keeps per micro-batch under rematerialization.
    """

    index: int
    fwd_bwd_s: float
    param_bytes: int
    optim_bytes: int
    activation_bytes_per_sample: int
    input_bytes_per_sample: int = 0
    split_bytes: int = 0
    """Of ``param_bytes``, what a tensor-parallel split divides over its devices (0: the
    block has no split, ``workers.tensor_split``)."""
    split_ways: int = 0
    """The most devices that split can go over (a GPT layer's heads, a linear layer's output
    features; 0: no split, or not known)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fwd_bwd_s) and self.fwd_bwd_s >= 0):
            raise ProfileError(
                f"block {self.index}: fwd_bwd_s must be finite and >= 0, got {self.fwd_bwd_s}"
            )
        sizes = {
            "param_bytes": self.param_bytes,
            "optim_bytes": self.optim_bytes,
            "activation_bytes_per_sample": self.activation_bytes_per_sample,
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "split_ways": self.split_ways,
        }
        bad = next((name for name, value in sizes.items() if value < 0), None)
        if bad is not None:
            raise ProfileError(f"block {self.index}: {bad} must be >= 0, got {sizes[bad]}")
        if not 0 <= self.split_bytes <= self.param_bytes:
            raise ProfileError(
                f"block {self.index}: split_bytes must be 0..param_bytes ({self.param_bytes}),"
                f" got {self.split_bytes}"
            )


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast a device computes relative to the reference device (2.0 = twice as fast)."""

    device_id: DeviceId
    relative_speed: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.relative_speed) and self.relative_speed > 0):
            raise ProfileError(
                f"device {self.device_id}: relative_speed must be finite and > 0,"
                f" got {self.relative_speed}; measure the device again"
            )


def scaled_time(cost: BlockCost, speed: DeviceSpeed) -> float:
    """Seconds of one micro-batch's forward+backward of ``cost``'s block on ``speed``'s device."""
    return cost.fwd_bwd_s / speed.relative_speed


def range_time(costs: Sequence[BlockCost], blocks: BlockRange, speed: float = 1.0) -> float:
    """Seconds of one micro-batch through blocks ``[start, stop)`` on a device of ``speed``."""
    start, stop = blocks
    return sum(c.fwd_bwd_s for c in costs[start:stop]) / speed


def uniform_costs(
    num_blocks: int,
    *,
    fwd_bwd_s: float = 1.0,
    param_bytes: int = 0,
    optim_bytes: int = 0,
    activation_bytes_per_sample: int = 0,
) -> tuple[BlockCost, ...]:
    """Identical blocks: the stand-in before anything is measured (even partitions)."""
    return tuple(
        BlockCost(
            i,
            fwd_bwd_s,
            param_bytes,
            optim_bytes,
            activation_bytes_per_sample,
            activation_bytes_per_sample,
        )
        for i in range(num_blocks)
    )


def speeds_from_gflops(
    gflops: Mapping[DeviceId, float], reference: DeviceId
) -> tuple[DeviceSpeed, ...]:
    """Relative speeds from the stage micro-benchmark (``Stage.measure_speed``), in the order
    given; ``reference`` is the device the block costs were measured on."""
    if reference not in gflops:
        raise ProfileError(
            f"the reference device {reference} has no GFLOP/s measurement; measure it too"
        )
    base = gflops[reference]
    bad = next((d for d, g in gflops.items() if not (math.isfinite(g) and g > 0)), None)
    if bad is not None:
        raise ProfileError(f"device {bad} measured {gflops[bad]} GFLOP/s; measure it again")
    return tuple(DeviceSpeed(d, g / base) for d, g in gflops.items())
