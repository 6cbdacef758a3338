"""Where a stage's step time goes: compute, transfer, waiting on neighbours, all-reduce.

On a CPU device each part is wall time. On a CUDA device a part is measured where it
happens, on the device: a pair of CUDA events around it, read once per step (``lap``), so
timing never synchronizes the device per micro-batch. An NCCL all-reduce or receive runs
on NCCL's streams and makes the compute stream wait; the events around that wait book it
as all-reduce or wait time, never as compute (the elastic policy plans on compute). Not
yet measured on a GPU.

A device's ``emulate_slowdown`` factor f > 1 (virtual devices in tests and benches) makes
compute sleep (f - 1) x its measured time, counted as compute: a straggler is visible only
through measured times, as a real slow device would be.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

PARTS = ("compute", "transfer", "wait", "allreduce", "copy")


@dataclass(frozen=True)
class StepClock:
    """Seconds one stage spent in one step computing, moving activations and gradients
    (turning them into and out of their wire form), waiting for its neighbours' transfers,
    summing gradients over its replicas, and on in-memory copies (``workers.pipeline.recovery``):
    the turnaround a copy's boundary costs, waiting for the copy before the optimizer step,
    and on a CPU device the copying thread's time."""

    compute_s: float
    transfer_s: float
    wait_s: float = 0.0
    allreduce_s: float = 0.0
    copy_s: float = 0.0


class StepTimer:
    """Accumulates each part's seconds until ``lap``."""

    def __init__(self, device: torch.device, slowdown: float = 1.0) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._slowdown = max(1.0, slowdown)
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._events: list[tuple[str, Any, Any]] = []
        self._copy_from: float | None = None

    def copying(self) -> None:
        """An in-memory copy starts: everything until the next step's first timed part is
        booked as ``copy``. That takes in the runner's turnaround the copy's boundary puts
        between two steps: what the step would not have waited for without the copy."""
        if self._copy_from is None:
            self._copy_from = time.perf_counter()

    def add(self, part: str, seconds: float) -> None:
        """Book ``seconds`` spent elsewhere (another thread on this device) as ``part``."""
        self._seconds[part] += seconds

    @contextmanager
    def span(self, part: str) -> Iterator[None]:
        """Time the block as ``part``."""
        if self._copy_from is not None:
            self._seconds["copy"] += time.perf_counter() - self._copy_from
            self._copy_from = None
        if self._cuda and not (part == "compute" and self._slowdown > 1.0):
            start, end = _event(), _event()
            start.record()
            yield
            end.record()
            self._events.append((part, start, end))
            return
        started = time.perf_counter()
        yield
        if self._cuda:  # an emulated straggler on a GPU: the sleep needs the real time
            torch.cuda.synchronize(self._device)
        if part == "compute" and self._slowdown > 1.0:
            time.sleep((self._slowdown - 1.0) * (time.perf_counter() - started))
        self._seconds[part] += time.perf_counter() - started

    def lap(self) -> StepClock:
        """The seconds of each part since the last lap; restart the counts. On CUDA this
        waits for the device to reach the last recorded event: call it once per step."""
        if self._events:
            self._events[-1][2].synchronize()
            for part, start, end in self._events:
                self._seconds[part] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        seconds, self._seconds = self._seconds, dict.fromkeys(PARTS, 0.0)
        return StepClock(
            seconds["compute"],
            seconds["transfer"],
            seconds["wait"],
            seconds["allreduce"],
            seconds["copy"],
        )

    def reset(self) -> None:
        """Forget what was measured since the last lap (a rolled-back step)."""
        self._events.clear()
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._copy_from = None


def _event() -> Any:
    cuda: Any = torch.cuda  # torch's stubs leave Event untyped
    return cuda.Event(enable_timing=True)
