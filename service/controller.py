"""The controller: one reconciliation loop that makes the cluster match the database.

Each tick it reads the device inventory (``service.inventory``), follows every running job's
runner (storing what it reports, ``service.reports``: the control plane is the only database
writer), carries
out cancel requests, recovers jobs whose devices or runner were lost, runs sweeps
(``service.sweeper``: their trials are jobs), places queued jobs on free devices, and moves
running jobs off draining devices and onto free ones (``service.resizer``).
It starts nothing for a job that already has a runner: runners are found again by name, so a
restarted control plane picks up where the last one stopped. Each job's and sweep's step is
isolated (``service.isolation``): its fault ends it, never the tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from shoal.scheduler.devices import Device
from shoal.scheduler.layout import Layout, plan_layout
from shoal.scheduler.partition import PartitionError
from shoal.scheduler.placement import JobRequest, Placement, Quota, Running, place, preemptions
from shoal.scheduler.workload import Workload
from shoal.service.cluster import Cluster, ClusterUnavailable, RunnerGone
from shoal.service.code_checks import job_code
from shoal.service.code_store import CodeNotFound, CodeStore
from shoal.service.db.models import Checkpoint, DeviceRow, Job, utcnow
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.holdings import (
    ACTIVE_JOBS,
    draining_devices,
    held_devices,
    quotas,
    usage_by_owner,
)
from shoal.service.inventory import inventory, sync_devices
from shoal.service.isolation import isolated
from shoal.service.jobs import JobConflict, add_event, transition
from shoal.service.lifecycle import JobState
from shoal.service.reports import follow_recovery, persist_report
from shoal.service.resizer import Resizer
from shoal.service.setbacks import MAX_RESTARTS, Setbacks
from shoal.service.silence import Silences
from shoal.service.snapshots import block_costs, build_snapshot, job_request
from shoal.service.specs import JobSpec
from shoal.service.sweeper import Sweeper
from shoal.service.traces import CodeRunner
from shoal.workers.snapshot import RunStatus, partition_rows, stage_plans

log = logging.getLogger(__name__)

_FINAL_STATE = {
    RunStatus.SUCCEEDED: JobState.SUCCEEDED,
    RunStatus.FAILED: JobState.FAILED,
    RunStatus.CANCELLED: JobState.CANCELLED,
}
_ACTIVE = ACTIVE_JOBS


@dataclass(frozen=True)
class ControllerConfig:
    checkpoint_root: str
    allowed_factories: tuple[str, ...] = ()
    poll_interval_s: float = 0.5
    stage_overhead_s: float = 0.003  # the partitioner's cost model: see service.settings
    allreduce_s_per_byte: float = 1 / 0.7e9
    growth_min_gain: float = 0.1
    default_quota: Quota = field(default_factory=Quota)
    """Each user's limits where an admin set none (``PUT /users/{name}/quota``)."""
    code_store: CodeStore | None = None
    """Uploaded code, which jobs that name it are started with."""
    code_runner: CodeRunner | None = None
    """Checks a sweep's trial specs that have uploaded code (``service.code_checks``)."""
    runner_silence_s: float = 300.0
    """A job's runner unanswering its polls this long in a row is taken for lost."""


