"""Where a stage's step time goes: compute, transfer, waiting on neighbours, all-reduce.

On a CPU device each part is wall time. On a CUDA device a part is measured where it
happens, on the device: a pair of CUDA events around it, read once per step (``lap``), so
timing never synchronizes the device per micro-batch. An NCCL all-reduce or receive runs
on NCCL's streams and makes the compute stream wait; the events around that wait book it
as all-reduce or wait time, never as compute (the elastic policy plans on compute). Not
yet measured on a GPU.

A part measured inside another is that part's alone: the outer part's time leaves it out
(ZeRO-3 gathers a block's parameters inside its forward: all-reduce time, not compute).

A device's ``emulate_slowdown`` factor f > 1 (virtual devices in tests and benches) makes
compute sleep (f - 1) x its measured time, counted as compute: a straggler is visible only
through measured times, as a real slow device would be.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

PARTS = ("compute", "transfer", "wait", "allreduce", "copy")

Timed = Callable[[str], AbstractContextManager[None]]
"""Times what runs inside it as the part named (``StepTimer.span``)."""


def untimed(part: str) -> AbstractContextManager[None]:
    """Times nothing (the collectives used outside a stage: tests, benches)."""
    return nullcontext()


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


@dataclass
class _Span:
    """One timed part in progress or awaiting its CUDA events (``start`` None: wall clock)."""

    part: str
    start: Any = None
    end: Any = None
    inner_s: float = 0.0
    """Wall-clock seconds of the parts timed inside it."""
    inner: list[_Span] = field(default_factory=list)
    """The parts timed inside it by CUDA events."""

    def elapsed_s(self) -> float:
        """Seconds between its CUDA events."""
        return float(self.start.elapsed_time(self.end)) / 1000.0

    def own_s(self) -> float:
        """Its seconds less those of the parts inside it."""
        return self.elapsed_s() - self.inner_s - sum(span.elapsed_s() for span in self.inner)


class StepTimer:
    """Accumulates each part's seconds until ``lap``."""

    def __init__(self, device: torch.device, slowdown: float = 1.0) -> None:
        self._cuda, self._device = device.type == "cuda", device
        self._slowdown = max(1.0, slowdown)
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._events: list[_Span] = []
        self._open: list[_Span] = []
        self._copy_from: float | None = None

    def copying(self) -> None:
        """An in-memory copy starts: everything until the next step's first timed part is
        booked as ``copy``. That takes in the runner's turnaround the copy's boundary puts
        between two steps: what the step would not have waited for without the copy."""
        if self._copy_from is None:
            self._copy_from = time.perf_counter()

    def moved(self, device: torch.device) -> None:
        """What it times runs on ``device`` from now on (a SHARP shard's stage, between host
        memory and its GPU): on a GPU, timed by CUDA events, as if it had started there."""
        self._cuda, self._device = device.type == "cuda", device

    def add(self, part: str, seconds: float) -> None:
        """Book ``seconds`` spent elsewhere (another thread on this device) as ``part``."""
        self._seconds[part] += seconds

    @contextmanager
    def span(self, part: str) -> Iterator[None]:
        """Time the block as ``part`` (less the parts timed inside it)."""
        if self._copy_from is not None:
            self._seconds["copy"] += time.perf_counter() - self._copy_from
            self._copy_from = None
        slowed = part == "compute" and self._slowdown > 1.0
        outer = self._open[-1] if self._open else None
        # CUDA events, unless the sleep needs the real time, or a part around this one
        # is timed by the wall clock (which then takes this one's time out of its own).
        events = self._cuda and not slowed and (outer is None or outer.start is not None)
        span = _Span(part, _event() if events else None, _event() if events else None)
        self._open.append(span)
        started = time.perf_counter()
        try:
            if events:
                span.start.record()
                yield
                span.end.record()
                self._events.append(span)
                if outer is not None:
                    outer.inner.append(span)
                return
            yield
            if self._cuda:  # the wall clock on a GPU: the device must be done
                torch.cuda.synchronize(self._device)
            if slowed:
                time.sleep((self._slowdown - 1.0) * (time.perf_counter() - started - span.inner_s))
            elapsed = time.perf_counter() - started
            self._seconds[part] += elapsed - span.inner_s
            if outer is not None:
                outer.inner_s += elapsed
        finally:
            self._open.pop()

    def lap(self) -> StepClock:
        """The seconds of each part since the last lap; restart the counts. On CUDA this
        waits for the device to reach the last recorded event: call it once per step."""
        if self._events:
            self._events[-1].end.synchronize()
            for span in self._events:
                self._seconds[span.part] += span.own_s()
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
