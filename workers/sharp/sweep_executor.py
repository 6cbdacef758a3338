"""A sweep's SHARP executor as the control plane drives it: the actor around ``SharpTrainer``.

``workers.actors`` runs ``SweepExecutor`` as a detached, threaded Ray actor named after the
sweep (an in-process cluster runs it on a thread): ``run`` trains on one thread while the
others add trials, cancel pruned ones, suspend those leaving with the sweep for other
devices, and answer polls; ``close`` lets it end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import Policy
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import PoolFactory
from shoal.workers.snapshot import JobSnapshot, RunnerReport, RunStatus


class SweepExecutor:
    """One sweep's trials on its devices; trials come and go while it runs."""

    def __init__(
        self, devices: Sequence[Device], make_pool: PoolFactory | None = None, policy: str = "lrtf"
    ) -> None:
        from shoal.workers.sharp.shard_pool import RayPool

        self._trainer = SharpTrainer(
            (),
            devices,
            make_pool or RayPool,
            budgets={d.id: d.usable_bytes for d in devices},
            policy=Policy(policy),
            keep_open=True,
        )
        self._started = False
        self._lock = threading.Lock()

    def run(self) -> dict[str, RunStatus]:
        """Train until closed and every trial has ended; a second call returns at once."""
        with self._lock:
            if self._started:
                return {}
            self._started = True
        return self._trainer.run()

    def add(self, snap: JobSnapshot) -> None:
        self._trainer.add(snap)

    def cancel(self, job_id: str) -> None:
        self._trainer.cancel(job_id)

    def suspend(self, job_id: str) -> None:
        self._trainer.suspend(job_id)

    def lost_devices(self) -> list[str]:
        return self._trainer.lost_devices()

    def close(self) -> None:
        self._trainer.close()

    def poll(self, job_id: str, cursor: int) -> RunnerReport:
        return self._trainer.report(job_id, cursor)