class Controller:
    def __init__(self, factory: SessionFactory, cluster: Cluster, config: ControllerConfig) -> None:
        self._factory = factory
        self._cluster = cluster
        self._config = config
        self._waiting_reason: dict[str, str] = {}
        self._resizer = Resizer(factory, cluster, self._layout, config.growth_min_gain)
        self._setbacks = Setbacks()
        self._silences = Silences(config.runner_silence_s)
        self._sweeper = Sweeper(
            factory,
            cluster,
            config.checkpoint_root,
            config.allowed_factories,
            config.default_quota,
            config.code_store,
            config.code_runner,
            unready=self._setbacks.unready,
        )
        self.last_tick: float | None = None

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event) -> None:
        """Reconcile until ``stop`` is set. A failing tick is logged and retried, never fatal."""
        while not stop.is_set():
            try:
                self.reconcile_once()
            except (SQLAlchemyError, ClusterUnavailable) as exc:
                log.warning("reconcile tick failed, retrying: %s", exc)
            except Exception:  # the loop must outlive any single bad tick; the trace is logged
                log.exception("reconcile tick failed with an unexpected error")
            stop.wait(self._config.poll_interval_s)

    def reconcile_once(self) -> None:
        """One tick. Each job's and each sweep's step is isolated (``service.isolation``):
        its fault ends that job or sweep FAILED with the reason, and the tick goes on."""
        nodes = self._cluster.nodes()
        devices = inventory(self._factory, nodes)
        with self._factory() as session:
            active = list(session.scalars(sa.select(Job.id).where(Job.state.in_(_ACTIVE))))
        for job_id in active:
            with isolated(f"job {job_id}", partial(self._fail, job_id)):
                self._follow(job_id, devices)
        with isolated("device inventory"):
            sync_devices(self._factory, devices, {n.node_id for n in nodes if n.draining})
        self._sweeper.reconcile_once(devices)
        with isolated("placement"):
            self._place_queued(devices)
        with isolated("resizing"):
            self._resizer.resize_running(devices, self._setbacks.unready(), self._fail)
        self.last_tick = time.monotonic()

    # ------------------------------------------------------------------ running jobs

    def _follow(self, job_id: str, devices: Sequence[Device]) -> None:
        with self._factory() as session:
            job = session.get(Job, job_id)
            if job is None or job.state not in _ACTIVE:
                return
            cursor, cancel, pool = job.runner_cursor, job.cancel_requested, job.pool
        try:
            if pool is None:
                report = self._cluster.poll(job_id, cursor)
            else:
                report = self._cluster.poll_trial(pool, job_id, cursor)
        except RunnerGone as exc:
            self._restart(job_id, str(exc), (), devices)
            return
        except ClusterUnavailable as exc:
            log.warning("%s", exc)
            # A sweep's trials are their executor's to answer for: not counted here.
            silent = self._silences.unanswered(job_id) if pool is None else None
            if silent is not None:
                self._restart(job_id, f"{exc}: no answer for {silent:.0f} s", (), devices)
            return
        self._silences.answered(job_id)
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is None:
                return
            persist_report(session, job, report)
            follow_recovery(session, job, report)
        if any(e.kind in ("relayout", "relayout_failed") for e in report.events):
            self._resizer.done(job_id)
        not_started = self._setbacks.not_started(report.events)
        if report.status is RunStatus.LOST:
            reason = report.error or f"lost devices {list(report.lost_devices)}"
            recover = self._restart if not_started else self._recover  # bounded, or not
            recover(job_id, reason, report.lost_devices, devices)
        elif report.status is RunStatus.SUSPENDED:
            self._requeue(job_id, report.step)
        elif report.status.is_final:
            message = report.error or f"runner finished: {report.status.value}"
            self._finish(job_id, _FINAL_STATE[report.status], message, error=report.error)
        elif cancel:
            try:
                if pool is None:
                    self._cluster.cancel(job_id)
                else:
                    self._cluster.cancel_trial(pool, job_id)
            except (RunnerGone, ClusterUnavailable) as exc:
                log.warning(
                    "cancel of %s not delivered yet: %s", job_id, exc, extra={"job_id": job_id}
                )

    def _finish(self, job_id: str, target: JobState, message: str, *, error: str | None) -> None:
        self._resizer.done(job_id)
        self._setbacks.forget(job_id)
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is not None and job.state in _ACTIVE:
                transition(session, job, target, message, error=error)
        self._cluster.stop_runner(job_id)

    def _fail(self, job_id: str, why: str) -> None:
        """End ``job_id`` FAILED, whatever its state, after a fault in the controller's own
        work on it: its runner is stopped, or a trial taken off its sweep's executor."""
        self._resizer.done(job_id)
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is None or JobState(job.state).is_terminal:
                return
            pool = job.pool
            transition(session, job, JobState.FAILED, why, error=why)
        if pool is None:
            self._cluster.stop_runner(job_id)
            return
        with suppress(RunnerGone, ClusterUnavailable):  # no executor: nothing trains it
            self._cluster.cancel_trial(pool, job_id)

    def _requeue(self, job_id: str, step: int) -> None:
        """A suspended runner checkpointed ``step`` and stopped: the job waits QUEUED for
        devices and resumes from that checkpoint, replaying nothing."""
        self._resizer.done(job_id)
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is None or job.state not in _ACTIVE:
                return
            transition(
                session,
                job,
                JobState.QUEUED,
                f"suspended at step {step} (checkpointed); waiting for devices",
                devices=[],
            )
            if job.pool is not None:  # its sweep's executor takes it again (service.sweeper)
                return
        self._cluster.stop_runner(job_id)

    # ------------------------------------------------------------------ lost devices

    def _restart(
        self, job_id: str, reason: str, lost_devices: Sequence[str], devices: Sequence[Device]
    ) -> None:
        """The job's runner died (its process, its node, or a kill) or a worker of it did
        not start: it is placed again (``_recover``; a dead runner's devices are not lost),
        unless that happened ``MAX_RESTARTS`` times in a row already without the job
        passing a step (``service.setbacks``): then it fails, saying why."""
        with self._factory() as session:
            job = session.get(Job, job_id)
            step = job.step if job is not None else 0
        count = self._setbacks.restarts(job_id, step)
        if count > MAX_RESTARTS:
            message = f"{reason}; {count} times without the job passing step {step}"
            self._finish(job_id, JobState.FAILED, message, error=message)
            return
        self._recover(job_id, reason, lost_devices, devices)

    def _recover(
        self, job_id: str, reason: str, lost_devices: Sequence[str], devices: Sequence[Device]
    ) -> None:
        """A stage's device or the runner is gone: the job turns RECOVERING, its runner (and
        every stage worker with it) is stopped, and it is placed again on the devices that
        remain, its own among them, resuming from its latest checkpoint on the new layout;
        with too few devices for ``min_devices`` it waits QUEUED for devices to return.
        A sweep's trial whose executor lost it waits QUEUED for its sweep's executor to take
        it again, on the devices the sweep has then (``service.sweeper``)."""
        lost = sorted(lost_devices)
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is None or job.state not in _ACTIVE:
                return
            resume = session.scalar(
                sa.select(sa.func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id)
            )
            resume_step = int(resume or 0)
            if job.state == JobState.RUNNING.value:
                transition(session, job, JobState.RECOVERING, reason)
            what = f"lost {', '.join(lost)}" if lost else "lost the runner"
            add_event(
                session,
                job_id,
                "device_lost" if lost else "runner_lost",
                f"{what} at step {job.step}; resuming from step {resume_step}"
                f" ({job.step - resume_step} steps replayed)",
                {
                    "devices": lost,
                    "step": job.step,
                    "resume_step": resume_step,
                    "steps_replayed": job.step - resume_step,
                },
            )
            if job.pool is not None:
                why = f"waiting for its sweep's executor: {reason}"
                transition(session, job, JobState.QUEUED, why, devices=[])
                return
            request = job_request(job)
            held = held_devices(session, exclude=job_id) | draining_devices(session)
            held |= self._setbacks.unready()
        self._cluster.stop_runner(job_id)
        free = [d for d in devices if d.id not in held and d.id not in lost]
        placements, waiting = place([request], free)
        if placements:
            self._start(placements[0])
            return
        reason = waiting[0].reason if waiting else "no devices"
        with transaction(self._factory) as session:
            job = session.get(Job, job_id)
            if job is not None and job.state == JobState.RECOVERING.value:
                transition(
                    session, job, JobState.QUEUED, f"waiting for devices: {reason}", devices=[]
                )

    # ------------------------------------------------------------------ queued jobs

    def _place_queued(self, devices: Sequence[Device]) -> None:
        with self._factory() as session:
            queued = list(
                session.scalars(
                    sa.select(Job)
                    .where(Job.state == JobState.QUEUED.value, Job.pool.is_(None))
                    .order_by(Job.created_at, Job.id)
                )
            )
            busy = held_devices(session) | draining_devices(session) | self._setbacks.unready()
            faults: list[tuple[str, str]] = []
            requests = _requests(queued, faults)
            usage = usage_by_owner(session)
            limits = quotas(session, self._config.default_quota)
        for job_id, why in faults:
            self._fail(job_id, why)
        if not requests:
            return
        free = [d for d in devices if d.id not in busy]
        placements, waiting = place(requests, free, usage=usage, quotas=limits)
        for placement in placements:
            with isolated(f"job {placement.job_id}", partial(self._fail, placement.job_id)):
                self._start(placement)
        placed = {d.id for p in placements for d in p.devices}
        with isolated("preemption"):
            self._preempt(
                [
                    r
                    for r in requests
                    if r.job_id in {w.job_id for w in waiting if not w.over_quota}
                ],
                [d for d in free if d.id not in placed],
                devices,
            )
        for wait in waiting:
            if self._waiting_reason.get(wait.job_id) != wait.reason:
                self._waiting_reason[wait.job_id] = wait.reason
                with transaction(self._factory) as session:
                    add_event(session, wait.job_id, "waiting", wait.reason)

    def _preempt(
        self, waiting: Sequence[JobRequest], free: Sequence[Device], devices: Sequence[Device]
    ) -> None:
        """Suspend running jobs of lower priority that hold the devices a waiting job needs
        (``scheduler.placement.preemptions``): they checkpoint and requeue, losing nothing.
        Devices of jobs already suspending count as free: a job preempts once."""
        with self._factory() as session:
            running = list(
                session.scalars(
                    sa.select(Job)
                    .where(Job.state == JobState.RUNNING.value, Job.pool.is_(None))
                    .order_by(Job.started_at.desc(), Job.id)  # the youngest first
                )
            )
            faults: list[tuple[str, str]] = []
            requests = _requests(running, faults)
            held_by = {job.id: tuple(job.devices) for job in running}
        for job_id, why in faults:
            self._fail(job_id, why)
        jobs = [(request, held_by[request.job_id]) for request in requests]
        by_id = {d.id: d for d in devices}
        soon = list(free)
        candidates = []
        for request, held in jobs:
            mine = tuple(by_id[i] for i in held if i in by_id)
            if self._resizer.suspending(request.job_id):
                soon += mine
            elif not self._resizer.under_way(request.job_id):
                candidates.append(Running(request, mine))
        for request in sorted(waiting, key=lambda r: -r.priority):
            victims = preemptions(request, candidates, soon)
            for victim in victims:
                low = next(c for c in candidates if c.request.job_id == victim)
                candidates.remove(low)
                # The event is the victim's owner's to read: it names no other user's job.
                # Which one preempted it is for the operator's log.
                log.info(
                    "job %s preempts job %s (priority %d > %d)",
                    request.job_id,
                    victim,
                    request.priority,
                    low.request.priority,
                    extra={"job_id": victim},
                )
                self._resizer.suspend(
                    victim,
                    "preempted: a job of higher priority needs its devices; checkpointing at"
                    " the next step boundary, then waiting for devices",
                    {"preempted": True},
                )
                soon += low.devices

    def _start(self, placement: Placement) -> None:
        self._waiting_reason.pop(placement.job_id, None)
        self._resizer.done(placement.job_id)
        with transaction(self._factory) as session:
            job = session.get(Job, placement.job_id)
            if job is None or job.state not in (JobState.QUEUED.value, JobState.RECOVERING.value):
                return
            try:
                layout = self._layout(session, job, placement.devices)
                code = job_code(job.spec.get("code"), self._config.code_store)
            except (PartitionError, CodeNotFound) as exc:
                transition(session, job, JobState.FAILED, str(exc), error=str(exc))
                return
            partition = partition_rows(stage_plans(layout.devices, layout.ranges, layout.tensor))
            try:
                transition(
                    session,
                    job,
                    JobState.RUNNING,
                    f"placed on {len(layout.devices)} device(s): {layout.plan.reason}"
                    + layout.sharded_note(job.spec.get("parallelism", {}).get("shard", "none")),
                    devices=[d.id for d in layout.devices],
                    partition=partition,
                    stage_times=None,  # the new partition has no timings yet
                    attempt=job.attempt + 1,
                    runner_cursor=0,
                    started_at=utcnow(),
                )
            except JobConflict:
                return  # cancelled meanwhile
            snapshot = build_snapshot(
                job,
                layout.devices,
                layout.ranges,
                checkpoint_root=self._config.checkpoint_root,
                allowed_factories=self._config.allowed_factories,
                replicas=layout.plan.replicas,
                replica_micro_batches=layout.plan.micro_batches,
                transfer_bytes_per_s=1 / self._config.allreduce_s_per_byte,
                code=code,
                shard=layout.shard,
            )
        try:
            self._cluster.start_runner(snapshot)
        except Exception as exc:  # any launch failure fails this job, with the reason, not the loop
            reason = f"could not start the runner: {exc}"
            log.warning("job %s: %s", placement.job_id, reason, extra={"job_id": placement.job_id})
            self._finish(placement.job_id, JobState.FAILED, reason, error=reason)

    def _layout(self, session: Session, job: Job, devices: Sequence[Device]) -> Layout:
        """Order the placed devices and cut the model over their measured speeds: the
        partitioner picks the stage and replica counts a spec leaves ``auto``, and may leave
        some placed devices unused (they return to the pool)."""
        spec = JobSpec.model_validate(job.spec)
        ids = [d.id for d in devices]
        rows = {
            row.id: row
            for row in session.scalars(sa.select(DeviceRow).where(DeviceRow.id.in_(ids)))
        }
        gflops = {i: row.speed_gflops for i, row in rows.items() if row.speed_gflops}
        stages, replicas = spec.parallelism.stages, spec.parallelism.replicas
        return plan_layout(
            devices,
            gflops,
            costs=block_costs(job),
            stages=stages if isinstance(stages, int) else None,
            replicas=replicas if isinstance(replicas, int) else None,
            workload=Workload(
                micro_batches=spec.micro_batches,
                micro_batch_size=spec.batch_size // spec.micro_batches,
                schedule=spec.parallelism.schedule,
                recompute=spec.parallelism.recompute,
                precision=spec.precision,
                stage_overhead_s=self._config.stage_overhead_s,
                shard=spec.parallelism.shard,
                tensor=spec.parallelism.tensor,
            ),
            sync_s_per_byte=self._config.allreduce_s_per_byte,
        )


def _requests(jobs: Sequence[Job], faults: list[tuple[str, str]]) -> list[JobRequest]:
    """The placement requests of ``jobs``; each job whose request cannot be made is left
    out and noted in ``faults`` with the reason (its caller fails it once the session ends)."""
    requests = []
    for job in jobs:
        with isolated(f"job {job.id}", partial(_note, faults, job.id)):
            requests.append(job_request(job))
    return requests


def _note(faults: list[tuple[str, str]], job_id: str, why: str) -> None:
    faults.append((job_id, why))
