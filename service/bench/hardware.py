"""What a bench says about the device it ran on: the machine with its GPU, and the GPU's
host-to-device copy bandwidth."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from shoal.service.bench.report import machine


def machine_with(device: torch.device) -> dict[str, Any]:
    """``report.machine()`` with the memory, and the GPU when the bench runs on one."""
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    extra: dict[str, Any] = {
        "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1) if pages else None
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        extra |= {
            "gpu": props.name,
            "gpus": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        }
    return {**machine(), **extra}


def device_name(device: torch.device) -> str:
    """``cpu``, or the GPU's name."""
    return "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)


def host_to_device_gbps(device: torch.device, size: int = 256 * 2**20, repeats: int = 5) -> float:
    """GB/s of a ``size``-byte copy from page-locked host memory to ``device`` (a CUDA GPU),
    the median of ``repeats``: the way a SHARP shard comes in (``workers.sharp.pinned``)."""
    source = torch.empty(size, dtype=torch.uint8).pin_memory()
    target = torch.empty(size, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(repeats + 1):  # the first copy warms the path up, untimed
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return size / statistics.median(seconds[1:]) / 1e9
