"""The copies a ``ShardHost`` makes of its shards, from the task queue's call that starts one
(``copy``, or a task-copied ``backward``) to the ``copied`` call beside the tasks, which
hands it over once that call has ended (``HostPool.submit_after``).

A shard is a ``workers.pipeline.stage.Stage``; its ``Copier`` makes the copy: on a GPU on a
side stream while the device runs the tasks after ``copy`` (only the shard's next optimizer
step waits for it), on a CPU device within ``copy`` (``ShardHost._start_copy``).
What the copies cost the device is counted here: starting them, the waits for them their
tasks' clocks found (``book``), and on a CPU device the copying threads' CPU time (which a
task's clock may have drained first).
"""

from __future__ import annotations

import threading
import time

from shoal.workers.pipeline.stage import Stage
from shoal.workers.sharp.shard_types import ShardKey

CopyId = tuple[ShardKey, int]
"""A shard and the number of one of its copies."""


class HostCopies:
    def __init__(self) -> None:
        self._started: dict[CopyId, tuple[Stage, float]] = {}
        self._booked: dict[ShardKey, float] = {}
        self._lock = threading.Lock()

    def start(self, copy: CopyId, stage: Stage, step: int) -> None:
        """Start ``copy`` of ``stage``'s blocks as they are after ``step`` steps."""
        started = time.perf_counter()
        stage.copier.reserve(stage.blocks)
        stage.copier.start(step, copy[1], stage.blocks)
        with self._lock:
            self._started[copy] = (stage, time.perf_counter() - started)

    def take(self, copy: CopyId) -> tuple[Stage, float]:
        """The stage ``copy`` is made of and the seconds starting it took: its ``copied``
        runs once the call that started it has ended, so it was started, or never will be."""
        with self._lock:
            outcome = self._started.pop(copy, None)
        if outcome is None:
            raise LookupError(f"copy {copy[1]} of shard {copy[0]} was not started")
        return outcome

    def book(self, key: ShardKey, seconds: float) -> None:
        """Copy seconds a task of shard ``key`` found on its clock (``StepClock.copy_s``)."""
        if seconds > 0.0:
            with self._lock:
                self._booked[key] = self._booked.get(key, 0.0) + seconds

    def busy(self, key: ShardKey, stage: Stage, *, threads: bool) -> float:
        """What shard ``key``'s copies cost the device since this was last asked: what its
        tasks booked, and with ``threads`` (a CPU device) the copying threads' CPU time (on
        a GPU a side stream makes the copy: their time, waiting for it, is not the device's)."""
        with self._lock:
            booked = self._booked.pop(key, 0.0)
        spent = stage.copier.take_busy()
        return booked + (spent if threads else 0.0)
