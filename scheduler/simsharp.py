"""The SHARP engine of the simulator: the executor (``workers.sharp.runner``) as discrete events.

What it models is what the executor does, with the same decisions (``scheduler.sharp``):

- *Homes.* Each model's shards live on a device from the start (``home_shards``, the
  executor's own placement, models heaviest first: the host memory of the device's
  worker, which runs every task of the shard). Models trade places before any task
  (``Moves.TRADES``, the default: ``scheduler.simtrades``), each shard's state following
  when its task runs there, copied in as any task's shard is (the network as fast as the
  host link). Or (``Moves.AT_STEPS``) once the executor has seen a model's step end, it
  may move whole to another device where that ends both devices' work sooner
  (``move_target``), its state copied over at the device's bandwidth first.
- *Queues.* Each live device is kept ``depth`` tasks deep (the executor's calls are runs
  of a model's tasks, ``run_at``, but single tasks while they copy each step off, as here),
  choosing with ``assign`` among the models whose next task's shard lives there. The
  executor acts ``latency_s`` after a task ends and a task it submits reaches the device
  ``latency_s`` later. The first task of a step waits until the executor has seen the
  step before end (its copy, checkpoint or suspension).
- *A task* starts once its device has run the tasks queued before it and its input is
  there: at once when its producer ran on the same device (the worker's stash), else
  ``latency_s`` after the producer ended. Its shard's state is copied in at the device's
  bandwidth unless the device's last task ran the same shard; with prefetch the copy
  starts when the task reaches the device, behind the task before it (double buffering),
  so only what it takes beyond that is exposed. Then it computes for its reference seconds
  over the device's speed (times the model's ``truth``).
- *Copies* are taken as often as the engine's budget allows (``scheduler.copies``, from
  the model's copy and step seconds where it is placed): in a step that ends with one,
  each shard's backward copies its state off the device at its host bandwidth, delaying
  the device's next task.
- *Spot outages.* The device's tasks are lost; each model with a shard there goes on from
  its last task done where its copies are taken at every step (``Recovery.TASK``), else
  rolls back to its last copy; its tasks queued elsewhere are dropped and those running
  elsewhere wasted, its shards on the lost device re-homed on the live ones
  (``home_shards``); it runs on once the executor has seen its tasks in flight end. A
  device that comes back is empty until a model moves there.

Per event the work is a few heap operations and, per submission, one ``assign`` over the
models waiting at one device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from heapq import heappop, heappush

from shoal.scheduler.sharp import (
    IdleDevice,
    ModelId,
    ModelPlan,
    Policy,
    Progress,
    ShardError,
    assign,
    progress,
    refine_ratio,
    transfer_s,
)
from shoal.scheduler.sharp_homes import Home, home_shards, move_target
from shoal.scheduler.simcluster import Cluster
from shoal.scheduler.simhomes import Residency
from shoal.scheduler.simresult import SimulationError, Tally, TaskRecord
from shoal.scheduler.simstate import (
    ENGINE,
    GONE,
    Engine,
    Moves,
    Recovery,
    SimModel,
    SimQueue,
    SimTask,
    copy_every,
    stuck,
)
from shoal.scheduler.simtrades import Trading
from shoal.scheduler.types import DeviceId

_LOST, _BACK, _END, _WAKE, _SEE = range(5)
"""Event kinds, in the order they are handled at equal times."""


class _Sharp(Trading):
    """One run (mutable; ``run`` once)."""

    def __init__(
        self,
        cluster: Cluster,
        plans: Sequence[ModelPlan],
        policy: Policy,
        prefetch: bool,
        truth: Mapping[ModelId, float],
        engine: Engine,
        record: bool,
    ) -> None:
        self.cluster, self.policy, self.prefetch, self.truth = cluster, policy, prefetch, truth
        self.engine = engine
        self.devices: dict[DeviceId, SimQueue] = {}
        for d in cluster.devices():
            kind = d.kind
            idle = IdleDevice(d.id, kind.speed, kind.budget_bytes, kind.bandwidth_gbps)
            self.devices[d.id] = SimQueue(d, idle)
        self.plans = {p.model: p for p in plans}
        self.models: dict[ModelId, SimModel] = {}
        self.homes = Residency({name: d.idle for name, d in self.devices.items()})
        for plan in sorted(plans, key=lambda p: (-p.work_s, p.order, p.model)):  # as admitted
            homes = self._home(plan, range(len(plan.shards)))
            every = copy_every(plan, self.devices[homes[0]].idle, engine)
            model = SimModel(plan, homes, list(homes), copy_every=every)
            self.models[plan.model] = model
            self._settle(model)
        self.waiting: dict[DeviceId, set[ModelId]] = {d: set() for d in self.devices}
        """Models whose next task may be queued now, by the device its shard lives on."""
        self.stirred: set[DeviceId] = set()
        """Devices that may take a task since the last dispatch (a model filed there, a task
        of theirs seen end, back from an outage): what a dispatch looks at."""
        self.work_left = sum(p.work_s for p in plans)
        self.events: list[tuple[float, int, int, DeviceId, int]] = []
        self.homeless: set[ModelId] = set()
        """Models with shards on lost devices and no live device to move them to."""
        self.notes: dict[int, tuple[ModelId, int, int]] = {}
        """What each pending ``_SEE`` event tells the executor (``_note``)."""
        self.seq = self.sequence = 0
        self.left = len(plans)
        self.tally = Tally(tuple(self.devices), record)
        for outage in cluster.outages:
            if outage.device not in self.devices:
                raise SimulationError(f"outage of unknown device {outage.device}")
            self._event(outage.lost_s, _LOST, outage.device, 0)
            if outage.back_s is not None:
                self._event(outage.back_s, _BACK, outage.device, 0)
        for model in self.models.values():
            self._refresh(model)

    def run(self) -> Tally:
        now = 0.0
        self._dispatch(now)
        while self.left:
            if not self.events:
                raise SimulationError(stuck(self.devices.values(), self.models.values()))
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, kind, _, name, tag = heappop(self.events)
                device = self.devices[name]
                if kind == _LOST:
                    self._lose(device, now)
                elif kind == _BACK:
                    self._return(device, now)
                elif kind == _END:
                    self._end(device, tag, now)
                elif kind == _WAKE:
                    self._try_start(device, now)
                else:
                    self._see(device, tag, now)
            self._dispatch(now)
        return self.tally

    # ---------------------------------------------------------------------- bookkeeping

    def _event(self, time: float, kind: int, device: DeviceId, tag: int) -> None:
        self.seq += 1
        heappush(self.events, (time, kind, self.seq, device, tag))

    def _home(self, plan: ModelPlan, shards: Sequence[int]) -> list[DeviceId]:
        """Homes for ``shards`` of ``plan`` (all of them when it arrives, those of a lost
        device after), placed as the executor places them; their work counted there."""
        spread = self.engine.moves is Moves.TRADES
        load = self.homes.left_at if spread else self.homes.load  # level: what is to go
        live = [
            Home(name, d.idle.speed, load[name], d.idle.budget_bytes)
            for name, d in self.devices.items()
            if d.alive
        ]
        chosen = [plan.shards[i] for i in shards]
        try:
            homes = home_shards(chosen, plan.steps, live, spread=spread)
        except ShardError as exc:
            raise SimulationError(f"model {plan.model} cannot be placed: {exc}") from None
        for shard, home in zip(chosen, homes, strict=True):
            self.homes.load[home] += plan.steps * (shard.forward_s + shard.backward_s)
        return homes

    def _can_submit(self, model: SimModel, now: float) -> bool:
        """As ``workers.sharp.runner.SimModel.can_submit``: a next task, not the first of a
        step before the executor has seen the step before end, and its input there by the
        time its device gets to it (the task before it has ended, or runs there first)."""
        at, k = model.submitted, len(model.plan.shards)
        new_step = at % (2 * k) == 0
        home = model.homes[model.plan.shard_at(at).index] if at < model.plan.tasks else None
        return (
            at < model.plan.tasks
            and model.joining is None
            and now >= model.paused_until
            and (not new_step or model.seen >= at)
            and (model.seen >= at or model.last_device == home)
        )

    def _refresh(self, model: SimModel, now: float = 0.0) -> None:
        """File ``model`` under the device its next task may be queued on, if any, once it
        has traded places where that pays (``Moves.TRADES``)."""
        if self.engine.moves is Moves.TRADES and self._can_submit(model, now):
            if model.leaving is not None:
                self._maybe_hand_over(model, now)
            else:
                self._maybe_trade(model, now)
        self._file(model, now)

    def _file(self, model: SimModel, now: float) -> None:
        if model.waiting_at is not None:
            self.waiting[model.waiting_at].discard(model.plan.model)
            model.waiting_at = None
        if self._can_submit(model, now):
            home = model.homes[model.plan.shard_at(model.submitted).index]
            self.waiting[home].add(model.plan.model)
            self.stirred.add(home)
            model.waiting_at = home

    def _progress(self, model: SimModel) -> Progress:
        return progress(model.plan, model.submitted, ratio=model.ratio, last_run=model.last_run)

    def _task_s(self, model: SimModel, position: int, device: SimQueue) -> float:
        scale = self.truth.get(model.plan.model, 1.0)
        return model.plan.task_s(position) * scale / device.idle.speed

    # ------------------------------------------------------------------------ decisions

    def _dispatch(self, now: float) -> None:
        """The executor fills every live device's queue to ``depth``, a first task for each
        device before a second."""
        for depth in range(1, self.engine.depth + 1):
            for name in sorted(self.stirred):
                device = self.devices[name]
                while device.alive and device.in_flight < depth and self.waiting[name]:
                    here = [self.models[m] for m in sorted(self.waiting[name])]
                    chosen = assign(
                        self.policy,
                        device.idle,
                        [self._progress(m) for m in here],
                        self.plans,
                        sequence=self.sequence,
                    )
                    if chosen is None:
                        break  # homes are placed where shards fit: only a planning bug
                    self._submit(device, self.models[chosen.task.model], now)
        self.stirred = {d for d in self.stirred if self._has_room(self.devices[d])}

    def _has_room(self, device: SimQueue) -> bool:
        name = device.sim.id
        return device.alive and device.in_flight < self.engine.depth and bool(self.waiting[name])

    def _submit(self, device: SimQueue, model: SimModel, now: float) -> None:
        self.seq += 1
        arrive = now + self.engine.latency_s
        job = SimTask(self.seq, model.plan.model, model.submitted, model.epoch, arrive)
        if model.submitted % (2 * len(model.plan.shards)) == 0:
            model.input_at[model.submitted] = arrive  # the batch comes with the task
        device.queue.append(job)
        device.in_flight += 1
        model.submitted += 1
        model.last_device = device.sim.id
        model.last_run = self.sequence
        self.sequence += 1
        self._refresh(model, now)
        self._try_start(device, now)

    # ---------------------------------------------------------------------- the events

    def _try_start(self, device: SimQueue, now: float) -> None:
        """Start the device's first queued task if it can run now, or wake it when it can."""
        if not device.alive or device.running is not None or not device.queue:
            return
        job = device.queue[0]
        model = self.models[job.model]
        ready = model.input_at.get(job.position)
        if ready is None:
            return  # its producer has not ended: its end starts it
        begin = max(now, job.arrive_s, ready)
        if begin > now:
            if device.woken != begin:
                device.woken = begin
                self._event(begin, _WAKE, device.sim.id, 0)
            return
        device.queue.popleft()
        shard = model.plan.shard_at(job.position)
        copy = 0.0
        if device.last != (job.model, shard.index):
            copy = transfer_s(shard.state_bytes, device.idle)
            if self.prefetch:  # copied in since it reached the device
                copy = max(0.0, job.arrive_s + copy - now)
        device.last = (job.model, shard.index)
        if model.copies_after(job.position) and not self.engine.overlapped:  # after its step
            copy += transfer_s(shard.state_bytes, device.idle)
        job.start_s, job.copy_s = now, copy
        job.compute_s = self._task_s(model, job.position, device)
        if model.forward_again(job.position, device.sim.id):
            job.compute_s += shard.forward_s * self.truth.get(job.model, 1.0) / device.idle.speed
        model.held[shard.index] = device.sim.id
        device.running = job
        self._event(now + copy + job.compute_s, _END, device.sim.id, job.ident)

    def _end(self, device: SimQueue, ident: int, now: float) -> None:
        job = device.running
        if job is None or job.ident != ident:
            return  # lost with its device
        device.running = None
        model = self.models[job.model]
        plan = model.plan
        valid = job.epoch == model.epoch
        record = TaskRecord(
            device.sim.id,
            job.model,
            job.position,
            job.start_s,
            now,
            valid,
            plan.shard_at(job.position).bytes,
        )
        number = self.tally.ran(
            record, job.compute_s if valid else 0.0, job.copy_s if valid else 0.0
        )
        if valid:
            model.step_runs.append((number, device.sim.id, job.compute_s, job.copy_s))
            model.done = job.position + 1
            estimated = plan.task_s(job.position) / device.idle.speed
            model.ratio = refine_ratio(model.ratio, estimated, job.compute_s)
            self.work_left -= plan.task_s(job.position)
            self.homes.advance(job.model, model.homes[0], plan.task_s(job.position))
            if model.done == plan.tasks:
                self.left -= 1
                if model.leaving is not None:  # its taker need not wait
                    taker = self.models[model.leaving[1]]
                    self._hand_over(model)
                    self._file(taker, now)
                self._unsettle(model)
            elif model.copied():
                model.step_runs = []  # what a loss rolls back to
            else:
                after = model.homes[plan.shard_at(model.done).index]
                there = 0.0 if after == device.sim.id else self.engine.latency_s
                model.input_at[model.done] = now + there
                self._try_start(self.devices[after], now)
        seen_at = now + self.engine.latency_s
        self._note(seen_at, device.sim.id, job.model, job.position + 1, job.epoch)
        self._try_start(device, now)

    def _note(self, at: float, device: DeviceId, model: ModelId, done: int, epoch: int) -> None:
        """The executor learns at ``at`` that ``model`` has ``done`` tasks done (as of
        ``epoch``), a task of ``device`` having ended (or, ``done`` -1, that it may go on
        after a loss)."""
        self.notes[self.seq + 1] = (model, done, epoch)
        self._event(at, _SEE, device, self.seq + 1)

    def _see(self, device: SimQueue, tag: int, now: float) -> None:
        name, done, epoch = self.notes.pop(tag)
        model = self.models[name]
        if done >= 0:
            device.in_flight = max(0, device.in_flight - 1)
            self.stirred.add(device.sim.id)
            if epoch == model.epoch:
                model.seen = max(model.seen, done)
                at_boundary = done == model.submitted and done % (2 * len(model.plan.shards)) == 0
                at_steps = self.engine.moves is Moves.AT_STEPS
                if at_boundary and done < model.plan.tasks and at_steps:
                    self._maybe_move(model, now)
        self._refresh(model, now)

    def _maybe_move(self, model: SimModel, now: float) -> None:
        """At a step boundary the model moves whole to the live device where that ends the
        two devices' work soonest, if sooner than staying (``move_target``, the executor's
        rule)."""
        home = self.devices[model.homes[0]]
        plan = model.plan
        state = sum(s.state_bytes for s in plan.shards)
        here = (self.homes.left_at[home.sim.id], home.idle.speed)
        others = {
            name: (self.homes.left_at[name], device.idle.speed, transfer_s(state, device.idle))
            for name, device in self.devices.items()
            if device.alive and name != home.sim.id
        }
        there = move_target(plan.remaining_s(model.done), here, others)
        if there is None:
            return
        copy_s = others[there][2]
        self._relocate(model, there)
        model.held = list(model.homes)
        if copy_s > 0:  # its state is copied over before its next step
            model.paused_until = now + copy_s
            self._note(model.paused_until, there, plan.model, -1, model.epoch)

    def _relocate(self, model: SimModel, there: DeviceId) -> None:
        """``model`` lives on ``there`` from now on, all its shards and their placed work."""
        plan = model.plan
        self._unsettle(model)
        for shard in plan.shards:
            work = plan.steps * (shard.forward_s + shard.backward_s)
            self.homes.load[model.homes[shard.index]] -= work
            self.homes.load[there] += work
        model.homes = [there] * len(plan.shards)
        self._settle(model)

    def _settle(self, model: SimModel) -> None:
        """Count ``model`` (with work left) on its home device."""
        left = model.plan.remaining_s(model.done)
        self.homes.settle(model.plan.model, model.homes[0], left)

    def _unsettle(self, model: SimModel) -> None:
        """No longer count ``model`` on its home (it ended, moves or lost its device)."""
        self.homes.unsettle(model.plan.model, model.homes[0])

    def _return(self, device: SimQueue, now: float) -> None:
        """A device is back, empty; models that had no device left live on it."""
        if device.alive:
            return
        device.alive = True
        self.stirred.add(device.sim.id)
        self.homes.set_alive(device.sim.id, True)
        for name in sorted(self.homeless):
            model = self.models[name]
            self._unsettle(model)
            self._rehome(model)
            self._settle(model)
            self._refresh(model, now)

    def _lose(self, device: SimQueue, now: float) -> None:
        if not device.alive:
            return
        device.alive = False
        self.homes.set_alive(device.sim.id, False)
        job, name = device.running, device.sim.id
        # Models with a task there roll back too: one that moved away may have left one.
        tasked = {j.model for j in [*device.queue, *([job] if job else [])]}
        if job is not None:
            bytes_ = self.models[job.model].plan.shard_at(job.position).bytes
            record = TaskRecord(name, job.model, job.position, job.start_s, now, False, bytes_)
            self.tally.ran(record, 0.0, 0.0)
        device.running, device.queue, device.in_flight, device.last = None, deque(), 0, None
        for model in self.models.values():
            there = name in model.homes or name in model.held or model.plan.model in tasked
            if there and model.done < model.plan.tasks:
                self._roll_back(model, now)

    def _roll_back(self, model: SimModel, now: float) -> None:
        """Back to its last task done or its last copy (``SimModel.rewind``): its queued
        tasks dropped, those running elsewhere wasted, its shards on lost devices re-homed;
        it runs on once the executor has seen them end."""
        plan = model.plan
        self._call_off(model, now)
        self._unsettle(model)
        model.epoch += 1
        busy_until = now
        for device in self.devices.values():
            if device.running is not None and device.running.model == plan.model:
                job = device.running
                busy_until = max(busy_until, job.start_s + job.copy_s + job.compute_s)
            kept = deque(j for j in device.queue if j.model != plan.model)
            if len(kept) < len(device.queue):
                device.in_flight -= len(device.queue) - len(kept)
                device.queue = kept
                self.stirred.add(device.sim.id)
        self._rehome(model)
        self.work_left += model.rewind(self.tally, self.engine.recovery is Recovery.TASK)
        start = model.done
        model.paused_until = busy_until + self.engine.latency_s
        model.input_at = {start: model.paused_until}  # the batch, or the copied output
        self._settle(model)
        self._note(model.paused_until, model.homes[0], plan.model, -1, model.epoch)
        self._refresh(model, now)

    def _rehome(self, model: SimModel) -> None:
        """Its shards on lost devices go to live ones (as the executor re-homes them); with
        none live, it waits for a device to come back. Each shard's state is its copy's,
        at home; a forward's graph on a lost device is ``GONE``."""
        plan = model.plan
        orphans = [s.index for s in plan.shards if not self.devices[model.homes[s.index]].alive]
        if orphans and not any(d.alive for d in self.devices.values()):
            self.homeless.add(plan.model)
        elif orphans:
            self.homeless.discard(plan.model)
            for index, home in zip(orphans, self._home(plan, orphans), strict=True):
                shard = plan.shards[index]
                work = plan.steps * (shard.forward_s + shard.backward_s)
                self.homes.load[model.homes[index]] -= work
                model.homes[index] = home
        model.held = [
            home if held != GONE and self.devices[held].alive else GONE
            for held, home in zip(model.held, model.homes, strict=True)
        ]


def run_sharp(
    cluster: Cluster,
    plans: Sequence[ModelPlan],
    policy: Policy,
    *,
    prefetch: bool = True,
    truth: Mapping[ModelId, float] | None = None,
    engine: Engine = ENGINE,
    record: bool = False,
) -> Tally:
    """Train ``plans`` together on ``cluster`` with SHARP under ``policy``."""
    return _Sharp(cluster, plans, policy, prefetch, truth or {}, engine, record).run()
