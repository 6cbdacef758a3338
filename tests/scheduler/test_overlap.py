"""The runner overlaps steps only where its work leaves the workers their cores."""

from __future__ import annotations

import pytest

from scheduler.devices import Device
from scheduler.overlap import leaves_a_core


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
