"""How models come into the SHARP executor (``workers.sharp.runner``): the devices
measured first (one that fails it is set aside; where models trade places, the speeds
place them), then the models that arrived together placed heaviest first, each made a
model here (cut into shards for the smallest device, its data made and its checkpoint
read: ``placing.arrive``) and its shards loaded into their devices' host memory, and a
first copy taken of each that keeps copies. A model that cannot be made, or whose shards
its workers cannot build, fails alone, saying why; the models beside it train on."""

from __future__ import annotations

import threading

from shoal.scheduler.types import DeviceId
from shoal.workers.error_text import one_line
from shoal.workers.run_log import RunLog
from shoal.workers.sharp.inbox import Inbox
from shoal.workers.sharp.measuring import Measurements
from shoal.workers.sharp.models import ModelRun
from shoal.workers.sharp.placing import arrive, gather
from shoal.workers.sharp.recovering import Recovering
from shoal.workers.sharp.shard_pool import Call, HostLost, HostPool
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.snapshot import JobSnapshot, RunStatus

Loads = dict[Call, ModelRun]
"""Calls loading shards (``ModelRun.add``), each with its model."""


class Admitting(Recovering):
    """The arrival half of the executor; ``SharpTrainer`` is one."""

    _budgets: dict[DeviceId, int]
    _inbox: Inbox
    _lock: threading.Lock
    _measures: Measurements
    _refused: dict[str, RunLog]
    _task_copies: bool
    _trades: bool

    def _admit(self, pool: HostPool) -> None:
        if self._inbox.arriving():  # measured first: a device set aside takes no shard
            try:
                speeds = self._measure(pool)
                if self._trades:  # placed by speed (else as alike: moves level them)
                    self._homes.measured(speeds)
            except HostLost as exc:  # placed on the devices left
                self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
        arriving = self._inbox.arrivals()
        if not arriving:
            return
        # Heaviest first, each to the device where it ends soonest (``home_shards``):
        # longest-processing-time-first over the models that arrive together.
        placing = sorted(arriving, key=lambda s: -s.steps * sum(c.fwd_bwd_s for c in s.block_costs))
        loads: Loads = {}
        for snap in placing:
            loads |= self._place(pool, snap)
        try:
            self._load(pool, loads)
            for model in self._arrived(arriving):
                self._measures.say(model, self._devices)
        except HostLost as exc:  # its models (new ones too) are placed again
            self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
        for model in self._arrived(arriving):
            if not (model.snap.keep_copies and model.active):
                continue
            try:
                model.saved = (model.step, gather(model, pool, self._timeout))
            except HostLost as exc:  # it trained nothing yet: no copy is needed
                self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
            except ShardFailed as exc:  # a host could not copy a shard of it
                self._fail(pool, model, f"its first copy could not be taken: {exc}")

    def _measure(self, pool: HostPool) -> dict[int, float]:
        """The live devices measured (``Measurements.measure``), those set aside lost."""
        speeds = self._measures.measure(pool, self._homes.live(), self._timeout)
        for host, why in self._measures.failed.items():
            if self._homes.alive(host):
                self._lose(pool, host, why)
        return speeds

    def _arrived(self, arriving: list[JobSnapshot]) -> list[ModelRun]:
        """The models made of ``arriving`` and not failed since."""
        models = [self._models.get(snap.job_id) for snap in arriving]
        return [m for m in models if m is not None and m.status is not RunStatus.FAILED]

    def _place(self, pool: HostPool, snap: JobSnapshot) -> Loads:
        """Make ``snap`` a model here (``placing.arrive``); the calls that load its shards
        into their devices' memory. One that cannot be made (cut into shards for these
        devices, its data made, its checkpoint read) fails alone, saying why."""
        smallest = min(self._budgets[d.id] for d in self._devices)
        try:
            model = arrive(
                snap, smallest, len(self._models), self._homes, task_copies=self._task_copies
            )
        except Exception as exc:  # its own: the other models train on
            why = f"the SHARP executor cannot train this model: {one_line(exc)}"
            with self._lock:
                self._models.pop(snap.job_id, None)  # an earlier run of it, ended
                self._refused[snap.job_id] = RunLog(RunStatus.FAILED, why)
            return {}
        with self._lock:
            self._models[snap.job_id] = model
            self._refused.pop(snap.job_id, None)
        if model.status is RunStatus.LOST:
            return {}
        shards, homes = model.plan.shards, model.homes
        return {
            model.add(pool, h, s, model.origin): model for s, h in zip(shards, homes, strict=True)
        }

    def _load(self, pool: HostPool, loads: Loads) -> None:
        """Wait for ``loads``: what each took is a move's measure from now on
        (``Homes.held``). A model one of whose shards its worker could not build
        (``ShardFailed``: its factory raised, its checkpoint's states do not fit) fails
        alone once every load has ended, its shards dropped. ``HostLost`` as
        soon as a device is found lost."""
        held: list[tuple[int, float]] = []
        failed: dict[str, tuple[ModelRun, ShardFailed]] = {}
        pending = list(loads)
        while pending:
            for call in pool.wait(pending, self._timeout):
                pending.remove(call)
                try:
                    held.append(pool.result(call))
                except ShardFailed as exc:
                    model = loads[call]
                    failed.setdefault(model.snap.job_id, (model, exc))
        self._homes.held(held)
        for model, error in failed.values():
            self._fail(pool, model, f"its shards could not be loaded: {error}")
