"""The SHARP engine of the simulator: a discrete-event run of ``scheduler.sharp``'s decisions.

The model of a run:

- A task computes for its reference seconds over the device's speed (times the model's
  ``truth`` factor: how much slower it really is than estimated, which Sharded-LRTF's
  measured-ratio refinement is there to learn).
- Copy-in: a task first promotes its shard's state from host memory at the device's
  bandwidth (the slower of it and the network's where the state's host is another node),
  unless a copy of that shard is already on the device. Copy-out (spilling a finished shard
  asynchronously, so the host always holds the state of a model's last completed task) and
  the few bytes of saved boundary activations are not charged.
- Prefetch (Hydra's double buffering): while a task computes, the device's next shard is
  copied in beside it, so only the part of that copy longer than the compute is exposed.
  The next task is chosen as late as the copy allows (``lookahead`` when the remaining
  compute equals the longest copy; the assignment's own ``prefetch`` when the task is
  shorter than that), because a decision taken at the start of a long task sees a stale
  queue. A waiting model so chosen is promised to the device; the device's own model's next
  shard is copied speculatively and the model competes again when the task ends (an idle,
  faster device may still take it). Without prefetch copies serialize with compute.
- A spot outage ends its device's in-flight task (its work is lost, the model redoes it from
  its last completed task), voids the device's promise and empties it; a device may come
  back, empty.
- Beside the idle devices, ``assign`` is offered the busy device of each class that is free
  soonest, with the lower bound of the work left as its horizon: on a heterogeneous
  cluster a model that starting on a slow device now would make late waits for a fast one
  (as a model with no device does, competing again at the next event).

Per event the work is a few heap operations and one ``assign`` over a shortlist of idle
devices (per device class the first few, plus those near the candidates' state) and one
busy device per class.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush

from scheduler.memory import format_bytes
from scheduler.sharp import (
    Assignment,
    IdleDevice,
    Locality,
    ModelId,
    ModelPlan,
    Policy,
    Priority,
    Progress,
    Residence,
    assign,
    lookahead,
    priority,
    progress,
    refine_ratio,
    transfer_s,
)
from scheduler.simcluster import Cluster, SimDevice, capacity
from scheduler.simresult import SimulationError, Tally, TaskRecord
from scheduler.types import DeviceId, NodeId

_LOOK, _DONE, _LOST, _BACK = 0, 1, 2, 3
"""Event kinds, in the order they are handled at equal times."""

_PEEK = 8
"""Waiting models a busy device considers for its next task (enough unless many of the best
do not fit it)."""


@dataclass
class _Job:
    ident: int
    model: ModelId
    position: int
    start_s: float
    end_s: float
    compute_s: float
    copy_s: float
    device_bytes: int


@dataclass
class _Device:
    sim: SimDevice
    idle: IdleDevice
    look_s: float
    """The longest copy-in this device may need: how long before a task's end it decides."""
    alive: bool = True
    epoch: int = 0
    job: _Job | None = None
    next: ModelId | None = None
    """A waiting model promised this device's next task (its shard is being copied in)."""
    copies: dict[ModelId, tuple[int, float]] = field(default_factory=dict)
    """Shard copies held: model -> (the position they serve, when the copy is complete)."""


class _IdleIndex:
    """Idle devices by class (sorted ids) and node, to shortlist the few ``assign`` needs."""

    def __init__(self, devices: Mapping[DeviceId, _Device]) -> None:
        self.devices = devices
        self.classes: dict[tuple[float, float, int], list[DeviceId]] = {}
        self.nodes: dict[NodeId, set[DeviceId]] = {}
        self.ids: set[DeviceId] = set()

    @staticmethod
    def _key(d: IdleDevice) -> tuple[float, float, int]:
        return (d.speed, d.bandwidth_gbps, d.budget_bytes)

    def add(self, d: IdleDevice) -> None:
        insort(self.classes.setdefault(self._key(d), []), d.device)
        self.nodes.setdefault(d.node, set()).add(d.device)
        self.ids.add(d.device)

    def remove(self, d: IdleDevice) -> None:
        ids = self.classes[self._key(d)]
        del ids[bisect_left(ids, d.device)]
        self.nodes[d.node].discard(d.device)
        self.ids.discard(d.device)

    def shortlist(self, width: int, homes: Iterable[Residence]) -> list[IdleDevice]:
        """Idle devices enough for ``assign`` to decide as over all of them: in each class
        the first ``width`` (more than the candidates plus one node's devices), and every
        idle device where a candidate's shard is."""
        chosen: set[DeviceId] = set()
        for ids in self.classes.values():
            chosen.update(ids[:width])
        for home in homes:
            if home.device in self.ids:
                chosen.add(home.device)
            if home.node is not None:
                chosen.update(self.nodes.get(home.node, ()))
        return [self.devices[d].idle for d in sorted(chosen)]


