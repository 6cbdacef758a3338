"""``shoal bench copier``: what a worker's in-memory copies cost its steps, measured apart
from the engine: a plain PyTorch loop (``plain_loop.PlainLoop``) in this process that takes
Shoal's copies itself (``workers.pipeline.copier.Copier``, as a stage takes them: started at
a step boundary, each block's optimizer step waiting for its copy) in every other window of
steps, and not in the others.

``copier="staged"`` takes the copies with a candidate instead (``bench.staged_copier``:
through a staging buffer on the device, a chunk at a time), to set beside Shoal's in the
same conditions.

The windows alternate within a second or two, so a machine whose speed drifts between
minutes (``shoal bench step``'s rounds on a GPU scattered by +-30%) compares steps made
side by side; each round runs one window of each, in turn first. Set beside ``shoal bench
step``'s ``copies_overhead`` (the whole job's, in alternate windows of one job the same
way), it tells the copier's own cost from what the copies cost the engine around it (its
calls, its runner, Ray)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from shoal.service.bench.hardware import device_name, machine_with
from shoal.service.bench.pipeline import threads
from shoal.service.bench.plain_loop import PlainLoop, sync
from shoal.service.bench.report import Progress
from shoal.service.bench.staged_copier import StagedCopier
from shoal.service.bench.step_settings import StepSettings
from shoal.workers.blocks import tensors_in
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.pipeline.copier import Copier
from shoal.workers.pipeline.stage import OWN_COPIES

COPIER_PHASES = ("without copies", "with copies")

COPIERS = ("tensors", "staged")
"""Who takes the copies: Shoal's ``Copier`` (each tensor on its own), or the candidate
``StagedCopier``."""


@dataclass(frozen=True)
class CopierSettings:
    """What ``shoal bench copier`` runs: ``model`` at ``size`` (``shoal bench step``'s) on
    ``device``, ``warmup`` untimed steps, then ``rounds`` rounds of two windows of ``steps``
    steps, one copying at every ``every``-th boundary."""

    device: str = "cpu"
    model: str = "gpt"
    size: str = "small"
    every: int = 3
    steps: int = 12
    rounds: int = 5
    warmup: int = 3
    seed: int = 0
    copier: str = "tensors"

    def __post_init__(self) -> None:
        if self.copier not in COPIERS:
            raise ValueError(f"copier {self.copier!r} is none of {', '.join(COPIERS)}")
        if min(self.every, self.steps, self.rounds, self.warmup) < 1:
            raise ValueError("every, steps, rounds and warmup must be >= 1")
        if self.steps % self.every:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of every ({self.every}): a window's"
                " last copy is then waited for within it, not in the window after"
            )
        _ = self.step  # the step bench's settings refuse a device, model or size it lacks

    @property
    def step(self) -> StepSettings:
        return StepSettings(device=self.device, model=self.model, size=self.size, seed=self.seed)


def run_copier(s: CopierSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Measure what ``shoal bench copier`` reports (module docstring)."""
    started = time.perf_counter()
    retain_freed_memory()  # as Shoal's workers keep it (workers.host_memory)
    loop = PlainLoop(s.step)
    copier: Copier | StagedCopier = (
        StagedCopier(loop.device, OWN_COPIES)
        if s.copier == "staged"
        else Copier(loop.device, OWN_COPIES)
    )
    clock = _Clock(loop, copier, s.every)
    rounds = []
    with threads(1 if loop.device.type == "cpu" else None):
        for _ in range(s.warmup):
            clock.step(copying=False)
        copier.reserve(loop.blocks)  # the host memory every copy alive at once needs, once
        for n in range(s.rounds):
            order = (False, True) if n % 2 == 0 else (True, False)
            windows = {}
            for copying in order:
                progress(f"round {n + 1}/{s.rounds}: {COPIER_PHASES[copying]}")
                windows[copying] = clock.window(s.steps, copying=copying)
            rounds.append(_round(windows[False], windows[True]))
        copier.settle()
    return _result(s, loop, rounds, started)


@dataclass
class _Window:
    steps_s: list[float]
    starts_s: list[float]


class _Clock:
    """Steps ``loop``, timing each, and where copying, starts a copy at every ``every``-th
    boundary (its start timed apart too)."""

    def __init__(self, loop: PlainLoop, copier: Copier | StagedCopier, every: int) -> None:
        self._loop, self._copier, self._every = loop, copier, every
        self._done = 0
        self._copies = 0

    def window(self, steps: int, *, copying: bool) -> _Window:
        window = _Window([], [])
        for i in range(steps):
            window.steps_s.append(
                self.step(copying=copying and i % self._every == 0, window=window)
            )
        return window

    def step(self, *, copying: bool, window: _Window | None = None) -> float:
        """One step, a copy of the boundary before it started first where ``copying``; its
        seconds, the copy's start among them (booked as a job books it)."""
        loop = self._loop
        sync(loop.device)
        began = time.perf_counter()
        if copying:
            self._copies += 1
            self._copier.start(self._done, self._copies, loop.blocks)
            if window is not None:
                window.starts_s.append(time.perf_counter() - began)
        loop.step(self._done, self._copier.guard)
        sync(loop.device)
        self._done += 1
        return time.perf_counter() - began


@dataclass(frozen=True)
class _Round:
    overhead: float
    """1 - the window without copies' seconds over the one with them."""
    copy_extra_ms: float
    """The window with copies' extra milliseconds, per copy."""
    step_ms: list[float]
    copies_step_ms: list[float]
    start_ms: list[float]
    """Each copy's start (``Copier.start``) in the window with copies."""


def _round(off: _Window, on: _Window) -> _Round:
    extra = sum(on.steps_s) - sum(off.steps_s)
    return _Round(
        extra / sum(on.steps_s),
        1000 * extra / len(on.starts_s),
        _ms(off.steps_s),
        _ms(on.steps_s),
        _ms(on.starts_s),
    )


def _result(
    s: CopierSettings, loop: PlainLoop, rounds: list[_Round], started: float
) -> dict[str, Any]:
    state = [t for b in loop.blocks for t in tensors_in(b.live_state())]
    return {
        "copies_overhead": statistics.median(r.overhead for r in rounds),
        "copy_extra_ms": statistics.median(r.copy_extra_ms for r in rounds),
        "copy_start_ms": statistics.median(v for r in rounds for v in r.start_ms),
        "step_ms": statistics.median(v for r in rounds for v in r.step_ms),
        "copies_step_ms": statistics.median(v for r in rounds for v in r.copies_step_ms),
        "copy_every": s.every,
        "copier": s.copier,
        "state_bytes": sum(t.numel() * t.element_size() for t in state),
        "state_tensors": len(state),
        "model": s.step.describe(),
        "device": device_name(loop.device),
        "settings": asdict(s),
        "rounds": [asdict(r) for r in rounds],
        "machine": machine_with(loop.device),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _ms(seconds: list[float]) -> list[float]:
    return [round(1000 * v, 3) for v in seconds]
