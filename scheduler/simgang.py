"""The simulator's baselines: each model holds its own gang of devices until it finishes.

What SHARP is measured against (Hydra's comparison):

- *Model-parallel, one model at a time*: each model in turn is sharded over the devices
  (its shards packed onto the fastest devices that hold them, every shard resident), with
  no overlap between models. A model's step is a sequential chain with one task in flight,
  so only one device computes at a time.
- *Task-parallel where it fits*: models taken FIFO; a model runs alone on one free device
  where its whole state fits (the fastest such), else model-parallel over the free devices
  it needs; the queue's head waits for room (no overtaking).

A gang's devices keep the model's shards resident: each shard is copied in once. With
``prefetch`` every device of a new gang starts copying its shards in at once, in chain order,
and a task waits only for its own shard; without it a shard is copied when its first task
runs. A device holding shards ``S`` needs their state plus the largest one's activations
(one shard computes at a time). A spot outage in a gang ends the task on that device (the
work is lost) or, if the model's task runs elsewhere, lets that task finish; the model then
goes back to the head of the queue and is placed again from its last completed task.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

from shoal.scheduler.memory import format_bytes
from shoal.scheduler.sharp import IdleDevice, ModelId, ModelPlan, Shard, transfer_s
from shoal.scheduler.simcluster import Cluster, SimDevice
from shoal.scheduler.simresult import SimulationError, Tally, TaskRecord
from shoal.scheduler.types import DeviceId

_DONE, _LOST, _BACK = 0, 1, 2

Placement = dict[int, DeviceId]
"""Shard index -> the gang device holding it."""


def need_bytes(shards: Sequence[Shard]) -> int:
    """A device holding ``shards``: all their state, and one shard's activations at a time."""
    return sum(s.state_bytes for s in shards) + max((s.activation_bytes for s in shards), default=0)


def pack(shards: Sequence[Shard], devices: Sequence[SimDevice]) -> Placement | None:
    """Consecutive shards onto ``devices`` in order, each taking as many as fit; None when
    they run out first."""
    placement: Placement = {}
    i = 0
    for device in devices:
        held: list[Shard] = []
        while i < len(shards) and need_bytes([*held, shards[i]]) <= device.kind.budget_bytes:
            held.append(shards[i])
            placement[i] = device.id
            i += 1
        if i == len(shards):
            return placement
    return None


@dataclass
class _Run:
    ident: int
    device: DeviceId
    position: int
    start_s: float
    compute_s: float
    copy_s: float
    device_bytes: int


