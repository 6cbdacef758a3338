"""The runner overlaps steps only where its work leaves the workers their cores."""

from __future__ import annotations

import pytest

from shoal.scheduler.devices import Device
from shoal.scheduler.overlap import leaves_a_core, steps_per_call


def _device(i: int, gpu: bool) -> Device:
    return Device(f"d{i}", "n", i, "gpu" if gpu else "cpu", 1024, gpu=gpu)


@pytest.mark.unit
def test_overlap_needs_a_core_the_cpu_workers_leave_free() -> None:
    cpu = [_device(i, False) for i in range(2)]
    gpu = [_device(i, True) for i in range(2)]
    assert leaves_a_core(cpu, cores=4)
    assert not leaves_a_core(cpu, cores=2)  # two one-thread stages on two cores
    assert not leaves_a_core([*cpu, _device(2, False)], cores=2)
    assert leaves_a_core(gpu, cores=2)  # GPU workers wait on their devices
    assert leaves_a_core(cpu[:1], cores=2)
    assert leaves_a_core([cpu[0], gpu[1]], cores=2)


@pytest.mark.unit
def test_a_call_carries_the_steps_that_fit_its_time_up_to_the_next_boundary() -> None:
    assert steps_per_call(None, 50) == 1  # nothing measured yet
    assert steps_per_call(0.1, 50, call_s=2.0) == 20
    assert steps_per_call(0.1, 7, call_s=2.0) == 7  # a checkpoint after the 7th
    assert steps_per_call(3.0, 50, call_s=2.0) == 1  # a step longer than a call
    assert steps_per_call(0.0, 9) == 9
    with pytest.raises(ValueError, match="until_boundary"):
        steps_per_call(0.1, 0)
