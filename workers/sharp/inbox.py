"""What other threads ask of the SHARP executor, held until its loop takes it.

The control plane adds models (a sweep's trials), cancels and suspends them and closes the
executor from its own threads; the checkpoint writer stops a model whose checkpoint failed.
The executor's loop takes those requests between its rounds, so every change to the
models happens on its one thread. ``Inbox`` keeps them under one lock and wakes the loop
when one comes while it waits with nothing in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

from shoal.workers.snapshot import JobSnapshot, RunStatus

IDLE_WAIT_S = 1.0
"""How long the loop sleeps with nothing in flight before it looks again."""


class Inbox:
    """Models to add, stop or suspend, and whether more may come."""

    def __init__(self, keep_open: bool) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._incoming: list[JobSnapshot] = []
        self._stopping: dict[str, tuple[RunStatus, str | None]] = {}
        """Models to end, with how, once they have no task in flight."""
        self._suspending: set[str] = set()
        """Models to checkpoint and end SUSPENDED at their next step boundary."""
        self._open = keep_open
        self._stopped: str | None = None

    # ------------------------------------------------------------------ other threads

    def add(self, snap: JobSnapshot, training: Collection[str]) -> None:
        """Train ``snap`` too, unless it is among ``training`` or already waiting; requests
        left for an earlier run of it are dropped."""
        with self._lock:
            if snap.job_id in {*training, *(s.job_id for s in self._incoming)}:
                raise ValueError(f"model {snap.job_id} is already trained here")
            self._suspending.discard(snap.job_id)
            self._stopping.pop(snap.job_id, None)
            self._incoming.append(snap)
        self._wakeup.set()

    def stop(self, job_id: str, status: RunStatus, error: str | None) -> None:
        """End ``job_id`` ``status`` (with ``error``) once no task of it is in flight; the
        first request stands."""
        with self._lock:
            self._stopping.setdefault(job_id, (status, error))
        self._wakeup.set()

    def suspend(self, job_id: str) -> None:
        with self._lock:
            self._suspending.add(job_id)

    def close(self) -> None:
        """No more models come."""
        with self._lock:
            self._open = False
        self._wakeup.set()

    @property
    def stopped(self) -> str | None:
        """Why the executor has stopped, once it has: a model added after that fails so."""
        with self._lock:
            return self._stopped

    # ------------------------------------------------------------------ the loop's side

    def arriving(self) -> bool:
        """Whether models were added since ``arrivals`` last took them."""
        with self._lock:
            return bool(self._incoming)

    def arrivals(self) -> list[JobSnapshot]:
        """The models added since the last call, taken."""
        with self._lock:
            arriving, self._incoming = self._incoming, []
        return arriving

    def stops(self, ready: Callable[[str], bool]) -> list[tuple[str, RunStatus, str | None]]:
        """The stop requests of the models ``ready`` to end, taken; the others wait."""
        with self._lock:
            taken = [j for j in self._stopping if ready(j)]
            return [(j, *self._stopping.pop(j)) for j in taken]

    def suspending(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._suspending

    def suspended(self, job_id: str) -> None:
        """``job_id``'s suspension is under way: the request is done."""
        with self._lock:
            self._suspending.discard(job_id)

    def begin_round(self) -> None:
        """The loop looks at every request from here on: a wakeup before is spent."""
        self._wakeup.clear()

    def wait_for_more(self) -> bool:
        """With nothing in flight: wait for a request (at most ``IDLE_WAIT_S``) if more
        models may come, and say whether they may."""
        with self._lock:
            more = self._open or bool(self._incoming)
        if more:
            self._wakeup.wait(timeout=IDLE_WAIT_S)
        return more

    def end(self, reason: str) -> None:
        """The executor has stopped, for ``reason`` (the first given stands)."""
        with self._lock:
            self._open = False
            self._stopped = self._stopped or reason
