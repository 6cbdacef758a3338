"""How long each job's runner has gone without answering the controller's polls.

A runner answers its polls on a thread of its own while it trains, within milliseconds. One
that never answers (its actor never created, its process wedged) would otherwise keep its
job RUNNING forever, each tick's poll waiting out the Ray timeout: past ``limit_s`` of
unanswered polls in a row the controller takes the runner for lost (``service.controller``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Silences:
    """Per job, since when its runner's polls have gone unanswered (none: it answered)."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, not {limit_s}")
        self.limit_s = limit_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def answered(self, job_id: str) -> None:
        self._since.pop(job_id, None)

    def unanswered(self, job_id: str) -> float | None:
        """A poll went unanswered: the seconds since the first of them in a row, once they
        reach the limit (the count starts again), else None."""
        now = self._clock()
        since = self._since.setdefault(job_id, now)
        if now - since < self.limit_s:
            return None
        del self._since[job_id]
        return now - since