class _Gangs:
    """One run of the gang engine (mutable; ``run`` once)."""

    def __init__(
        self,
        cluster: Cluster,
        plans: Sequence[ModelPlan],
        one_at_a_time: bool,
        prefetch: bool,
        truth: Mapping[ModelId, float],
        record: bool,
    ) -> None:
        self.cluster, self.one, self.prefetch, self.truth = cluster, one_at_a_time, prefetch, truth
        self.plans = {p.model: p for p in plans}
        self.devices = {d.id: d for d in cluster.devices()}
        self.links = {
            d.id: IdleDevice(d.id, d.kind.speed, d.kind.budget_bytes, d.kind.bandwidth_gbps)
            for d in self.devices.values()
        }
        self.free = sorted(self._rank(d) for d in self.devices.values())
        self.alive = set(self.devices)
        self.queue = deque(p.model for p in sorted(plans, key=lambda p: (p.order, p.model)))
        self.done = dict.fromkeys(self.plans, 0)
        self.gangs: dict[ModelId, Placement] = {}
        self.owner: dict[DeviceId, ModelId] = {}
        self.ready: dict[ModelId, dict[int, float]] = {}
        self.running: dict[ModelId, _Run] = {}
        self.broken: set[ModelId] = set()
        self.events: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.left = len(self.plans)
        self.tally = Tally(tuple(self.devices), record)
        for outage in cluster.outages:
            if outage.device not in self.devices:
                raise SimulationError(f"outage of unknown device {outage.device}")
            self._event(outage.lost_s, _LOST, outage.device, 0)
            if outage.back_s is not None:
                self._event(outage.back_s, _BACK, outage.device, 0)

    def _rank(self, d: SimDevice) -> tuple[float, int, DeviceId]:
        """Fastest first, then the most memory, then the id."""
        return (-d.kind.speed, -d.kind.budget_bytes, d.id)

    def _event(self, time: float, kind: int, key: str, tag: int) -> None:
        self.seq += 1
        heappush(self.events, (time, kind, self.seq, key, tag))

    def run(self) -> Tally:
        now = 0.0
        self._admit(now)
        while self.left:
            if not self.events:
                raise SimulationError(self._stuck())
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, kind, _, key, tag = heappop(self.events)
                if kind == _DONE:
                    self._finish(key, tag, now)
                elif kind == _LOST:
                    self._lose(key, now)
                elif key not in self.alive:
                    self.alive.add(key)
                    insort(self.free, self._rank(self.devices[key]))
            self._admit(now)
        return self.tally

    def _place(self, plan: ModelPlan) -> Placement | None:
        free = [self.devices[d] for _, _, d in self.free]
        if not self.one:
            whole = need_bytes(plan.shards)
            alone = next((d for d in free if whole <= d.kind.budget_bytes), None)
            if alone is not None:
                return dict.fromkeys(range(len(plan.shards)), alone.id)
        return pack(plan.shards, free)

    def _admit(self, now: float) -> None:
        """Start queued models, FIFO, while the head finds room (one at a time if asked)."""
        while self.queue and not (self.one and self.gangs):
            model = self.queue[0]
            plan = self.plans[model]
            placement = self._place(plan)
            if placement is None:
                return
            self.queue.popleft()
            self.gangs[model] = placement
            for device in set(placement.values()):
                self.owner[device] = model
                del self.free[bisect_left(self.free, self._rank(self.devices[device]))]
            self.ready[model] = {}
            if self.prefetch:  # every gang device copies its shards in now, in chain order
                clock: dict[DeviceId, float] = {}
                for i, device in sorted(placement.items()):
                    sim = self.devices[device]
                    clock[device] = clock.get(device, now) + self._copy_s(plan.shards[i], sim)
                    self.ready[model][i] = clock[device]
            self._start(model, now)

    def _copy_s(self, shard: Shard, device: SimDevice) -> float:
        return transfer_s(shard.state_bytes, self.links[device.id])

    def _start(self, model: ModelId, now: float) -> None:
        plan, position = self.plans[model], self.done[model]
        shard = plan.shard_at(position)
        placement = self.gangs[model]
        device = self.devices[placement[shard.index]]
        ready = self.ready[model].get(shard.index)
        if ready is None:  # copied in on first use
            copy_s = self._copy_s(shard, device)
            self.ready[model][shard.index] = now + copy_s
        else:
            copy_s = max(0.0, ready - now)
        compute_s = plan.task_s(position) * self.truth.get(model, 1.0) / device.kind.speed
        held = need_bytes([plan.shards[i] for i, d in placement.items() if d == device.id])
        self.seq += 1
        self.running[model] = _Run(self.seq, device.id, position, now, compute_s, copy_s, held)
        self._event(now + copy_s + compute_s, _DONE, model, self.seq)

    def _finish(self, model: ModelId, ident: int, now: float) -> None:
        run = self.running.get(model)
        if run is None or run.ident != ident:
            return  # lost with its device
        del self.running[model]
        record = TaskRecord(
            run.device, model, run.position, run.start_s, now, True, run.device_bytes
        )
        self.tally.ran(record, run.compute_s, run.copy_s)
        self.done[model] += 1
        if self.done[model] == self.plans[model].tasks:
            self.left -= 1
            self._release(model)
        elif model in self.broken:
            self._release(model)
            self.queue.appendleft(model)
        else:
            self._start(model, now)

    def _release(self, model: ModelId) -> None:
        self.broken.discard(model)
        for device in set(self.gangs.pop(model).values()):
            if self.owner.get(device) == model:  # a lost device left the gang already
                del self.owner[device]
                if device in self.alive:
                    insort(self.free, self._rank(self.devices[device]))

    def _lose(self, device: DeviceId, now: float) -> None:
        if device not in self.alive:
            return
        self.alive.discard(device)
        model = self.owner.pop(device, None)
        if model is None:
            del self.free[bisect_left(self.free, self._rank(self.devices[device]))]
            return
        run = self.running[model]
        if run.device != device:
            self.broken.add(model)  # its task elsewhere finishes first
            return
        del self.running[model]
        record = TaskRecord(device, model, run.position, run.start_s, now, False, run.device_bytes)
        self.tally.ran(record, 0.0, 0.0)
        self._release(model)
        self.queue.appendleft(model)

    def _stuck(self) -> str:
        model = self.queue[0]
        plan = self.plans[model]
        room = sum(self.devices[d].kind.budget_bytes for d in self.alive)
        return (
            f"model {model} cannot be placed: its {len(plan.shards)} shards need"
            f" {format_bytes(need_bytes(plan.shards))} or more, packed onto devices, and the"
            f" {len(self.alive)} device(s) that are up hold {format_bytes(room)} together;"
            " add devices or use SHARP, which spills inactive shards to host memory"
        )


def run_gangs(
    cluster: Cluster,
    plans: Sequence[ModelPlan],
    *,
    one_at_a_time: bool,
    prefetch: bool = True,
    truth: Mapping[ModelId, float] | None = None,
    record: bool = False,
) -> Tally:
    """Run the model-parallel (``one_at_a_time``) or task-parallel baseline."""
    return _Gangs(cluster, plans, one_at_a_time, prefetch, truth or {}, record).run()