class _BusyIndex:
    """Busy devices by class, the soonest done first: per class the one a model may choose
    to wait for (entries of tasks that ended or were lost are dropped as they come up)."""

    def __init__(self, devices: Mapping[DeviceId, _Device]) -> None:
        self.devices = devices
        self.classes: dict[tuple[float, float, int], list[tuple[float, int, DeviceId]]] = {}

    def add(self, device: _Device, job: _Job) -> None:
        key = _IdleIndex._key(device.idle)
        heappush(self.classes.setdefault(key, []), (job.end_s, job.ident, device.sim.id))

    def soonest(self, now: float, after: Callable[[_Device], float]) -> list[IdleDevice]:
        """The first busy device of each class to be free, ``free_in_s`` from ``now``: once
        its task and the task it is promised next (``after`` it, in seconds) are done."""
        offered = []
        for heap in self.classes.values():
            while heap:
                end, ident, name = heap[0]
                device = self.devices[name]
                if device.job is not None and device.job.ident == ident:
                    free = end - now + after(device)
                    offered.append(replace(device.idle, free_in_s=free))
                    break
                heappop(heap)  # that task is over
        return offered


class _Sharp:
    """One run (mutable; ``run`` once)."""

    def __init__(
        self,
        cluster: Cluster,
        plans: Sequence[ModelPlan],
        policy: Policy,
        prefetch: bool,
        truth: Mapping[ModelId, float],
        record: bool,
    ) -> None:
        self.cluster, self.policy, self.prefetch, self.truth = cluster, policy, prefetch, truth
        self.plans = {p.model: p for p in plans}
        largest = max((s.state_bytes for p in plans for s in p.shards), default=0)
        sims = cluster.devices()
        remote = len({d.node for d in sims}) > 1
        self.devices: dict[DeviceId, _Device] = {}
        for d in sims:
            kind = d.kind
            idle = IdleDevice(d.id, d.node, kind.speed, kind.budget_bytes, kind.bandwidth_gbps)
            look = transfer_s(largest, idle, remote, cluster.network_gbps)
            self.devices[d.id] = _Device(d, idle, look)
        self.idle = _IdleIndex(self.devices)
        self.busy = _BusyIndex(self.devices)
        self.speeds = Counter(d.idle.speed for d in self.devices.values())
        """Devices up, by speed."""
        self.work_left = sum(p.work_s for p in plans)
        """Reference seconds of the tasks not done yet."""
        for device in self.devices.values():
            self.idle.add(device.idle)
        self.done = dict.fromkeys(self.plans, 0)
        self.ratio = dict.fromkeys(self.plans, 1.0)
        self.last_run = dict.fromkeys(self.plans, -1)
        self.host: dict[ModelId, NodeId | None] = dict.fromkeys(self.plans)
        self.holder: dict[ModelId, DeviceId | None] = dict.fromkeys(self.plans)
        self.running: set[ModelId] = set()
        self.ready: list[tuple[Priority, ModelId]] = []
        self.events: list[tuple[float, int, int, DeviceId, int]] = []
        self.seq = self.sequence = 0
        self.left = len(self.plans)
        self.tally = Tally(tuple(self.devices), record)
        for outage in cluster.outages:
            if outage.device not in self.devices:
                raise SimulationError(f"outage of unknown device {outage.device}")
            self._event(outage.lost_s, _LOST, outage.device, 0)
            if outage.back_s is not None:
                self._event(outage.back_s, _BACK, outage.device, 0)
        for model in self.plans:
            self._push(model)

    def run(self) -> Tally:
        now = 0.0
        self._dispatch(now)
        while self.left:
            if not self.events:
                raise SimulationError(self._stuck())
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, kind, _, name, tag = heappop(self.events)
                device = self.devices[name]
                if kind == _LOOK:
                    self._look(device, tag, now)
                elif kind == _DONE:
                    self._finish(device, tag, now)
                elif kind == _LOST:
                    self._lose(device, now)
                else:
                    self._return(device)
            self._dispatch(now)
        return self.tally

    # ---------------------------------------------------------------------- bookkeeping

    def _event(self, time: float, kind: int, device: DeviceId, tag: int) -> None:
        self.seq += 1
        heappush(self.events, (time, kind, self.seq, device, tag))

    def _progress(self, model: ModelId) -> Progress:
        return progress(
            self.plans[model],
            self.done[model],
            ratio=self.ratio[model],
            last_run=self.last_run[model],
        )

    def _push(self, model: ModelId) -> None:
        """A model becomes runnable; its priority is fixed until it runs again (Sharded-LRTF:
        only the model that just ran changes its remaining time)."""
        heappush(self.ready, (priority(self.policy, self._progress(model)), model))

    def _copy_s(self, size: int, device: _Device, host: NodeId | None) -> float:
        remote = host is not None and host != device.sim.node
        return transfer_s(size, device.idle, remote, self.cluster.network_gbps)

    def _clear(self, device: _Device) -> None:
        """Drop every shard copy ``device`` holds (evicted, or lost with it)."""
        for model in device.copies:
            if self.holder[model] == device.sim.id:
                self.holder[model] = None
        device.copies = {}

    # ------------------------------------------------------------------------ decisions

    def _dispatch(self, now: float) -> None:
        """Give idle devices tasks, in batches of the policy's best runnable models."""
        passed: list[tuple[Priority, ModelId]] = []
        while self.ready and self.idle.ids:
            width = min(len(self.ready), 2 * len(self.idle.ids) + 1)
            batch = [heappop(self.ready) for _ in range(width)]
            homes = {m: Residence(self.holder[m], self.host[m]) for _, m in batch}
            idle = self.idle.shortlist(width + self.cluster.per_node + 1, homes.values())
            chosen = assign(
                self.policy,
                idle + self.busy.soonest(now, self._promised_s),
                [self._progress(m) for _, m in batch],
                self.plans,
                homes,
                sequence=self.sequence,
                network_gbps=self.cluster.network_gbps,
                horizon_s=self._horizon_s(),
            )
            taken = {a.task.model for a in chosen}
            for a in chosen:
                promised = self._start(a, now)
                if promised is not None:
                    taken.add(promised)
            passed.extend(entry for entry in batch if entry[1] not in taken)
        for entry in passed:
            heappush(self.ready, entry)

    def _promised_s(self, device: _Device) -> float:
        """Seconds of the task ``device`` is promised next (0: none)."""
        if device.next is None:
            return 0.0
        plan = self.plans[device.next]
        return plan.task_s(self.done[device.next]) * self.ratio[device.next] / device.idle.speed

    def _horizon_s(self) -> float:
        """When the work left could be done at the soonest: over the capacity of the
        fastest devices up, one per model left (the lower bound, from now)."""
        rate = capacity(self.speeds, self.left)
        return self.work_left / rate if rate > 0 else math.inf

    def _look(self, device: _Device, ident: int, now: float) -> None:
        """The last moment to choose the device's next task and still hide its copy."""
        job = device.job
        if job is None or job.ident != ident or device.next is not None:
            return
        batch = [heappop(self.ready) for _ in range(min(_PEEK, len(self.ready)))]
        waiting = [self._progress(m) for _, m in batch]
        current = self._progress(job.model)
        nxt = lookahead(self.policy, device.idle, current, self.plans, waiting, stamp=self.sequence)
        promised = None if nxt is None else self._prefetch(device, nxt.model, now)
        for entry in batch:
            if entry[1] != promised:
                heappush(self.ready, entry)

    def _prefetch(self, device: _Device, model: ModelId, at: float) -> ModelId | None:
        """Copy ``model``'s next shard onto the busy ``device`` from ``at``; returns it when
        it is a waiting model, now promised to this device."""
        job = device.job
        if job is None:
            return None
        position = job.position + 1 if model == job.model else self.done[model]
        shard = self.plans[model].shard_at(position)
        current = self.plans[job.model].shard_at(job.position)
        if model != job.model or shard.index != current.index:  # else it stays: no copy
            ready = at + self._copy_s(shard.state_bytes, device, self.host[model])
            device.copies[model] = (position, ready)
            job.device_bytes += shard.bytes
        if model == job.model:
            return None
        device.next = model
        return model

    # ---------------------------------------------------------------------- the events

    def _start(self, a: Assignment, now: float) -> ModelId | None:
        """Run ``a``; returns the waiting model it promised the device next, if any."""
        device, model = self.devices[a.device], a.task.model
        plan, position = self.plans[model], self.done[model]
        shard = plan.shard_at(position)
        copy = device.copies.get(model)
        if copy is not None and copy[0] == position:
            copy_s = max(0.0, copy[1] - now)
        else:
            copy_s = self._copy_s(shard.state_bytes, device, self.host[model])
        holder = self.holder[model]
        if holder is not None:  # its copies elsewhere go stale as it runs
            self.devices[holder].copies.pop(model, None)
            self.holder[model] = None
        self._clear(device)
        if device.sim.id in self.idle.ids:
            self.idle.remove(device.idle)
        compute_s = plan.task_s(position) * self.truth.get(model, 1.0) / device.idle.speed
        begin = now + copy_s
        end = begin + compute_s
        self.seq += 1
        device.job = _Job(self.seq, model, position, now, end, compute_s, copy_s, shard.bytes)
        self.busy.add(device, device.job)
        self.running.add(model)
        self.last_run[model] = self.sequence
        self.sequence += 1
        self._event(end, _DONE, device.sim.id, device.epoch)
        if not self.prefetch:
            return None
        look = end - device.look_s
        if a.prefetch is not None and look <= begin:  # decided now: the copy starts at once
            return self._prefetch(device, a.prefetch.model, begin)
        self._event(max(begin, look), _LOOK, device.sim.id, device.job.ident)
        return None

    def _finish(self, device: _Device, epoch: int, now: float) -> None:
        job = device.job
        if job is None or epoch != device.epoch:
            return  # the device was lost meanwhile: this task already went back
        device.job = None
        model, plan = job.model, self.plans[job.model]
        record = TaskRecord(
            device.sim.id, model, job.position, job.start_s, now, True, job.device_bytes
        )
        self.tally.ran(record, job.compute_s, job.copy_s)
        self.running.discard(model)
        estimated = plan.task_s(job.position) / device.idle.speed
        self.ratio[model] = refine_ratio(self.ratio[model], estimated, job.compute_s)
        done = self.done[model] = job.position + 1
        self.work_left -= plan.task_s(job.position)
        self.host[model] = device.sim.node
        if done == plan.tasks:
            self.left -= 1
        else:
            if plan.shard_at(done).index == plan.shard_at(job.position).index:
                device.copies[model] = (done, now)  # its next task needs this very shard
            self._push(model)
        promised, device.next = device.next, None
        if promised is not None:
            task = self.plans[promised].task(self.done[promised])
            self._start(Assignment(device.sim.id, task, Locality.RESIDENT, None), now)
            return
        for other, (at, _) in device.copies.items():
            fresh = other not in self.running and self.done[other] == at
            if fresh and self.holder[other] is None:
                self.holder[other] = device.sim.id
        self.idle.add(device.idle)

    def _lose(self, device: _Device, now: float) -> None:
        if not device.alive:
            return
        device.alive = False
        device.epoch += 1
        self.speeds[device.idle.speed] -= 1
        job, promised = device.job, device.next
        device.job = device.next = None
        if job is None:
            self.idle.remove(device.idle)
        else:  # only the in-flight task is lost: the host keeps the last completed state
            record = TaskRecord(
                device.sim.id, job.model, job.position, job.start_s, now, False, job.device_bytes
            )
            self.tally.ran(record, 0.0, 0.0)
            self.running.discard(job.model)
            self._push(job.model)
        if promised is not None:
            self._push(promised)  # the promise is void: it waits like the others
        self._clear(device)

    def _return(self, device: _Device) -> None:
        if device.alive:
            return
        device.alive = True
        self.speeds[device.idle.speed] += 1
        device.copies = {}
        self.idle.add(device.idle)

    def _stuck(self) -> str:
        up = [d for d in self.devices.values() if d.alive]
        if not up or not self.ready:
            return (
                f"{self.left} model(s) cannot finish: every device is lost and none comes back;"
                " add devices or expect fewer outages"
            )
        _, model = min(self.ready)
        shard = self.plans[model].shard_at(self.done[model])
        largest = max(d.idle.budget_bytes for d in up)
        return (
            f"model {model} cannot finish: shard {shard.index} needs"
            f" {format_bytes(shard.bytes)} but the largest device that is up has"
            f" {format_bytes(largest)}; cut its shards for the smallest device"
        )


def run_sharp(
    cluster: Cluster,
    plans: Sequence[ModelPlan],
    policy: Policy,
    *,
    prefetch: bool = True,
    truth: Mapping[ModelId, float] | None = None,
    record: bool = False,
) -> Tally:
    """Train ``plans`` together on ``cluster`` with SHARP under ``policy``."""
    return _Sharp(cluster, plans, policy, prefetch, truth or {}, record).run()
