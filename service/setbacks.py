"""What the controller remembers of jobs that cannot get going: how many times in a row a job
was started again without passing a step (its runner died, or a worker of it did not start),
and the devices a worker did not start on, which new placements leave alone for a while.

A worker that is not built within its group's start timeout (300 s) is waiting for a device
held by something Shoal does not know of, on a node not answering, or building blocks that
take longer than that. Placing on the device again at once would most likely wait as long
again; a job sent elsewhere may train meanwhile, and one that keeps failing to start fails,
saying why, rather than waiting for ever.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from shoal.workers.snapshot import RunnerEvent

MAX_RESTARTS = 3
"""Restarts in a row without the job passing a step, beyond which the next setback fails it."""
UNREADY_S = 600.0
"""How long new placements leave a device alone after a worker did not start on it."""


class Setbacks:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._restarts: dict[str, tuple[int, int]] = {}
        """Per job: the step of its last setback, and how many in a row there."""
        self._unready: dict[str, float] = {}
        """Devices a worker did not start on: until when placements leave them alone."""

    def restarts(self, job_id: str, step: int) -> int:
        """``job_id`` had a setback at ``step``: how many in a row without it passing a step
        (1 when it passed one since the last)."""
        last, count = self._restarts.get(job_id, (-1, 0))
        count = count + 1 if step <= last else 1
        self._restarts[job_id] = (step, count)
        return count

    def forget(self, job_id: str) -> None:
        self._restarts.pop(job_id, None)

    def not_started(self, events: Sequence[RunnerEvent]) -> bool:
        """Leave the devices ``events`` say a worker did not start on alone for
        ``UNREADY_S``; whether there was any."""
        until = self._clock() + UNREADY_S
        devices = [e.data["device_id"] for e in events if e.kind == "worker_not_started"]
        self._unready.update(dict.fromkeys(devices, until))
        return bool(devices)

    def unready(self) -> set[str]:
        """The devices new placements leave alone now."""
        now = self._clock()
        self._unready = {d: until for d, until in self._unready.items() if until > now}
        return set(self._unready)
