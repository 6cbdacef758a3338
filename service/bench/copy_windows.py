"""What one job's in-memory copies cost, measured in alternate windows of its steps
(``shoal bench step``).

Two runs a few seconds apart, one with copies and one without, cannot resolve a cost of a
few percent on a machine whose speed drifts by 15-40% between them (docs/benchmarks.md: a
GPU host's plain loop alone read 467-671 samples/s from one run to the next). So one job
takes its copies on its own cadence (``workers.pipeline.recovery.Copies``) in every other
window of steps and none in the windows between, and the copies' cost is one less the
paused windows' seconds over the copying ones', steps made a second or so apart.

A copying window opens with a copy due after ``after`` steps once the job has decided its
interval from measured copies (its first copies pin host memory, and come at a guessed
interval), and holds whole intervals of the cadence, at least ``steps`` steps: each copy
with the steps it runs beside. The paused window after it has as many steps; the next
copying window opens at its end with a copy, due by then whatever the interval. The
runner's calls end at every window's edge (``steps_to_next``), so each step's time falls in
one window. What this leaves out is a cost copies on would put on every step, copy or not
(the held copies' memory, say): none shows on the 2-core machine, where the paused windows'
steps took as long as those of a job without copies (docs/benchmarks.md). What it may count
in the wrong window is a copying window's last copy still under way as the paused window
starts (its steps are handed out before the copy is confirmed): the seconds the runner then
waited for it are each pair's ``tail`` (``CopyWindows.tails``), what the paused window may
hold of the copies' cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.recovery import Copies
from shoal.workers.pipeline.worker_group import WorkerGroup


@dataclass(frozen=True)
class Window:
    """The steps after ``start`` steps up to ``end`` (steps ``start + 1`` to ``end``)."""

    start: int
    end: int
    copying: bool


class CopyWindows:
    """Where the windows fall, from the copies as they are taken."""

    def __init__(self, after: int, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"a window holds at least one step, not {steps}")
        self.windows: list[Window] = []
        """The windows closed so far, copying and paused in turn."""
        self._after, self._steps = after, steps
        self._opened: int | None = None
        """Where the copying window under way opened."""
        self.tails: dict[int, float] = {}
        """By a copying window's end: the seconds the runner waited there for the copies
        taken in it (``confirmed``), its paused window's first steps already handed out."""

    def copied(self, step: int, interval: int, *, decided: bool = True) -> None:
        """A copy was taken after ``step`` steps, ``interval`` steps before the next is due
        (``decided``: measured, not the first guess)."""
        if self._opened is None:
            if step < self._after or not decided or self.closed(step) is not None:
                return  # before the windows, or a copy the job had to take (a new layout's)
            self._opened = step
        end = step + interval
        if end - self._opened >= self._steps:
            paused = 2 * end - self._opened
            self.windows += [Window(self._opened, end, True), Window(end, paused, False)]
            self._opened = None

    def confirmed(self, step: int, seconds: float) -> None:
        """The runner waited ``seconds`` after ``step`` steps for the copies before it to be
        held (``Copies.confirm``); kept where a copying window ends."""
        if any(w.copying and w.end == step for w in self.windows):
            self.tails[step] = seconds

    def closed(self, step: int) -> Window | None:
        """The closed window boundary ``step`` falls in, its end excluded: no copy is due
        there until its end. None where the job copies as it would."""
        return next((w for w in reversed(self.windows) if w.start <= step < w.end), None)

    def pairs(self, steps: int) -> list[tuple[Window, Window]]:
        """The copying windows and the paused one after each, those done within ``steps``
        (read from another thread too: a pair is added in one ``extend``)."""
        copying, paused = self.windows[::2], self.windows[1::2]
        return [(c, p) for c, p in zip(copying, paused, strict=True) if p.end <= steps]


class AlternateCopies(Copies):
    """A job's copies on their cadence in the copying ``windows`` only."""

    def __init__(self, budget: float, wait_s: float, windows: CopyWindows) -> None:
        super().__init__(budget, wait_s)
        self.windows = windows

    def steps_to_next(self, step: int) -> int:
        """As ``Copies``, but within a closed window: the steps to its end, where the
        runner's call ends (no copy is due before: 0 only where one is)."""
        window = self.windows.closed(step)
        return super().steps_to_next(step) if window is None else window.end - step

    def refresh(
        self, group: WorkerGroup, layout: Layout, step: int, *, fresh: bool = False
    ) -> None:
        super().refresh(group, layout, step, fresh=fresh)
        self.windows.copied(step, self.cadence.interval, decided=self.cadence.decided)

    def confirm(self, group: WorkerGroup, step: int, timeout: float) -> None:
        started = time.perf_counter()
        super().confirm(group, step, timeout)
        self.windows.confirmed(step, time.perf_counter() - started)


def window_seconds(
    times: Sequence[float], pairs: Sequence[tuple[Window, Window]]
) -> list[tuple[float, float]]:
    """Each pair's seconds, copying and paused, from each step's (``times[i]``: step
    ``i + 1``'s)."""
    return [(sum(times[c.start : c.end]), sum(times[p.start : p.end])) for c, p in pairs]


def windowed_overhead(seconds: Sequence[tuple[float, float]]) -> float:
    """The copies' share of the copying windows' time: one less the paused windows' seconds
    over the copying ones', over every pair (each pair's windows are equally long)."""
    copying = sum(c for c, _ in seconds)
    if not seconds or copying <= 0:
        raise ValueError("no pair of windows to compare")
    return 1.0 - sum(p for _, p in seconds) / copying
