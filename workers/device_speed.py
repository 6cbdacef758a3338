"""A device's speed: its measured float32 matrix-product rate, and the event that reports it.

Policies plan with relative speeds from it (``scheduler.profile``), and it is a CPU device's
peak in its jobs' MFU (``scheduler.mfu``). Stage workers measure it when a job starts, shard
workers when a sweep's first model is placed on their device.
"""

from __future__ import annotations

import torch

from shoal.scheduler.devices import Device
from shoal.workers.device_fault import own_use
from shoal.workers.pipeline.timing import StepTimer
from shoal.workers.snapshot import RunnerEvent

_SPEED_SIZE, _SPEED_REPEATS = 1024, 2
"""On a CPU: one thread's float32 matmul rate (~0.05 s a trial), within ~5% of its largest
matmuls' (256 measured 64 GFLOP/s where 2048 reached 85-95)."""
_CUDA_SPEED_SIZE, _CUDA_SPEED_REPEATS = 4096, 16
"""Large enough that a GPU's matmuls are compute-bound (256 measured an H100 at 55 GFLOP/s)."""
_SPEED_TRIALS = 3
"""The rate is the fastest trial's: a trial the process was interrupted in (another
process's burst, a collection) reads slow, and one slow read placed models by it."""


def measure_gflops(device: torch.device, slowdown: float = 1.0) -> float:
    """GFLOP/s of a fixed matmul on ``device`` (its fastest of a few trials), slowed like
    compute by a virtual device's ``slowdown`` (``workers.pipeline.timing``)."""
    cuda = device.type == "cuda"
    size = _CUDA_SPEED_SIZE if cuda else _SPEED_SIZE
    repeats = _CUDA_SPEED_REPEATS if cuda else _SPEED_REPEATS
    with own_use(device, "measured it"):
        # A constant matrix: drawing a random one would move the RNG that training uses.
        a = torch.full((size, size), 1.0 / size, device=device)
        torch.tanh(a @ a)  # warm-up: first-call allocation and kernel selection
        timer = StepTimer(device, slowdown)
        fastest_s = float("inf")
        for _ in range(_SPEED_TRIALS):
            with timer.span("compute"):
                for _ in range(repeats):
                    a = torch.tanh(a @ a)
            fastest_s = min(fastest_s, timer.lap().compute_s)
    return 2 * size**3 * repeats / fastest_s / 1e9


def device_speed_event(device: Device, gflops: float, step: int, **where: int) -> RunnerEvent:
    """The event that reports ``device``'s measured speed; the control plane keeps it with
    the device. ``where``: the stage and replica that measured it, if any."""
    return RunnerEvent(
        "device_speed",
        step,
        f"device {device.id} ({device.kind}): {gflops:.2f} GFLOP/s",
        {"device_id": device.id, **where, "gflops": gflops},
    )
