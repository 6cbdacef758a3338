"""How often the in-memory copies are taken: as often as their measured cost allows.

A copy of every worker's state (``workers.pipeline.recovery``) delays the step after it by the
seconds its workers spend taking and holding it (measured where they run, ``copy_s`` of a
stage's timing). Taken every k steps of s seconds, copies of c seconds cost c / (k s) of
the training time; the interval is the smallest k that keeps this within the job's budget
(``elastic.copy_budget``), at most ``LONGEST_INTERVAL``. A lost device replays at most k
steps: the steps since the last copy, or, while that copy is still on its way to the
buddy, the steps since the one before (``most_replayed``: more than k when the interval
has just shrunk, while a copy takes longer than the steps after it, or after a copy was
not made).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_BUDGET = 0.05
"""``elastic.copy_budget``'s default: copies may cost 5% of the training time."""

LONGEST_INTERVAL = 100
"""The most steps between two copies, however costly a copy: past this, a loss would replay
more than a checkpoint interval of a typical job, and the copy would serve little."""

_SAMPLES = 5
"""Copies and steps the cadence takes the median of: one slow copy does not move it."""


def copy_interval(
    copy_s: float, step_s: float, budget: float, longest: int = LONGEST_INTERVAL
) -> int:
    """The fewest steps between copies that keep ``copy_s`` per copy within ``budget`` of
    the training time at ``step_s`` a step (1 when copies are free, ``longest`` at most). A
    budget of 1 (the whole training time) sets no limit: a copy at every step."""
    if not budget > 0.0:
        raise ValueError(f"copy_budget must be > 0, got {budget}")
    if copy_s <= 0.0 or budget >= 1.0:
        return 1
    if step_s <= 0.0:
        return longest
    return max(1, min(longest, math.ceil(copy_s / (budget * step_s) - 1e-9)))


def copy_seconds(per_worker: Sequence[float], *, cores_shared: bool) -> float:
    """What one copy cost a step, from each worker's measured seconds of it: the slowest
    worker's, as every stage waits for it; or, where the workers' devices are CPU cores
    that take every core of the machine (``scheduler.overlap.leaves_a_core``), their sum:
    each worker's copying threads then take cores the others compute on."""
    if not per_worker:
        return 0.0
    return sum(per_worker) if cores_shared else max(per_worker)


def most_replayed(interval: int, step: int, kept: int | None) -> int:
    """The most steps a device lost after ``step`` steps (recorded) replays with copies
    every ``interval`` steps, the latest copy confirmed whole taken after ``kept`` steps:
    the interval, or the steps since that copy where more (a later one on its way, which the
    loss may cut short; one not made; the interval just shrunk). ``kept`` None: none is
    kept yet (a job placed anew replays nothing; else it resumes from its checkpoint)."""
    if kept is None:
        return interval
    return max(interval, step - kept)


@dataclass
class CopyCadence:
    """When a job's next copy is due, from what its copies and steps measured.

    ``observe`` takes every step as recorded: its time and the copy seconds its workers
    reported (the copy taken just before it, if any); where copies are measured apart from
    the steps (SHARP's), ``observe_step`` and ``observe_copy`` take each. ``plan``
    re-decides the interval at each copy; ``steps_to_next`` says when the next is due. The
    interval moves up as soon as the copies outgrow the budget, and down only when a
    quarter fewer steps would do, so it does not flap.
    """

    budget: float
    interval: int = 1
    _decided: bool = False
    _copies: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    _steps: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def observe(self, step_time_s: float, copy_s: float) -> None:
        """A step of ``step_time_s`` seconds, ``copy_s`` of them the copy before it. A copy
        made beside the step (a CPU device's copying thread, counted in ``copy_s``) can take
        longer than the step on a busy machine: the step's own time is then all of it (else
        no step would be measured and the interval never decided: a copy at every step)."""
        self.observe_copy(copy_s)
        self.observe_step(step_time_s - copy_s if step_time_s > copy_s else step_time_s)

    def observe_step(self, seconds: float) -> None:
        """A step that took ``seconds`` besides any copy."""
        if seconds > 0.0:
            self._steps.append(seconds)

    def observe_copy(self, seconds: float) -> None:
        """A copy that took ``seconds`` (measured apart from the steps)."""
        if seconds > 0.0:
            self._copies.append(seconds)

    def steps_to_next(self, taken: int | None, step: int) -> int:
        """Steps after ``step`` until a copy is due, the last taken after ``taken`` steps
        (None: none yet); 0: due now."""
        return 0 if taken is None else max(0, taken + self.interval - step)

    @property
    def decided(self) -> bool:
        """Whether the interval is known: measured, or 1 whatever the copies cost (a budget
        of the whole training time); else it is 1 as a guess."""
        return self._decided or self.budget >= 1.0

    @property
    def copy_s(self) -> float | None:
        return statistics.median(self._copies) if self._copies else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    @property
    def overhead(self) -> float | None:
        """The copies' share of the training time at the current interval."""
        copy_s, step_s = self.copy_s, self.step_s
        if copy_s is None or not step_s:
            return None
        return copy_s / (self.interval * step_s)

    def plan(self) -> bool:
        """Re-decide the interval from the measurements; whether this is news: the first
        decision, or a change."""
        copy_s, step_s = self.copy_s, self.step_s
        if copy_s is None or step_s is None:
            return False
        wanted = copy_interval(copy_s, step_s, self.budget)
        news = not self._decided
        self._decided = True
        if wanted > self.interval or wanted <= 0.75 * self.interval:
            news = news or wanted != self.interval
            self.interval = wanted
        return news
