"""A sweep's SHARP executor as the control plane drives it: the actor around ``SharpTrainer``.

``workers.actors`` runs ``SweepExecutor`` as a detached, threaded Ray actor named after the
sweep: it trains from its creation on a thread of its own (for the reason a job's runner
does: ``workers.pipeline.job_runner``) while the actor's threads add trials, cancel pruned
ones, suspend those leaving with the sweep for other devices, and answer polls; ``close``
lets it end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import Policy
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import PoolFactory
from shoal.workers.snapshot import JobSnapshot, RunnerReport


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
        self._training = threading.Thread(target=self._trainer.run, name="sharp", daemon=True)
        self._training.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether it has ended (closed, every trial ended), waiting up to ``timeout_s``."""
        self._training.join(timeout_s)
        return not self._training.is_alive()

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
