"""Where the simulated SHARP executor's models live (``scheduler.simsharp``).

Per device: the models with work left that live there, their work to go (reference
seconds, as of the tasks they have done) and the placed work of the shards it holds (which
places new shards: ``home_shards``). For trades (``trade_target``), per kind of device
(speed and budget) its emptiest device: one holding no model, else the one holding the
fewest, whose model with the least work to go comes first; kept in heaps so that a
thousand devices cost a few heap operations per task, not a scan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from heapq import heappop, heappush

from shoal.scheduler.sharp import IdleDevice, ModelId
from shoal.scheduler.sharp_homes import Faster
from shoal.scheduler.types import DeviceId

Kind = tuple[float, int]
"""Devices alike for a trade: (speed, budget bytes)."""


class _Kind:
    """One kind's devices: the empty ones and the occupied ones by least work to go, each
    heap entry valid while it is its device's latest (lazy deletion)."""

    def __init__(self) -> None:
        self.empty: list[DeviceId] = []
        self.occupied: list[tuple[int, float, DeviceId, int]] = []


class Residency:
    """Which models live where, and how much work each device has to go."""

    def __init__(self, devices: Mapping[DeviceId, IdleDevice]) -> None:
        self.devices = devices
        self.residents: dict[DeviceId, set[ModelId]] = {d: set() for d in devices}
        self.left_at: dict[DeviceId, float] = dict.fromkeys(devices, 0.0)
        """Reference seconds of the work to go of the models living on each device."""
        self.load: dict[DeviceId, float] = dict.fromkeys(devices, 0.0)
        """Reference seconds of all the work of the shards placed on each device."""
        self._left: dict[ModelId, float] = {}
        self._alive = set(devices)
        self._held: set[DeviceId] = set()
        """Devices promised to a model in a trade: no other trade takes them meanwhile."""
        self._kinds: dict[Kind, _Kind] = {}
        self._version: dict[DeviceId, int] = dict.fromkeys(devices, 0)
        for name in devices:
            self._touch(name)

    def _kind(self, name: DeviceId) -> Kind:
        device = self.devices[name]
        return (device.speed, device.budget_bytes)

    def settle(self, model: ModelId, home: DeviceId, left_s: float) -> None:
        """``model``, with ``left_s`` to go, lives on ``home``."""
        self.residents[home].add(model)
        self.left_at[home] += left_s
        self._left[model] = left_s
        self._touch(home)

    def unsettle(self, model: ModelId, home: DeviceId) -> None:
        """``model`` no longer lives on ``home`` (it ended, moves or lost its device)."""
        self.residents[home].discard(model)
        self.left_at[home] -= self._left.pop(model)
        if not self.residents[home]:
            self.left_at[home] = 0.0  # what float sums leave
        self._touch(home)

    def advance(self, model: ModelId, home: DeviceId, done_s: float) -> None:
        """``model``, living on ``home``, did ``done_s`` more of its work."""
        self.left_at[home] -= done_s
        self._left[model] -= done_s
        self._touch(home)

    def left(self, model: ModelId) -> float:
        return self._left[model]

    def set_alive(self, name: DeviceId, alive: bool) -> None:
        (self._alive.add if alive else self._alive.discard)(name)
        self._touch(name)

    def promise(self, name: DeviceId, promised: bool) -> None:
        """``name`` is promised to a trading model (or no longer is)."""
        (self._held.add if promised else self._held.discard)(name)
        self._touch(name)

    def least(self, name: DeviceId) -> ModelId | None:
        """The model living on ``name`` with the least work to go (ties: the lowest id)."""
        return min(self.residents[name], key=lambda m: (self._left[m], m), default=None)

    def rate(self, name: DeviceId) -> float:
        """The speed each model living on ``name`` gets: the device's, shared."""
        return self.devices[name].speed / max(1, len(self.residents[name]))

    def faster(self, rate: float, need_bytes: int) -> Iterable[Faster[DeviceId]]:
        """Per kind of live device faster than ``rate`` whose budget holds ``need_bytes``,
        its emptiest device (``trade_target``'s candidates), with the speed a model that
        goes there gets (shared with the models left there)."""
        for (kind_speed, budget), kind in self._kinds.items():
            if kind_speed <= rate or budget < need_bytes:
                continue
            top = self._top(kind)
            if top is not None:
                yield top

    def _top(self, kind: _Kind) -> Faster[DeviceId] | None:
        while kind.empty:
            name = kind.empty[0]
            if name in self._alive and name not in self._held and not self.residents[name]:
                return Faster(name, self.devices[name].speed, None)
            heappop(kind.empty)
        while kind.occupied:
            _, least, name, version = kind.occupied[0]
            if version == self._version[name]:
                return Faster(name, self.rate(name), least)
            heappop(kind.occupied)
        return None

    def _touch(self, name: DeviceId) -> None:
        """File ``name`` afresh in its kind's heaps (its older entries turn stale)."""
        self._version[name] += 1
        if name not in self._alive or name in self._held:
            return
        kind = self._kinds.setdefault(self._kind(name), _Kind())
        least = self.least(name)
        if least is None:
            heappush(kind.empty, name)
        else:
            count = len(self.residents[name])
            heappush(kind.occupied, (count, self._left[least], name, self._version[name]))
