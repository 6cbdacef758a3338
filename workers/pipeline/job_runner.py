"""A job's runner as Ray runs it: ``workers.actors`` starts ``JobRunner`` as the job's
detached actor; it trains from its creation on a thread of its own
(``workers.pipeline.runner.Trainer``), and ``poll``, ``cancel``, ``suspend`` and
``relayout`` answer on the actor's threads meanwhile.

Training starts with the actor, not with a call after it: Ray queues a call made to an
actor still starting in its caller's process, so a control plane killed in the seconds a
runner takes to start would take the call along, and leave a runner that never trains."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

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
        # A daemon: a test that fails mid-run leaves nothing keeping its process alive.
        self._training = threading.Thread(target=self._trainer.run, name="trainer", daemon=True)
        self._training.start()

    def wait(self, timeout_s: float | None = None) -> RunStatus:
        """The run's status once it has ended, or after ``timeout_s`` (then RUNNING)."""
        self._training.join(timeout_s)
        return self._trainer.status

    def poll(self, cursor: int) -> RunnerReport:
        return self._trainer.report(cursor)

    def cancel(self) -> None:
        self._trainer.cancel()

    def suspend(self) -> None:
        self._trainer.suspend()

    def relayout(
        self, plans: Sequence[StagePlan], split: Sequence[int], since: Collection[str]
    ) -> None:
        self._trainer.relayout(plans, split, since)
