"""Where the SHARP executor's models live: its devices (by pool position), their measured
speeds, those found lost or promised to a trade, and the reference seconds of work each
device's models hold, which place new shards (``scheduler.sharp_homes.home_shards``),
move models at step boundaries (``scheduler.sharp_homes.move_target``) and trade places
(``scheduler.sharp_homes.trade_target``, ``workers.sharp.trading``)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from statistics import median

from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import Shard
from shoal.scheduler.sharp_homes import Faster, Home, home_shards, move_target, speed_levels
from shoal.scheduler.types import DeviceId
from shoal.workers.sharp.models import ModelRun

HELD_KEPT = 64
"""How many of the last calls that held a shard give a move's measured cost."""


def work_s(shard: Shard, steps: int) -> float:
    """Reference seconds of ``steps`` steps of ``shard``."""
    return steps * (shard.forward_s + shard.backward_s)


class Homes:
    """The devices' state; which are lost is read from other threads too. With ``spread``
    (models trade places) a model is placed on an empty device first, the fastest."""

    def __init__(self, devices: Sequence[Device], *, spread: bool = False) -> None:
        self.devices = list(devices)
        self._spread = spread
        self._lock = threading.Lock()
        self._dead: set[int] = set()
        self._load = [0.0] * len(self.devices)
        self._speed = [1.0] * len(self.devices)
        self._promised: set[int] = set()
        self._held: deque[float] = deque(maxlen=HELD_KEPT)
        """What holding a shard cost a device per byte of it, as the last calls measured
        (``held``): a move's cost."""

    def live(self) -> list[int]:
        return [h for h in range(len(self.devices)) if h not in self._dead]

    def alive(self, host: int) -> bool:
        return host not in self._dead

    def lose(self, host: int) -> None:
        with self._lock:
            self._dead.add(host)
        self._promised.discard(host)

    def lost(self, hosts: Iterable[int] | None = None) -> list[DeviceId]:
        """The ids of the lost devices (among ``hosts``), in pool order."""
        with self._lock:
            dead = self._dead if hosts is None else self._dead & set(hosts)
            return [self.devices[h].id for h in sorted(dead)]

    def host_of(self, device_id: DeviceId) -> int:
        return next(h for h, d in enumerate(self.devices) if d.id == device_id)

    def measured(self, gflops: Mapping[int, float]) -> None:
        """The devices' measured rates (say, GFLOP/s) by pool position: their speeds from
        now on, relative to the fastest of them (``speed_levels``)."""
        hosts = sorted(gflops)
        for host, speed in zip(hosts, speed_levels([gflops[h] for h in hosts]), strict=True):
            self._speed[host] = speed

    def speed(self, host: int) -> float:
        return self._speed[host]

    def place(self, shards: Sequence[Shard], steps: int) -> list[int]:
        """The live pool positions ``shards`` go to (``home_shards``), their work counted
        on those devices."""
        live = self.live()
        ids = home_shards(
            shards,
            steps,
            [Home(self.devices[h].id, self._speed[h], self._load[h]) for h in live],
            spread=self._spread,
        )
        position = {self.devices[h].id: h for h in live}
        homes = [position[i] for i in ids]
        for shard, host in zip(shards, homes, strict=True):
            self._load[host] += work_s(shard, steps)
        return homes

    def held(self, calls: Iterable[tuple[int, float]]) -> None:
        """Calls that held shards on a device (``add``, ``take``), each its bytes and the
        seconds it took there: a move's cost from now on, the median per byte of the last
        ``HELD_KEPT`` (a worker's first call was seen to take 0.85 s where the next took
        1-2 ms: its imports and first allocations)."""
        self._held.extend(seconds / nbytes for nbytes, seconds in calls if nbytes > 0)

    def move_s(self, model: ModelRun) -> float:
        """What moving ``model`` would cost the device it goes to, in the reference seconds
        its work is counted in (measured seconds over the model's measured ratio; nothing
        before its tasks were timed: the two cannot be compared yet)."""
        if not model.timed:
            return 0.0
        nbytes = sum(s.bytes for s in model.plan.shards)
        return (median(self._held) if self._held else 0.0) * nbytes / model.ratio

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
        cost = self.move_s(model)
        others = {h: (work, self._speed[h], cost) for h, work in left.items() if h != home}
        return move_target(mine, (left[home], self._speed[home]), others)

    # ------------------------------------------------------------------------- trades

    def living(self, models: Iterable[ModelRun]) -> dict[int, list[ModelRun]]:
        """The active models living whole on each live device (a loss may leave a model's
        shards on several: it trades no place until it moves whole)."""
        living: dict[int, list[ModelRun]] = {h: [] for h in self.live()}
        for m in models:
            if m.active and len(set(m.homes)) == 1 and m.homes[0] in living:
                living[m.homes[0]].append(m)
        return living

    def rate(self, host: int, residents: int) -> float:
        """The speed each of ``residents`` models living on ``host`` gets: its own, shared."""
        return self._speed[host] / max(1, residents)

    def faster(self, home: int, living: Mapping[int, list[ModelRun]]) -> list[Faster[int]]:
        """The live devices but ``home`` and those promised to a trade, as ``trade_target``
        reads them: the speed a model going there gets, and the least work to go of the
        models living there. Every device holds any shard (they are cut for the smallest)."""
        return [
            Faster(
                host,
                self.rate(host, len(models)),
                min((m.plan.remaining_s(m.done) for m in models), default=None),
            )
            for host, models in living.items()
            if host != home and host not in self._promised
        ]

    def promise(self, host: int, promised: bool) -> None:
        """``host`` is promised to a model coming in a trade (or no longer is)."""
        (self._promised.add if promised else self._promised.discard)(host)
