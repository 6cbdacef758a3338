"""Block cost profiles and device speeds estimated from measured times."""

from __future__ import annotations

import math

import pytest

from shoal.scheduler.profile import (
    BlockCost,
    DeviceSpeed,
    ProfileError,
    range_time,
    scaled_time,
    speeds_from_gflops,
    uniform_costs,
)

pytestmark = pytest.mark.unit


def test_a_faster_device_takes_proportionally_less_time() -> None:
    cost = BlockCost(0, fwd_bwd_s=0.3, param_bytes=8, optim_bytes=16, activation_bytes_per_sample=4)
    assert math.isclose(scaled_time(cost, DeviceSpeed("a", 3.0)), 0.1)
    costs = uniform_costs(5, fwd_bwd_s=0.5)
    assert [c.index for c in costs] == [0, 1, 2, 3, 4]
    assert math.isclose(range_time(costs, (1, 4), speed=2.0), 0.75)


def test_speeds_from_the_micro_benchmark_are_relative_to_the_reference() -> None:
    speeds = speeds_from_gflops({"ref": 10.0, "fast": 25.0, "slow": 5.0}, reference="ref")
    assert speeds == (DeviceSpeed("ref", 1.0), DeviceSpeed("fast", 2.5), DeviceSpeed("slow", 0.5))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockCost(2, -1.0, 0, 0, 0), "block 2: fwd_bwd_s must be finite and >= 0"),
        (lambda: BlockCost(1, 1.0, -5, 0, 0), "block 1: param_bytes must be >= 0, got -5"),
        (lambda: DeviceSpeed("d", 0.0), "device d: relative_speed must be finite and > 0"),
        (
            lambda: speeds_from_gflops({"a": 1.0}, reference="b"),
            "reference device b has no GFLOP/s measurement",
        ),
        (
            lambda: speeds_from_gflops({"a": 1.0, "b": math.nan}, reference="a"),
            "device b measured nan GFLOP/s",
        ),
    ],
)
def test_unusable_measurements_say_why(make: object, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        make()  # type: ignore[operator]
