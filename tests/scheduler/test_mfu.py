"""Model FLOPs utilization: peaks by device kind and precision, measured where unlisted."""

from __future__ import annotations

import pytest

from shoal.scheduler.mfu import (
    PEAK_TFLOPS,
    DevicePeak,
    gpu_kind,
    mfu,
    peak_flops,
    step_flops,
)
from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost


def test_a_listed_gpu_peaks_at_its_data_sheet_figure_for_the_jobs_precision() -> None:
    h100 = DevicePeak("h100", gpu=True, measured_gflops=40_000.0)
    assert peak_flops(h100, "bf16") == pytest.approx(989.4e12)
    assert peak_flops(h100, "fp32") == pytest.approx(66.9e12)  # not the measurement
    assert peak_flops(DevicePeak("a100", True, None), "bf16") == pytest.approx(312e12)
    assert all("fp32" in peaks for peaks in PEAK_TFLOPS.values())


def test_a_gpus_product_name_reads_as_its_kind_in_the_table() -> None:
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_kind("NVIDIA H200") == "h200"
    assert gpu_kind("NVIDIA A100-SXM4-80GB") == "a100"  # not "a10", a prefix of it
    assert gpu_kind("NVIDIA A10") == "a10"
    assert gpu_kind("NVIDIA L4") == "l4"
    assert gpu_kind("Tesla V100-SXM2-16GB") == "v100"
    assert gpu_kind("Tesla T4") == "t4"
    assert gpu_kind("AMD Instinct MI300X") is None
    assert all(gpu_kind(kind) == kind for kind in PEAK_TFLOPS if kind != "a100-80g")


def test_an_unlisted_device_peaks_at_its_measured_speed_and_unmeasured_gives_none() -> None:
    cpu = DevicePeak("cpu", gpu=False, measured_gflops=85.0)
    assert peak_flops(cpu, "fp32") == pytest.approx(85e9)
    assert peak_flops(cpu, "bf16") == pytest.approx(85e9)  # a CPU's peak is what it measured
    # A CPU device named like a GPU kind is still a CPU: its measurement, not the table.
    assert peak_flops(DevicePeak("h100", False, 50.0), "fp32") == pytest.approx(50e9)
    assert peak_flops(DevicePeak("cpu", False, None), "fp32") is None
    assert peak_flops(DevicePeak("cpu", False, 0.0), "fp32") is None
    unlisted = DevicePeak("mi300x", gpu=True, measured_gflops=80_000.0)
    assert peak_flops(unlisted, "fp32") == pytest.approx(80e12)
    # Measured in float32, it does not stand for a bf16 peak; nor does V100's fp32 figure.
    assert peak_flops(unlisted, "bf16") is None
    assert peak_flops(DevicePeak("v100", True, 14_000.0), "bf16") is None


def test_a_steps_flops_are_every_blocks_traced_flops_per_micro_batch() -> None:
    def block(i: int, flops: float) -> BlockCost:
        return BlockCost(i, flops / (REFERENCE_GFLOPS * 1e9), 0, 0, 0)

    costs = [block(0, 8192.0 * 16), block(1, 6144.0 * 16), block(2, 1920.0 * 16)]
    assert step_flops(costs, micro_batches=2) == pytest.approx(16256 * 32)
    assert step_flops([], micro_batches=4) == 0


def test_mfu_is_the_steps_flops_over_its_seconds_times_the_devices_summed_peak() -> None:
    assert mfu(3e12, 0.5, [2e12, 4e12]) == pytest.approx(1.0)
    assert mfu(3e12, 1.0, [2e12, 4e12]) == pytest.approx(0.5)
    assert mfu(3e12, 1.0, [2e12, None]) is None  # one device's peak unknown: no figure
    assert mfu(3e12, 1.0, []) is None
    assert mfu(3e12, 0.0, [2e12]) is None
    assert mfu(0.0, 1.0, [2e12]) is None  # nothing counted
