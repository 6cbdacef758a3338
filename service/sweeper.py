"""The sweeper: the controller's part that runs sweeps, one reconcile tick at a time.

For every active sweep it reports each running trial's objective to the sweep's study
(``service.tuner``) every ``objective.every_steps`` steps and cancels the trials the pruner
stops (PRUNED), tells the study how finished trials ended, starts new trials — each a job of
its own, with the base spec and the sampled parameters, placed like any job — up to
``max_concurrent`` at once and ``max_trials`` in all, keeps only the best trials'
checkpoints, and ends the sweep when its last trial has ended. Cancelling a sweep cancels
its trials. A sweep on its own SHARP executor leaves draining devices with its trials (they
checkpoint, the executor is placed again, and they resume there), goes on on the devices
left when it loses some, and is placed again when it has lost them all. It writes only what
the control plane writes: jobs, trials, sweeps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence, Set
from functools import partial

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.scheduler.devices import Device
from shoal.scheduler.placement import JobRequest, Quota, Usage, place
from shoal.service.auth import Principal
from shoal.service.cluster import Cluster, RunnerGone
from shoal.service.code_checks import job_code
from shoal.service.code_store import CodeStore
from shoal.service.db.models import Checkpoint, Job, JobMetric, Sweep, Trial, utcnow
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.holdings import (
    ACTIVE_JOBS,
    draining_devices,
    held_devices,
    quotas,
    usage_by_owner,
)
from shoal.service.isolation import isolated
from shoal.service.jobs import add_event, add_job, transition
from shoal.service.lifecycle import JobState
from shoal.service.snapshots import build_snapshot
from shoal.service.spec_errors import SpecError
from shoal.service.specs import validate_job_spec
from shoal.service.sweeps import list_trials, move_sweep, ranked
from shoal.service.sweepspec import SweepSpec, trial_name, trial_spec
from shoal.service.traces import CodeRunner
from shoal.service.tuner import Outcome, Tuner
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.uploaded_code import JobCode

log = logging.getLogger(__name__)

_ACTIVE = (JobState.QUEUED.value, JobState.RUNNING.value)
SUSPECT_S = 30.0
"""How long a sweep that lost devices avoids their nodes: a node SIGKILLed is still in Ray's
inventory until its health checks fail (seconds), and its other devices look free."""


class Sweeper:
    def __init__(
        self,
        factory: SessionFactory,
        cluster: Cluster,
        checkpoint_root: str,
        allowed_factories: Sequence[str],
        default_quota: Quota,
        code_store: CodeStore | None = None,
        code_runner: CodeRunner | None = None,
        *,
        unready: Callable[[], Set[str]],
    ) -> None:
        self._factory = factory
        self._unready = unready
        """The devices no worker started on lately, which placements leave alone
        (``service.setbacks``)."""
        self._code_store = code_store
        self._code_runner = code_runner
        self._default_quota = default_quota
        self._cluster = cluster
        self._root = checkpoint_root
        self._store = CheckpointStore(checkpoint_root)
        self._allowed = tuple(allowed_factories)
        self._tuners: dict[str, Tuner] = {}
        self._suspended: set[str] = set()
        """Trials asked to suspend while their sweep leaves its devices (asked once)."""
        self._suspect: dict[str, tuple[set[str], float]] = {}
        """Per sweep that lost devices: the nodes they were on, and when it last found one."""

    def reconcile_once(self, devices: Sequence[Device]) -> None:
        """One tick over every active sweep; ``devices`` is the live inventory."""
        with self._factory() as session:
            active = list(session.scalars(sa.select(Sweep.id).where(Sweep.state.in_(_ACTIVE))))
        for sweep_id in active:
            with isolated(f"sweep {sweep_id}", partial(self._fail, sweep_id)):
                try:
                    self._follow(sweep_id, devices)
                except BaseException:
                    # Its study heard what the rolled-back transaction did not keep (a trial
                    # told, a report, an ask): rebuilt from the database on the next tick.
                    self._tuners.pop(sweep_id, None)
                    raise
        for sweep_id in set(self._tuners) - set(active):
            del self._tuners[sweep_id]
        for sweep_id in set(self._suspect) - set(active):
            del self._suspect[sweep_id]

    def _follow(self, sweep_id: str, devices: Sequence[Device]) -> None:
        with transaction(self._factory) as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None or sweep.state not in _ACTIVE:
                return
            spec = SweepSpec.model_validate(sweep.spec)
            trials = list(list_trials(session, sweep_id))
            tuner = self._tuner(session, sweep, spec, trials)
            for trial in trials:
                if not trial.told:
                    self._progress(session, tuner, spec, trial)
            if sweep.cancel_requested:
                for trial in trials:
                    _stop(session, trial.job, "its sweep was cancelled")
                if all(t.told for t in trials):
                    self._close(sweep, JobState.CANCELLED, "cancelled")
                return
            self._drop_checkpoints(session, spec, trials)
            if spec.executor == "sharp":
                if not self._pool(session, sweep, spec, trials, devices):
                    return  # moving, or waiting for devices
                self._resume(session, sweep, trials, devices)
            self._launch(session, tuner, spec, sweep, trials, devices)
            if len(trials) >= sweep.max_trials and all(t.told for t in trials):
                done = [t for t in trials if t.objective is not None and not t.pruned]
                if done:
                    self._close(sweep, JobState.SUCCEEDED, None)
                else:
                    self._close(sweep, JobState.FAILED, "no trial completed")

    def _fail(self, sweep_id: str, why: str) -> None:
        """End a sweep FAILED after a fault in its own step, without asking its study (which
        may be what failed): its unfinished trials are cancelled (a running trial with a
        runner of its own at its next step boundary; one on the sweep's executor at once, as
        the executor closes) and its devices are freed."""
        self._tuners.pop(sweep_id, None)
        with transaction(self._factory) as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None or sweep.state not in _ACTIVE:
                return
            for trial in list_trials(session, sweep_id):
                job = trial.job
                if job.pool is not None and not JobState(job.state).is_terminal:
                    transition(session, job, JobState.CANCELLED, f"its sweep failed: {why}")
                else:
                    _stop(session, job, f"its sweep failed: {why}")
            self._close(sweep, JobState.FAILED, why)

    def _close(self, sweep: Sweep, target: JobState, error: str | None) -> None:
        """End the sweep and stop its executor, freeing its devices."""
        move_sweep(sweep, target, error=error)
        if sweep.devices:
            self._cluster.close_pool(sweep.id)
            sweep.devices = []

    def _pool(
        self,
        session: Session,
        sweep: Sweep,
        spec: SweepSpec,
        trials: Sequence[Trial],
        devices: Sequence[Device],
    ) -> bool:
        """The sweep's SHARP executor runs on its devices (placed now if it has none);
        False while it leaves its devices, or no devices are free for it. It leaves devices
        that are draining, or all lost (then placed again off their nodes); with some lost
        it goes on on the others (the executor moved their shards there) until it can have
        all it asked for again, and then it moves."""
        if not sweep.devices:
            chosen = self._placement(session, sweep, spec, devices)
            if chosen is None:  # the devices are busy, or its owner's quota is spent: it waits
                return False
            self._cluster.start_pool(sweep.id, chosen, "lrtf", self._code(spec.base.code))
            sweep.devices = [d.id for d in chosen]
            self._suspect.pop(sweep.id, None)
            return True
        by_id = {d.id: d for d in devices}
        running = self._cluster.has_pool(sweep.id)
        # Its executor may find a device lost before Ray's inventory drops it.
        lost = self._cluster.lost_pool_devices(sweep.id) if running else set()
        self._suspected(sweep.id, {by_id[i].node_id for i in lost if i in by_id})
        live = [i for i in sweep.devices if i in by_id and i not in lost]
        # A device its executor lost is left already (one it set aside is draining too).
        going = [i for i in live if i in draining_devices(session)]
        if going or not live:
            why = f"{going} are draining" if going else f"{sweep.devices} were all lost"
            self._leave(session, sweep, trials, f"its sweep's devices {why}")
            return False
        if len(live) < len(sweep.devices):
            log.info(
                "sweep %s: lost %s, goes on on %s",
                sweep.id,
                ", ".join(sorted(set(sweep.devices) - set(live))),
                ", ".join(live),
                extra={"sweep_id": sweep.id},
            )
            sweep.devices = live
        if len(live) < spec.devices and self._placement(session, sweep, spec, devices):
            why = f"its sweep runs on {len(live)} of its {spec.devices} devices, and all are free"
            self._leave(session, sweep, trials, why)
            return False
        if not running:  # the control plane restarted
            live_devices = [by_id[i] for i in live]
            self._cluster.start_pool(sweep.id, live_devices, "lrtf", self._code(spec.base.code))
        return True

    def _code(self, digest: str | None) -> JobCode | None:
        return job_code(digest, self._code_store)

    def _placement(
        self, session: Session, sweep: Sweep, spec: SweepSpec, devices: Sequence[Device]
    ) -> list[Device] | None:
        """Devices for the sweep's executor among those free and its own (its owner's quota
        counting what it would hold instead of what it holds), off the nodes of devices it
        lost lately and off devices no worker started on lately (its own excepted); None
        if there are not enough."""
        own = set(sweep.devices)
        busy = ((held_devices(session) | self._unready()) - own) | draining_devices(session)
        suspect, since = self._suspect.get(sweep.id, (set(), 0.0))
        if time.monotonic() - since > SUSPECT_S:
            suspect = set()
        free = [d for d in devices if d.id not in busy and d.node_id not in suspect]
        request = JobRequest(
            sweep.id, 0, spec.devices, spec.devices, None, 1, replicas=None, owner=sweep.owner.name
        )
        usage = usage_by_owner(session)
        if own:
            held = usage[sweep.owner.name]
            usage[sweep.owner.name] = Usage(held.jobs - 1, held.devices - len(own))
        limits = quotas(session, self._default_quota)
        placements, _ = place([request], free, usage=usage, quotas=limits)
        return list(placements[0].devices) if placements else None

    def _suspected(self, sweep_id: str, nodes: set[str]) -> None:
        """The sweep lost devices on ``nodes``: Ray may list them a while yet (a node
        SIGKILLed stays until its health checks fail), so placements avoid them for
        SUSPECT_S from now."""
        known, _ = self._suspect.get(sweep_id, (set(), 0.0))
        if nodes - known:
            self._suspect[sweep_id] = (known | nodes, time.monotonic())

    def _leave(self, session: Session, sweep: Sweep, trials: Sequence[Trial], why: str) -> None:
        """Some of the sweep's devices are draining (a preemption notice), or all are lost:
        each of its running trials checkpoints at its next step boundary and waits QUEUED
        (the controller requeues a trial its executor reports SUSPENDED, or LOST once no
        device is left, from its latest checkpoint); once none runs, the executor stops and
        the sweep is placed again, on free devices, where its trials resume (``_resume``)."""
        running = [t.job for t in trials if t.job.state in ACTIVE_JOBS]
        for job in running:
            if job.id in self._suspended:
                continue
            try:
                self._cluster.suspend_trial(sweep.id, job.id)
            except RunnerGone:  # the controller requeues a trial whose executor is gone
                continue
            self._suspended.add(job.id)
            add_event(
                session,
                job.id,
                "suspend",
                f"{why}: checkpointing at the next step boundary, then moving with the sweep",
                {"devices": list(sweep.devices)},
            )
        if running:
            return
        log.info("sweep %s moves: %s", sweep.id, why, extra={"sweep_id": sweep.id})
        self._cluster.close_pool(sweep.id)
        sweep.devices = []
        self._suspended -= {t.job_id for t in trials}

    def _resume(
        self, session: Session, sweep: Sweep, trials: Sequence[Trial], devices: Sequence[Device]
    ) -> None:
        """Hand the trials waiting QUEUED for the sweep's executor (suspended to move, or
        lost with a device) back to it: each resumes from its latest checkpoint."""
        for trial in trials:
            job = trial.job
            if job.state != JobState.QUEUED.value or job.pool != sweep.id:
                continue
            self._suspended.discard(job.id)
            if job.cancel_requested:  # pruned or cancelled while it was moving
                transition(session, job, JobState.CANCELLED, "cancelled while it waited")
            else:
                self._start_trial(session, sweep, job, devices)

    def _tuner(
        self, session: Session, sweep: Sweep, spec: SweepSpec, trials: Sequence[Trial]
    ) -> Tuner:
        """The sweep's study, rebuilt from its trials when this process has none yet."""
        tuner = self._tuners.get(sweep.id)
        if tuner is None:
            tuner = Tuner(spec)
            for trial in trials:
                tuner.restore(
                    trial.number,
                    trial.params,
                    {int(step): value for step, value in trial.intermediate.items()},
                    _outcome(trial) if trial.told else None,
                    trial.objective,
                )
            self._tuners[sweep.id] = tuner
        return tuner

    def _progress(self, session: Session, tuner: Tuner, spec: SweepSpec, trial: Trial) -> None:
        """Report the trial's new objective values; tell the study once its job has ended."""
        every = spec.objective.every_steps
        reported = max((int(s) for s in trial.intermediate), default=0)
        rows = session.execute(
            sa.select(JobMetric.step, JobMetric.loss)
            .where(JobMetric.job_id == trial.job_id, JobMetric.step > reported)
            .order_by(JobMetric.step)
        ).all()
        values = dict(trial.intermediate)
        for step, loss in rows:
            if step % every or trial.pruned:
                continue
            if not math.isfinite(loss):  # diverged: no sampler or pruner learns from NaN
                self._prune(session, trial, step, f"its loss is {loss} at step {step}")
                continue
            values[str(step)] = loss
            if tuner.report(trial.number, step, loss):
                why = f"the sweep's {spec.early_stopping.rule} rule at step {step}"
                self._prune(session, trial, step, f"{why} (objective {loss:.6g})")
        trial.intermediate = values
        job = trial.job
        if not JobState(job.state).is_terminal:
            return
        final = job.last_loss
        if job.state == JobState.SUCCEEDED.value and not trial.pruned and final is not None:
            trial.objective = final if math.isfinite(final) else None
        outcome = _outcome(trial)
        tuner.tell(trial.number, outcome, trial.objective)
        trial.told = True

    @staticmethod
    def _prune(session: Session, trial: Trial, step: int, why: str) -> None:
        trial.pruned = True
        add_event(session, trial.job_id, "pruned", f"stopped early: {why}", {"step": step})
        _stop(session, trial.job, f"pruned at step {step}")

    def _launch(
        self,
        session: Session,
        tuner: Tuner,
        spec: SweepSpec,
        sweep: Sweep,
        trials: list[Trial],
        devices: Sequence[Device],
    ) -> None:
        running = sum(1 for t in trials if not t.told)
        owner = Principal(sweep.owner.id, sweep.owner.name, sweep.owner.is_admin)
        base = spec.base.model_dump(mode="json")
        while running < spec.max_concurrent and len(trials) < sweep.max_trials:
            number = len(trials)
            params = tuner.ask(number)
            payload = trial_spec(base, params, trial_name(spec.name, number))
            try:
                accepted = validate_job_spec(payload, self._allowed, self._code_runner)
            except SpecError as exc:  # validated at submission: a sampler's value cannot fail
                tuner.tell(number, "failed")
                move_sweep(sweep, JobState.FAILED, error=f"trial {number} {params}: {exc}")
                return
            job = add_job(session, owner, accepted)
            add_event(session, job.id, "trial", f"trial {number} of sweep {sweep.name}: {params}")
            if spec.executor == "sharp":
                self._start_trial(session, sweep, job, devices)
            trial = Trial(sweep_id=sweep.id, number=number, job_id=job.id, params=params)
            session.add(trial)
            session.flush()
            trials.append(trial)
            running += 1
            if sweep.state == JobState.QUEUED.value:
                move_sweep(sweep, JobState.RUNNING)

    def _start_trial(
        self, session: Session, sweep: Sweep, job: Job, devices: Sequence[Device]
    ) -> None:
        """Hand a trial's job to the sweep's executor: RUNNING on the sweep's devices, from
        its latest checkpoint if it has one."""
        by_id = {d.id: d for d in devices}
        pool = [by_id[i] for i in sweep.devices if i in by_id]
        transition(
            session,
            job,
            JobState.RUNNING,
            f"trained by sweep {sweep.name}'s SHARP executor on {len(pool)} shared device(s)",
            pool=sweep.id,
            devices=list(sweep.devices),
            attempt=job.attempt + 1,
            runner_cursor=0,
            started_at=utcnow(),
        )
        snapshot = build_snapshot(
            job,
            pool[:1],
            [(0, job.num_blocks)],
            checkpoint_root=self._root,
            allowed_factories=self._allowed,
            code=self._code(job.spec.get("code")),
        )
        self._cluster.add_trial(sweep.id, snapshot)

    def _drop_checkpoints(self, session: Session, spec: SweepSpec, trials: Sequence[Trial]) -> None:
        """Keep the checkpoints of the ``retention.keep_best`` best completed trials; delete
        those of every other ended trial (pruned and failed ones included)."""
        best = ranked((t for t in trials if t.told), spec.objective.direction)
        keep = {t.number for t in best[: spec.retention.keep_best]}
        for trial in trials:
            if trial.told and not trial.checkpoints_dropped and trial.number not in keep:
                self._store.retain(trial.job_id, 0)
                session.execute(sa.delete(Checkpoint).where(Checkpoint.job_id == trial.job_id))
                trial.checkpoints_dropped = True


def _outcome(trial: Trial) -> Outcome:
    if trial.pruned:
        return "pruned"
    return "complete" if trial.objective is not None else "failed"


def _stop(session: Session, job: Job, why: str) -> None:
    """Cancel a trial's job: a queued one at once, a running one at its next step boundary."""
    state = JobState(job.state)
    if state is JobState.QUEUED:
        transition(session, job, JobState.CANCELLED, why)
    elif not state.is_terminal and not job.cancel_requested:
        job.cancel_requested = True
        add_event(session, job.id, "cancel", why)
