"""A job's runner as Ray runs it: ``workers.actors`` starts ``JobRunner`` as the job's
detached actor; ``run`` trains on one of its threads (``workers.pipeline.runner.Trainer``),
``poll``, ``cancel``, ``suspend`` and ``relayout`` answer from the others."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.rebalance import snapshot_policy
from shoal.workers.pipeline.runner import DEFAULT_STEP_TIMEOUT_S, Trainer
from shoal.workers.pipeline.worker_group import GroupFactory
from shoal.workers.snapshot import JobSnapshot, RunnerReport, RunStatus, StagePlan


class JobRunner:
    """One job's runner; ``workers.actors`` runs it as a detached, threaded Ray actor."""

    def __init__(
        self,
        snapshot: JobSnapshot,
        make_group: GroupFactory = RayGroup,
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        self._trainer = Trainer(
            snapshot,
            make_group,
            step_timeout_s=step_timeout_s,
            policy=snapshot_policy(snapshot),
        )
        self._started = False
        self._lock = threading.Lock()

    def run(self) -> RunStatus:
        """Train (blocking until the job ends); a second call returns the status at once."""
        with self._lock:
            if self._started:
                return self._trainer.status
            self._started = True
        return self._trainer.run()

    def poll(self, cursor: int) -> RunnerReport:
        return self._trainer.report(cursor)

    def cancel(self) -> None:
        self._trainer.cancel()

    def suspend(self) -> None:
        self._trainer.suspend()

    def relayout(self, plans: Sequence[StagePlan], split: Sequence[int]) -> None:
        self._trainer.relayout(plans, split)
