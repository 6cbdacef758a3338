"""A device's fixed overhead: read from nvidia-smi's per-process count, nothing on a CPU,
reported in an event the control plane keeps (tests/service/test_controller.py)."""

from __future__ import annotations

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.workers.device_memory import (
    Overhead,
    device_memory_event,
    measure_overhead,
    parse_process_mib,
)

SMI = """\
4242, 612
977, 3108
4242, 100
13, [N/A]
"""


@pytest.mark.unit
def test_nvidia_smi_counts_the_process_on_every_gpu_it_uses() -> None:
    assert parse_process_mib(SMI, 4242) == 712 * 2**20
    assert parse_process_mib(SMI, 977) == 3108 * 2**20
    assert parse_process_mib(SMI, 13) is None  # the driver does not say
    assert parse_process_mib(SMI, 5) is None  # not listed (a container may hide the ids)
    assert parse_process_mib("No running processes found\n", 4242) is None


@pytest.mark.unit
def test_a_cpu_device_has_no_overhead() -> None:
    assert measure_overhead(torch.device("cpu")) == Overhead(0, "none")


@pytest.mark.unit
def test_the_event_names_the_device_its_size_and_how_it_was_measured() -> None:
    device = Device("n1-gpu-0", "n1", 0, "h100", 81559, gpu=True)
    event = device_memory_event(device, Overhead(640 * 2**20, "process"), 3)
    assert (event.kind, event.step) == ("device_memory", 3)
    assert event.data == {"device_id": "n1-gpu-0", "overhead_bytes": 640 * 2**20, "how": "process"}
    assert event.message == (
        "device n1-gpu-0 (h100): 640.0 MiB of its 79.6 GiB held before any stage or shard (CUDA"
        " context, kernels, library workspaces; nvidia-smi's count for the worker)"
    )


@pytest.mark.unit
def test_stages_plan_in_the_declared_memory_less_the_overhead() -> None:
    device = Device("n1-gpu-0", "n1", 0, "h100", 2048, gpu=True)
    assert device.usable_bytes == 2048 * 2**20
    measured = Device("n1-gpu-0", "n1", 0, "h100", 2048, gpu=True, overhead_mb=600)
    assert measured.usable_bytes == 1448 * 2**20
    over = Device("n1-gpu-0", "n1", 0, "h100", 512, gpu=True, overhead_mb=600)
    assert over.usable_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_worker_measures_its_context_and_workspaces() -> None:
    """The overhead is at least the allocator's workspaces and at most the device."""
    device = torch.device("cuda", 0)
    overhead = measure_overhead(device)
    _, total = torch.cuda.mem_get_info(device)
    assert overhead.how in ("process", "device"), overhead
    assert torch.cuda.memory_reserved(device) <= overhead.bytes <= total, overhead
    assert overhead.bytes >= 64 * 2**20, overhead  # a context alone is larger (H200: ~0.5 GiB)
