"""One run's progress as its runner reports it: a job's under the pipeline runner, a model's
under the SHARP executor.

The training thread records metrics and events and ends the run; the control plane's poll
reads ``report`` from another thread. Both go through the log's lock, so a report is
always one moment's: the items up to its cursor, the step they reached and the status.
"""

from __future__ import annotations

import threading

from shoal.workers.snapshot import RunnerEvent, RunnerReport, RunStatus, StepMetrics


class RunLog:
    """Metrics and events in the order they happened, the last step and how the run ended."""

    def __init__(self, status: RunStatus = RunStatus.RUNNING, error: str | None = None) -> None:
        self._lock = threading.Lock()
        self._items: list[StepMetrics | RunnerEvent] = []
        self._step = 0
        self._status = status
        self._error = error
        self._lost: tuple[str, ...] = ()

    @property
    def status(self) -> RunStatus:
        return self._status

    @property
    def step(self) -> int:
        """The step the run has reached: its last metrics', or where it resumed."""
        return self._step

    def record(self, item: StepMetrics | RunnerEvent) -> None:
        with self._lock:
            self._items.append(item)
            if isinstance(item, StepMetrics):
                self._step = item.step

    def last_metrics(self) -> StepMetrics | None:
        """The metrics of the last step recorded, if any."""
        with self._lock:
            return next((m for m in reversed(self._items) if isinstance(m, StepMetrics)), None)

    def resumed_at(self, step: int) -> None:
        """The run goes on from a checkpoint of ``step``."""
        with self._lock:
            self._step = step

    def end(
        self, status: RunStatus, error: str | None = None, lost: tuple[str, ...] = ()
    ) -> RunStatus:
        """The run ended ``status``, with why (``error``) and, ``LOST``, the devices gone."""
        with self._lock:
            self._status, self._error, self._lost = status, error, lost
        return status

    def fail_if_running(self, error: str) -> None:
        """FAILED with ``error``, unless the run has ended already."""
        with self._lock:
            if self._status is RunStatus.RUNNING:
                self._status, self._error = RunStatus.FAILED, error

    def report(self, cursor: int) -> RunnerReport:
        """What was recorded after ``cursor`` (0: from the start), and the status."""
        with self._lock:
            news = self._items[max(0, cursor) :]
            return RunnerReport(
                status=self._status,
                cursor=len(self._items),
                step=self._step,
                metrics=tuple(m for m in news if isinstance(m, StepMetrics)),
                events=tuple(e for e in news if isinstance(e, RunnerEvent)),
                error=self._error,
                lost_devices=self._lost,
            )
