"""Writing a pipeline runner's checkpoints off the step's path: one writer thread, in order.

The runner gathers the blocks' states at the step boundary (they are the boundary's state,
copied out of the stages), then hands the write (serialize, checksum, fsync, rename,
retention: ``workers.checkpoints``) to this thread and trains on. Writes run one at a time,
in the order given, so retention and the ``checkpoint`` events keep their order; an event
is recorded when its checkpoint is complete, never before. A failed write fails the run at
its next boundary (or at the end), as a failed write in the step's path did.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from shoal.workers.snapshot import RunnerEvent


class CheckpointWriter:
    """Runs checkpoint writes on one thread; ``record`` gets each write's event."""

    def __init__(self, record: Callable[[RunnerEvent], None]) -> None:
        self._record = record
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoints")
        self._pending: list[Future[RunnerEvent]] = []

    def submit(self, write: Callable[[], RunnerEvent]) -> None:
        """Queue ``write``; raises first the error of an earlier write that failed."""
        self._raise_failed()
        future = self._pool.submit(self._write, write)
        self._pending.append(future)

    def _write(self, write: Callable[[], RunnerEvent]) -> RunnerEvent:
        event = write()
        self._record(event)
        return event

    def flush(self) -> None:
        """Wait until every queued write is complete; raise the first one's error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for the queued writes (their errors are the run's to report, not raised
        here) and stop the thread."""
        self._pool.shutdown(wait=True)
        self._pending.clear()

    def _raise_failed(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()
