"""Running jobs moved while they train: off draining devices, onto free ones that make them
faster (``scheduler.resize``), or suspended to a checkpoint when they cannot move or a job
of higher priority needs their devices.

The runner carries a move out at its next step boundary and reports it (a ``relayout``
event), or checkpoints and stops (``SUSPENDED``); until then the job is under way and
nothing else moves it. The controller says when that ends (``done``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Set
from functools import partial

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.scheduler.devices import Device
from shoal.scheduler.layout import Layout
from shoal.scheduler.partition import PartitionError
from shoal.scheduler.resize import Candidate, candidate, worth_growing
from shoal.service.cluster import Cluster, ClusterUnavailable, RunnerGone
from shoal.service.db.models import Job
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.holdings import draining_devices, held_devices
from shoal.service.isolation import isolated
from shoal.service.jobs import add_event
from shoal.service.lifecycle import JobState
from shoal.service.snapshots import job_request
from shoal.service.specs import JobSpec
from shoal.workers.snapshot import stage_plans

log = logging.getLogger(__name__)

LayoutPlanner = Callable[[Session, Job, Sequence[Device]], Layout]
"""How the controller lays a job out on devices (``Controller._layout``)."""

SUSPENDING = "suspending"


class Resizer:
    """The moves and suspensions the controller has asked of running jobs."""

    def __init__(
        self,
        factory: SessionFactory,
        cluster: Cluster,
        layout: LayoutPlanner,
        growth_min_gain: float,
    ) -> None:
        self._factory = factory
        self._cluster = cluster
        self._layout = layout
        self._min_gain = growth_min_gain
        self._under_way: dict[str, str] = {}
        """Jobs asked to relayout or suspend, not yet reported done, and why."""

    def done(self, job_id: str) -> None:
        """``job_id``'s move or suspension is over (reported, or the job ended)."""
        self._under_way.pop(job_id, None)

    def under_way(self, job_id: str) -> bool:
        return job_id in self._under_way

    def suspending(self, job_id: str) -> bool:
        return self._under_way.get(job_id) == SUSPENDING

    def resize_running(
        self, devices: Sequence[Device], unready: Set[str], fail: Callable[[str, str], None]
    ) -> None:
        """Move running jobs off draining devices and grow them onto free ones (not the
        ``unready``: ``service.setbacks``), oldest first; the runner carries the move out at
        its next step boundary (``relayout``), and its ``relayout`` event commits the new
        devices. A fault in one job's move ends that job (``fail``), not the others'."""
        with self._factory() as session:
            running = list(
                session.scalars(
                    sa.select(Job)
                    .where(Job.state == JobState.RUNNING.value, Job.pool.is_(None))
                    .order_by(Job.started_at, Job.id)
                )
            )
            draining = draining_devices(session)
            held = held_devices(session)
        by_id = {d.id: d for d in devices}
        free = [d for d in devices if d.id not in held | draining | unready]
        for job in running:
            current = [by_id[i] for i in job.devices if i in by_id]
            if job.id in self._under_way or job.cancel_requested or len(current) < len(job.devices):
                continue  # a move under way, a cancel, or a lost device (the LOST path)
            with isolated(f"job {job.id}", partial(fail, job.id)):
                found = candidate(job_request(job), current, free, draining)
                if found is not None:
                    taken = self._resize(job, current, found)
                    free = [d for d in free if d.id not in taken]

    def _resize(self, job: Job, current: Sequence[Device], found: Candidate) -> set[str]:
        """Lay ``job`` out on ``found`` and ask its runner to move; the devices taken."""
        spec = JobSpec.model_validate(job.spec)
        try:
            with self._factory() as session:
                layout = self._layout(session, job, found.devices)
                now = None if found.draining else self._layout(session, job, current)
        except PartitionError as exc:
            if found.draining:
                self.suspend(job.id, *_drain_stuck(found, str(exc)))
            return set()
        used = {d.id for d in layout.devices}
        if now is not None and (
            not used & set(found.added)
            or not worth_growing(
                now.plan.predicted_step_s, layout.plan.predicted_step_s, self._min_gain
            )
        ):
            return set()
        if len(used) < spec.resources.min_devices:
            self.suspend(
                job.id,
                *_drain_stuck(
                    found,
                    f"{len(used)} devices would remain, min_devices is"
                    f" {spec.resources.min_devices}",
                ),
            )
            return set()
        try:
            self._cluster.relayout(
                job.id,
                stage_plans(layout.devices, layout.ranges, layout.tensor),
                layout.plan.micro_batches,
                list(job.devices),
            )
        except (RunnerGone, ClusterUnavailable) as exc:
            log.warning("relayout of %s not delivered: %s", job.id, exc, extra={"job_id": job.id})
            return set()
        self._under_way[job.id] = found.reason
        with transaction(self._factory) as session:
            row = session.get(Job, job.id)
            if row is not None:
                # Held from now on, old and new, until the runner reports the move done.
                row.devices = sorted(set(row.devices) | used)
                add_event(
                    session,
                    job.id,
                    "resize",
                    f"{found.reason}: {layout.plan.reason}",
                    {
                        "devices": [d.id for d in layout.devices],
                        "added": sorted(used - {d.id for d in current}),
                        "draining": list(found.draining),
                        "predicted_step_s": layout.plan.predicted_step_s,
                    },
                )
        return used

    def suspend(self, job_id: str, message: str, data: dict[str, object]) -> None:
        """Its runner checkpoints at the next step boundary and stops; the job waits QUEUED
        for devices and resumes from that checkpoint, losing no step: for a job that cannot
        leave draining devices, and for one preempted by a higher priority."""
        try:
            self._cluster.suspend(job_id)
        except (RunnerGone, ClusterUnavailable) as exc:
            log.warning("suspend of %s not delivered: %s", job_id, exc, extra={"job_id": job_id})
            return
        self._under_way[job_id] = SUSPENDING
        with transaction(self._factory) as session:
            add_event(session, job_id, "suspend", message, data)


def _drain_stuck(found: Candidate, why: str) -> tuple[str, dict[str, object]]:
    """The suspend event of a job that cannot leave its draining devices for others: rather
    than lose the steps since its last checkpoint when they go, it checkpoints and waits."""
    return (
        f"cannot leave draining devices {list(found.draining)} ({why}): checkpointing"
        " at the next step boundary, then waiting for devices",
        {"draining": list(found.draining)},
    )
