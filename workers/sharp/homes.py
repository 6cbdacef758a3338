"""Where the SHARP executor's models live: its devices (by pool position), those found lost,
and the reference seconds of work each device's models hold, which place new shards
(``scheduler.sharp_homes.home_shards``) and move models (``scheduler.sharp_homes.move_target``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import Shard
from shoal.scheduler.sharp_homes import Home, home_shards, move_target
from shoal.scheduler.types import DeviceId
from shoal.workers.sharp.models import ModelRun


def work_s(shard: Shard, steps: int) -> float:
    """Reference seconds of ``steps`` steps of ``shard``."""
    return steps * (shard.forward_s + shard.backward_s)


class Homes:
    """The devices' state; which are lost is read from other threads too."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self.devices = list(devices)
        self._lock = threading.Lock()
        self._dead: set[int] = set()
        self._load = [0.0] * len(self.devices)

    def live(self) -> list[int]:
        return [h for h in range(len(self.devices)) if h not in self._dead]

    def alive(self, host: int) -> bool:
        return host not in self._dead

    def lose(self, host: int) -> None:
        with self._lock:
            self._dead.add(host)

    def lost(self, hosts: Iterable[int] | None = None) -> list[DeviceId]:
        """The ids of the lost devices (among ``hosts``), in pool order."""
        with self._lock:
            dead = self._dead if hosts is None else self._dead & set(hosts)
            return [self.devices[h].id for h in sorted(dead)]

    def host_of(self, device_id: DeviceId) -> int:
        return next(h for h, d in enumerate(self.devices) if d.id == device_id)

    def place(self, shards: Sequence[Shard], steps: int) -> list[int]:
        """The live pool positions ``shards`` go to (``home_shards``), their work counted
        on those devices."""
        live = self.live()
        ids = home_shards(
            shards, steps, [Home(self.devices[h].id, 1.0, self._load[h]) for h in live]
        )
        position = {self.devices[h].id: h for h in live}
        homes = [position[i] for i in ids]
        for shard, host in zip(shards, homes, strict=True):
            self._load[host] += work_s(shard, steps)
        return homes

    def release(self, model: ModelRun) -> None:
        """``model``'s shards are gone from their devices."""
        for shard, host in zip(model.plan.shards, model.homes, strict=True):
            self._load[host] -= work_s(shard, model.snap.steps)

    def move(self, model: ModelRun, there: int) -> None:
        """``model`` lives on ``there`` from now on, all its shards."""
        self.release(model)
        for shard in model.plan.shards:
            self._load[there] += work_s(shard, model.snap.steps)
        model.homes = [there] * len(model.plan.shards)

    def target(self, model: ModelRun, models: Iterable[ModelRun]) -> int | None:
        """The live device ``model``, at a step boundary, would move to (``move_target``,
        by the work to go of the models living on each device), or None."""
        home = model.homes[0]
        left = dict.fromkeys(self.live(), 0.0)
        for m in models:
            if m.active and m.homes[0] in left:
                left[m.homes[0]] += m.plan.remaining_s(m.done)
        if home not in left:
            return None  # its device is lost: it rolls back instead
        mine = model.plan.remaining_s(model.done)
        others = {host: (work, 1.0, 0.0) for host, work in left.items() if host != home}
        return move_target(mine, (left[home], 1.0), others)
