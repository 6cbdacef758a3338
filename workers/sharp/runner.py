"""The SHARP executor: trains several models at once on a pool of devices by shard alternation.

Hydra's shard alternator parallelism (Nagrecha & Kumar): each model is cut into shards that
fit half of the smallest device (``scheduler.sharp.shard_model``; the other half holds the
prefetched next shard), all its shards live in the host memory of one device
(``scheduler.sharp_homes.home_shards``, ``workers.sharp.shard_host``), and each device has
two tasks queued, each the next task of one of the models living there, chosen by the
policy (Sharded-LRTF by default: ``scheduler.sharp.assign``), prefetching the shard it will
likely run after. A model's step is the chain forward 0..k-1, backward k-1..0, so the
parallelism is across models; a task's outputs stay on the device for the next one.
Models are placed by their devices' measured speeds, and before any task a model may go to
a faster device, trading places with the model there (``workers.sharp.trading``); with
``trades`` off they are placed as alike and move whole at step boundaries
(``move_target``). With copies at every step, each task copies what it made off its
device as it goes (``task_copies``, ``workers.sharp.ledger``): a lost device costs the
tasks in flight.

Each model trains exactly as it would alone: the same micro-batches, gradients accumulated
in the same order, each shard stepping once its backward is done (``workers.sharp.shard_host``).
Its metrics, events and checkpoints are those of a job (``RunnerReport``), so the control
plane follows every model like a job. ``SharpTrainer`` is plain Python over a ``HostPool``
(threads in-process, or ShardWorker actors on Ray).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import (
    Assignment,
    IdleDevice,
    Op,
    Policy,
    assign_run,
    progress,
    refine_ratio,
)
from shoal.scheduler.silence import Silence
from shoal.scheduler.types import DeviceId
from shoal.workers.error_text import one_line
from shoal.workers.run_log import RunLog
from shoal.workers.sharp.admitting import Admitting
from shoal.workers.sharp.checkpointing import CheckpointThread
from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.inbox import Inbox
from shoal.workers.sharp.measuring import Measurements
from shoal.workers.sharp.models import Copying, ModelRun, Task
from shoal.workers.sharp.placing import gather, move_if_sooner
from shoal.workers.sharp.shard_pool import (
    Call,
    HostLost,
    HostPool,
    InputLost,
    PoolFactory,
    PoolTimeout,
    give_up_hung,
)
from shoal.workers.sharp.shard_types import TaskResult
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.sharp.stalls import wait_saying
from shoal.workers.sharp.trading import Trading
from shoal.workers.snapshot import JobSnapshot, RunnerReport, RunStatus, StepMetrics

DEFAULT_TASK_TIMEOUT_S = 600.0
"""How long a device may have calls under way with none ending before it is given up as
hung (``scheduler.silence``); a recovery waits as long for its calls."""

QUEUE_DEPTH = 2
"""Calls queued on a device at once, each a run of a model's tasks: the one it runs and the
next, so it never waits for this loop (a round trip through Ray and the policy) between."""


class SharpTrainer(Admitting):
    """Trains ``models`` together on ``devices``; ``report`` is thread-safe."""

    def __init__(
        self,
        models: Sequence[JobSnapshot],
        devices: Sequence[Device],
        make_pool: PoolFactory,
        *,
        budgets: Mapping[DeviceId, int],
        policy: Policy = Policy.LRTF,
        prefetch: bool = True,
        trades: bool = True,
        task_copies: bool = True,
        keep_open: bool = False,
        task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not devices:
            raise ValueError("the SHARP executor needs at least one device")
        self._devices = list(devices)
        self._make_pool = make_pool
        self._budgets = dict(budgets)
        self._policy = policy
        self._prefetch = prefetch
        self._timeout = task_timeout_s
        self._silence = Silence(task_timeout_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, ModelRun] = {}
        """Every model it has trained or trains; ``_lock`` guards it against readers."""
        self._refused: dict[str, RunLog] = {}
        """Models it could not make (``_place``), FAILED with why; under ``_lock`` too."""
        self._inbox = Inbox(keep_open)
        self._writer = CheckpointThread(self._inbox.stop)
        self._dispatched = 0
        self._homes = Homes(self._devices, spread=trades)
        self._trades = trades
        self._task_copies = task_copies
        self._trading = Trading(self._homes)
        self._measures = Measurements()
        self._in_flight: dict[Call, Task] = {}
        """Shard tasks under way, up to ``QUEUE_DEPTH`` per device."""
        self._copy_calls: dict[Call, ModelRun] = {}
        """Copy calls under way (``ModelRun.copying``), by the model they copy."""
        self._drop_calls: set[Call] = set()
        """Calls dropping an ended model's shards, under way (``_drop``)."""
        for snap in models:
            self.add(snap)
        self.promoted_bytes = 0
        """Bytes copied onto devices (promotions and prefetches), for the benchmark."""

    # ---------------------------------------------------------------- thread-safe API

    def add(self, snap: JobSnapshot) -> None:
        """Train ``snap`` too, from now on (a sweep's new trial, or one that ended here
        LOST or SUSPENDED and starts again from its latest checkpoint)."""
        if not snap.block_costs:
            raise ValueError(f"model {snap.job_id} has no block costs to cut its shards by")
        with self._lock:
            training = [j for j, m in self._models.items() if m.status is RunStatus.RUNNING]
        self._inbox.add(snap, training)

    def cancel(self, job_id: str) -> None:
        """Stop training ``job_id`` once its tasks in flight are done (CANCELLED)."""
        self._inbox.stop(job_id, RunStatus.CANCELLED, None)

    def suspend(self, job_id: str) -> None:
        """Checkpoint ``job_id`` at its next step boundary and end it there (SUSPENDED): it
        resumes from that checkpoint wherever it is added next, replaying nothing."""
        self._inbox.suspend(job_id)

    def lost_devices(self) -> list[DeviceId]:
        """The devices found lost; the models go on on the others."""
        return self._homes.lost()

    def close(self) -> None:
        """No more models come: ``run`` returns once those it has end."""
        self._inbox.close()

    def report(self, job_id: str, cursor: int) -> RunnerReport:
        """Model ``job_id``'s metrics and events after ``cursor``, like a job runner's."""
        with self._lock:
            model = self._models.get(job_id)
            log = model.run if model is not None else self._refused.get(job_id)
        if log is not None:
            return log.report(cursor)
        stopped = self._inbox.stopped
        if stopped is not None:  # added after the end: never runs
            return RunnerReport(RunStatus.FAILED, 0, 0, (), (), stopped)
        return RunnerReport(RunStatus.RUNNING, 0, 0, (), (), None)

    # ----------------------------------------------------------------------- training

    def run(self) -> dict[str, RunStatus]:
        """Train every model to its steps (each ends SUCCEEDED, or FAILED, LOST or CANCELLED
        with why), taking new ones as they are added until ``close`` when ``keep_open``."""
        pool = self._make_pool(self._devices, self._budgets)
        try:
            self._loop(pool)
        except Exception as exc:  # the executor's boundary: its models fail with the reason
            reason = f"the SHARP executor failed: {one_line(exc)}"
            self._inbox.end(reason)
            for model in self._models.values():
                model.run.fail_if_running(reason)
        finally:
            self._inbox.end("the SHARP executor had stopped (closed)")
            pool.shutdown()
            self._writer.close()  # the checkpoints under way are written
        statuses = {job_id: log.status for job_id, log in self._refused.items()}
        statuses |= {job_id: m.status for job_id, m in self._models.items()}
        # Added, never placed: the executor failed first (``report`` says why).
        return statuses | {s.job_id: RunStatus.FAILED for s in self._inbox.arrivals()}

    def _loop(self, pool: HostPool) -> None:
        while True:
            self._inbox.begin_round()
            self._admit(pool)
            self._reap(pool)
            self._dispatch(pool)
            waiting: dict[Call, ModelRun | None] = dict.fromkeys(self._drop_calls)
            waiting |= {call: task.model for call, task in self._in_flight.items()}
            waiting |= self._copy_calls | self._trading.calls
            if waiting:
                done = self._wait(pool, waiting)
                # Copies first: a host took its part before its next task of the model, so
                # a step's end then finds the copy before it whole. Tasks in dispatch order:
                # a model's in its chain's.
                for call in [c for c in done if c in self._copy_calls]:
                    self._copied(pool, self._copy_calls.pop(call), call)
                for call in [c for c in done if c in self._trading.calls]:
                    self._handed(pool, call)
                for call in [c for c in done if c in self._drop_calls]:
                    self._dropped(pool, call)
                tasks = [c for c in done if c in self._in_flight]
                tasks.sort(key=lambda c: self._in_flight[c].number)
                for call in tasks:
                    self._complete(pool, self._in_flight.pop(call), call)
            elif not self._inbox.wait_for_more():
                return  # every model has ended and no more come

    def _wait(self, pool: HostPool, waiting: Mapping[Call, ModelRun | None]) -> list[Call]:
        """The calls of ``waiting`` that have ended (``wait_saying``). A device none of whose
        calls has ended for the task timeout meanwhile, while others' did or none did, is
        given up as hung (``scheduler.silence``): its calls end ``HostLost``, and its models
        roll back as from any loss."""
        self._silence.heard({c.host for c in waiting}, (), time.monotonic())
        try:
            wait_s = self._silence.left(time.monotonic())
            done = wait_saying(pool, waiting, wait_s, self._devices)
        except PoolTimeout:
            done = []
        ended = {c.host for c in done}
        now = time.monotonic()
        self._silence.heard({c.host for c in waiting if c not in done}, ended, now)
        give_up_hung(pool, self._silence.silent(now), self._timeout)
        return done

    def _reap(self, pool: HostPool) -> None:
        """End the models to stop (cancelled, or a checkpoint failed) with no task in flight
        and free their shards."""
        busy = self._busy_models()
        ending = self._inbox.stops(lambda j: j not in busy and j in self._models)
        for job_id, status, error in ending:
            model = self._models[job_id]
            if model.active:  # one that has trained all its steps freed its shards
                model.end(status, error)
                self._drop(pool, model)

    def _busy_models(self) -> set[str]:
        return {t.model.snap.job_id for t in self._in_flight.values()} | self._trading.busy()

    def _drop(self, pool: HostPool, model: ModelRun) -> None:
        """Free ``model``'s shards on their devices."""
        model.copying = None
        self._trading.call_off(model, self._models)
        job_id = model.snap.job_id
        for shard, host in zip(model.plan.shards, model.homes, strict=True):
            if self._homes.alive(host):  # after the tasks queued there: dispatch goes on
                self._drop_calls.add(pool.submit(host, "drop", (job_id, shard.index)))
        self._homes.release(model)

    def _dropped(self, pool: HostPool, call: Call) -> None:
        self._drop_calls.discard(call)
        try:
            pool.result(call)
        except HostLost as exc:  # its shards there are gone anyway; the others' roll back
            self._lose(pool, self._homes.host_of(exc.device_id), str(exc))

    # ----------------------------------------------------------------------- dispatch

    def _dispatch(self, pool: HostPool) -> None:
        """Keep every device's queue ``QUEUE_DEPTH`` calls deep, each a run of a model's
        next tasks whose shards it holds (``ModelPlan.run_at``: to its step's end or its
        next shard elsewhere) and whose input will be there in time: the device starts its
        next call as soon as it ends one, with no round trip through this loop between
        them, and a task's inputs come from the task before it in its model's chain
        without passing through here (kept on the device when that ran there too, else
        straight from that device). A run is one call of the worker: Ray's per-call cost
        (~2 ms on a busy 2-core machine) is paid once a run. Models trade places first."""
        if self._trades:
            self._trading.consider(pool, self._models, self._in_flight.values(), self._clock())
        queued = Counter(host for host, _ in {(t.host, t.run) for t in self._in_flight.values()})
        for depth in range(1, QUEUE_DEPTH + 1):  # a call for every device before a second
            for host, device in enumerate(self._devices):
                if queued[host] >= depth or not self._homes.alive(host):
                    continue
                budget = self._budgets[device.id]
                picked = self._pick(host, IdleDevice(device.id, 1.0, budget))
                if picked is None:
                    continue
                model, tasks = picked
                position, first = model.submitted, self._dispatched
                calls, copied = model.submit(pool, host, tasks, self._clock, self._timeout)
                now = self._clock()
                for i, call in enumerate(calls):
                    self._in_flight[call] = Task(model, host, position + i, first + i, first, now)
                self._copy_calls.update(dict.fromkeys(copied, model))
                self._dispatched += len(calls)
                model.last_run = self._dispatched - 1
                queued[host] += 1

    def _pick(self, host: int, device: IdleDevice) -> tuple[ModelRun, list[Assignment]] | None:
        """The policy's next run of tasks for ``host`` (``assign_run``) among the models that
        may queue one there (``ModelRun.can_submit``)."""
        here = [m for m in self._models.values() if m.can_submit(host)]
        if not here:
            return None
        plans = {m.snap.job_id: m.plan for m in self._models.values()}
        homes = {m.snap.job_id: m.homes for m in self._models.values()}
        runnable = [progress(m.plan, m.submitted, ratio=m.ratio, last_run=m.last_run) for m in here]
        run = assign_run(
            self._policy, device, runnable, plans, homes, host, sequence=self._dispatched
        )
        if run is None:
            return None
        if not self._prefetch:
            run = [replace(a, prefetch=None) for a in run]
        return self._models[run[0].task.model], run

    # --------------------------------------------------------------------- completion

    def _complete(self, pool: HostPool, task: Task, call: Call) -> None:
        """A task is done: its model moves on (and ends its step after its last task), or,
        when it failed, fails, or rolls back once its tasks in flight are done."""
        model = task.model
        try:
            result: TaskResult = pool.result(call)
        except ShardFailed as exc:
            if model.lost is None:  # else a consequence of the loss it rolls back from
                model.end(RunStatus.FAILED, str(exc))
        except HostLost as exc:  # on a device it lives on, or has just handed over
            if model.active:
                model.lost = model.lost or str(exc)
            self._lose(pool, task.host, str(exc))
        except InputLost as exc:  # its input was on a device lost meanwhile
            model.lost = model.lost or str(exc)
        else:
            if model.lost is None and model.status is RunStatus.RUNNING:
                self._account(pool, model, result)
        if model.lost is not None and model.snap.job_id not in self._busy_models():
            self._roll_back(pool, model)  # a step rolled back: the results since are dropped

    def _account(self, pool: HostPool, model: ModelRun, result: TaskResult) -> None:
        """The model's next task in its chain (``done``) finished with ``result``."""
        task = model.plan.task(model.done)
        self.promoted_bytes += result.promoted_bytes
        estimated = model.plan.task_s(model.done)
        model.ratio = refine_ratio(model.ratio, estimated, result.compute_s)
        model.timed = True
        model.step_compute_s += result.compute_s
        if result.losses:
            model.losses = result.losses
        if result.record is not None and model.ledger is not None:
            model.ledger.add(model.plan, model.done, result.record, time.time())
        model.done += 1
        if task.op is Op.BACKWARD and task.shard == 0:
            self._finish_step(pool, model, task.step + 1)

    def _finish_step(self, pool: HostPool, model: ModelRun, step: int) -> None:
        """Record ``step``, and take its copy (``keep_copies``) where one is due: as often
        as its measured cost allows (``scheduler.copies``). Its tasks took it as they went
        when that is at every step (``workers.sharp.ledger``); else the shards' hosts take
        it while the executor dispatches on (``_copied``), and a loss replays the steps
        since the last whole copy. A checkpoint is the copy too: the last step's is taken
        as a copy is (written once in, ``_copied``: the other models' tasks go on), any
        other's gather is waited for."""
        snap = model.snap
        model.left.clear()
        elapsed = self._clock() - model.step_started
        every = snap.checkpoint_every
        leave = self._inbox.suspending(snap.job_id) and step < snap.steps
        due = leave or step == snap.steps or (every > 0 and step % every == 0)
        copy_due = (
            snap.keep_copies
            and model.copying is None
            and model.cadence.steps_to_next(model.saved[0] if model.saved else None, step) == 0
        )
        ledger, model.ledger = model.ledger, None
        taken = None if ledger is None else ledger.copy(model.plan)
        again = ledger is not None and ledger.reopened  # recorded before a loss cut its copy
        if not again:  # recorded before its copy or gather: a loss there replays it
            if snap.keep_copies:
                model.cadence.observe_step(model.step_compute_s)
            speed = snap.batch_size / elapsed if elapsed > 0 else 0.0
            model.record(StepMetrics(step, float(sum(model.losses)), speed, elapsed, ()))
        blocks: dict[int, Any] = {}
        later = False  # its checkpoint is written once its hosts' copy is in (``_copied``)
        if taken is not None:  # its tasks took the copy: the checkpoint's states too
            blocks, model.copying = (taken if due else {}), None
        elif ledger is not None and ledger.waiting and not due:  # its last parts are coming
            parts = set(ledger.waiting)
            model.copying = Copying(step, parts, ledger.blocks(), ledger.seconds, ledger=ledger)
        elif step == snap.steps:  # the last: taken beside the tasks, as a copy is
            calls = model.start_copy(pool, step, self._timeout, checkpoint=True)
            self._copy_calls.update(dict.fromkeys(calls, model))
            later = True
        elif due:  # gathered now: the model leaves, or trains on from it
            try:
                blocks = gather(model, pool, self._timeout)
            except HostLost as exc:  # a shard's device went between the step and the gather
                self._lost_meanwhile(pool, model, exc)
                return
            except ShardFailed as exc:  # a host could not copy a shard of it
                self._not_checkpointed(pool, model, step, exc)
                return
            if snap.keep_copies:
                model.saved, model.copying = (step, blocks), None
        elif copy_due:
            calls = model.start_copy(pool, step, self._timeout)
            self._copy_calls.update(dict.fromkeys(calls, model))
        if taken is not None and ledger is not None:
            model.keep_copy(step, taken, ledger.seconds)
        if leave:
            model.leaving = True
            self._inbox.suspended(snap.job_id)
        if later:
            return
        if due:
            self._writer.write(model, step, blocks, self._devices, leave)
        if step == snap.steps or leave:
            self._drop(pool, model)  # it ends once its last checkpoint is written
        elif not self._trades:  # trading models move before any task instead
            try:
                models, timeout = self._models.values(), self._timeout
                move_if_sooner(model, self._homes, models, pool, step, blocks or None, timeout)
            except HostLost as exc:
                self._lost_meanwhile(pool, model, exc)
            except ShardFailed as exc:  # a host could not give or build a shard of it
                self._fail(pool, model, f"it could not move at step {step}: {exc}")

    def _copied(self, pool: HostPool, model: ModelRun, call: Call) -> None:
        """A host's part of ``model``'s copy is in (a stepped shard's, for the step's
        ``ledger``, or for the copy under way); once every part is, the copy replaces the
        model's last one, and what it took is the copies' measured cost. A part not made
        drops that copy (``ModelRun.drop_copy``): a loss rolls back to the one before."""
        copying, ledger = model.copying, model.ledger
        ours = ledger is not None and call in ledger.waiting
        if not ours and (copying is None or call not in copying.calls):
            return  # dropped meanwhile: the model rolled back, checkpointed or ended
        last = copying if not ours and copying is not None and copying.checkpoint else None
        try:
            states, seconds, finished = pool.result(call)
        except (ShardFailed, InputLost) as exc:  # not made: the call to start it failed
            if last is not None:
                self._not_checkpointed(pool, model, last.step, exc)
            else:
                model.drop_copy(exc.device_id, exc.reason, task_copied=ours)
            return
        except HostLost as exc:
            if last is not None:  # it rolls back and trains to its end again
                model.copying = None
                self._lost_meanwhile(pool, model, exc)
                return
            self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
            # Rolled back now or later (from what came of the copy: ``_roll_back``), or not
            # at all (its shards live elsewhere now): then this copy is never whole.
            if model.lost is None and model.copying is copying:
                model.copying = None
            return
        if ledger is not None and ledger.arrived(call, states, seconds, finished, time.time()):
            return
        whole = model.took_part(call, states, seconds, finished)
        if whole is not None and whole.checkpoint:
            self._writer.write(model, whole.step, whole.blocks, self._devices)
            self._drop(pool, model)  # it ends once its last checkpoint is written

    def _not_checkpointed(
        self, pool: HostPool, model: ModelRun, step: int, exc: ShardFailed | InputLost
    ) -> None:
        """A part of ``model``'s last checkpoint (of ``step``) was not made: the model
        fails, as when its checkpoint cannot be written."""
        self._fail(pool, model, f"its checkpoint of step {step} could not be taken: {exc}")
