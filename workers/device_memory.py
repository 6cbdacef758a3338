"""What a device holds for a worker before the worker's first tensor: its fixed overhead.

A process on a CUDA device pays, before it holds any tensor of its own, for its CUDA
context, the kernels it loads and its libraries' handles and workspaces (cuBLAS reserves its
workspaces through PyTorch's allocator at the first matrix product). On an H200 with torch
2.11 that came to roughly 0.5-0.8 GiB per process (docs/architecture.md, "Memory"): memory
the device's declared size does not have for stages. ``measure_overhead`` warms the device
up the way a stage's first step would (a float32 and a bfloat16 matrix product, forward and
backward) and reads what the process then holds:

- ``nvidia-smi``'s count for this process, where it lists the process;
- else the memory the whole device has in use (``torch.cuda.mem_get_info``), which also
  counts other processes on the same GPU: an overestimate, on the safe side.

A CPU device's memory is the host's; a worker on one holds nothing apart: no overhead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import torch

from shoal.scheduler.devices import Device
from shoal.scheduler.memory import format_bytes
from shoal.workers.device_fault import own_use
from shoal.workers.snapshot import RunnerEvent

_SMI_TIMEOUT_S = 10.0

_HOW = {
    "process": "nvidia-smi's count for the worker",
    "device": "the device's memory in use, other processes' too",
}


@dataclass(frozen=True)
class Overhead:
    """Bytes a device holds for a worker before its stage's tensors, and how measured:
    ``process`` (nvidia-smi's count for the worker), ``device`` (the device's memory in use:
    other processes too) or ``none`` (a CPU device)."""

    bytes: int
    how: str


def measure_overhead(device: torch.device) -> Overhead:
    """The fixed overhead of this process on ``device``, after a warm-up (module docstring).
    Call it before the worker allocates anything of its own."""
    if device.type != "cuda":
        return Overhead(0, "none")
    with own_use(device, "started on it"):
        _warm_up(device)
    used = _process_bytes(os.getpid())
    if used is not None:
        return Overhead(used, "process")
    free, total = torch.cuda.mem_get_info(device)
    return Overhead(total - free, "device")


def grow_segments_in_place(device: torch.device) -> None:
    """Have PyTorch's caching allocator grow its memory segments in place
    (``expandable_segments``) in this process, where ``device`` is a GPU. A SHARP device
    alternates shards and activations of many sizes: with fixed segments, a free block too
    small for the next request stays reserved beside the new segment made for it, memory
    that no account of what the device holds names (on an H200, without it, two of the four
    SHARP cases of the GPU memory test reserved more than their host accounted for:
    docs/architecture.md, "Memory"). Call it before the process's
    first allocation: segments made before keep their kind. (PyTorch sets it at run time
    only by a private call, the one ``torch.cuda.memory._set_allocator_settings`` points to
    since it was deprecated; ``PYTORCH_CUDA_ALLOC_CONF`` is read once, too early here.)"""
    if device.type == "cuda":
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")


def _warm_up(device: torch.device) -> None:
    """What a stage's first step initialises besides its own tensors: the context, the
    matrix-product libraries and their workspaces, in float32 and under bf16 autocast."""
    a = torch.randn(256, 256, device=device, requires_grad=True)
    (a @ a).sum().backward()  # type: ignore[no-untyped-call]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).sum().backward()  # type: ignore[no-untyped-call]
    del a
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # keep the libraries' workspaces, drop the warm-up's tensors


def _process_bytes(pid: int) -> int | None:
    """What ``nvidia-smi`` says process ``pid`` uses on the GPUs, in bytes; None where it
    is missing, fails or does not list the process (a container may hide the ids)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_process_mib(out, pid)


def parse_process_mib(smi_csv: str, pid: int) -> int | None:
    """The bytes ``pid`` uses in ``nvidia-smi --query-compute-apps=pid,used_memory
    --format=csv,noheader,nounits`` output (summed over GPUs); None when not listed."""
    found = None
    for line in smi_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit() or int(parts[0]) != pid:
            continue
        try:
            mib = int(float(parts[1]))
        except ValueError:  # "[N/A]" where the driver does not say
            continue
        found = (found or 0) + mib * 2**20
    return found


def device_memory_event(device: Device, overhead: Overhead, step: int) -> RunnerEvent:
    """The event that reports a device's measured overhead; the control plane keeps it with
    the device and plans its stages (or a sweep's shards) in the rest
    (``scheduler.devices.usable_bytes``)."""
    return RunnerEvent(
        "device_memory",
        step,
        f"device {device.id} ({device.kind}): {format_bytes(overhead.bytes)} of its"
        f" {format_bytes(device.memory_mb * 2**20)} held before any stage or shard (CUDA context,"
        f" kernels, library workspaces; {_HOW.get(overhead.how, overhead.how)})",
        {"device_id": device.id, "overhead_bytes": overhead.bytes, "how": overhead.how},
    )
