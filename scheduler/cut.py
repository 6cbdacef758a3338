"""Contiguous cuts of a block chain over a fixed device order.

The exact fixed-order step of ``scheduler.partition``'s planner: bisection on the slowest
stage's time, each probe answered by a greedy or, where its premise fails, a sweep.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from shoal.scheduler.memory import autocast_copy_bytes, transient_bytes
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.schedules import peak_in_flight
from shoal.scheduler.types import BlockRange
from shoal.scheduler.workload import DeviceCapacity, Workload

_TOLERANCE = 1e-9
"""Relative gap at which the bisection on the bottleneck time stops."""


# ------------------------------------------------------------------------ the cost model


@dataclass(frozen=True)
class Slot:
    """One stage position: its device in each replica, cut for the slowest and smallest."""

    devices: tuple[DeviceCapacity, ...]
    speed: float
    memory: int

    @classmethod
    def of(cls, devices: Sequence[DeviceCapacity]) -> Slot:
        return cls(
            tuple(devices), min(d.speed for d in devices), min(d.memory_bytes for d in devices)
        )


class Model:
    """Prefix sums of the block costs: a range's time and memory in O(1), its largest
    extension within a budget in O(log n)."""

    def __init__(self, costs: Sequence[BlockCost], workload: Workload, replicas: int = 1) -> None:
        self.costs = costs
        self.n = len(costs)
        self.workload = workload
        self.replicas = replicas
        self.time = [0.0, *accumulate(c.fwd_bwd_s for c in costs)]
        # Without recompute: params + grads + optimizer (1/R of it on each of R sharded
        # replicas, and of the params and grads too under ZeRO-3); activations (and the
        # weight copies bf16 autocast keeps with them) are added per in-flight micro-batch.
        shards = replicas if workload.shard != "none" else 1
        gathered = workload.shard == "full" and shards > 1
        self.static = [
            0,
            *accumulate(
                -(-2 * c.param_bytes // (shards if gathered else 1)) + -(-c.optim_bytes // shards)
                for c in costs
            ),
        ]
        mbs, precision = workload.micro_batch_size, workload.precision
        self.act = [
            0,
            *accumulate(
                mbs * c.activation_bytes_per_sample + autocast_copy_bytes(c, precision)
                for c in costs
            ),
        ]
        # Every stage keeps room for the model's largest backward temporaries, as
        # ``scheduler.memory.stage_memory`` counts them.
        self.reserve = max((transient_bytes(c, mbs) for c in costs), default=0)
        if gathered:  # ZeRO-3 gathers one block's whole parameters at a time
            self.reserve += max((c.param_bytes for c in costs), default=0)
        self.inputs = [mbs * c.input_bytes_per_sample for c in costs]
        self._by_flight: dict[int, list[int]] = {}
        self._replicated: dict[int, Model] = {}
        self._memory_stops: dict[tuple[int, int, int], int] = {}
        self._worst_growth: float | None = None

    def for_replicas(self, replicas: int) -> Model:
        """This model as each of ``replicas`` replicas holds it (the same unless sharded)."""
        if replicas == self.replicas or self.workload.shard == "none":
            return self
        model = self._replicated.get(replicas)
        if model is None:
            model = self._replicated[replicas] = Model(self.costs, self.workload, replicas)
        return model

    def in_flight(self, stages: int, stage: int, cap: int) -> int:
        return peak_in_flight(self.workload.schedule, stages, stage, cap)

    def _memory_prefix(self, flight: int) -> list[int]:
        prefix = self._by_flight.get(flight)
        if prefix is None:
            factor = 1 if self.workload.recompute else flight
            prefix = [s + factor * a for s, a in zip(self.static, self.act, strict=True)]
            self._by_flight[flight] = prefix
        return prefix

    def memory(self, start: int, stop: int, flight: int) -> int:
        prefix = self._memory_prefix(flight)
        kept = flight * self.inputs[start] if self.workload.recompute else 0
        return prefix[stop] - prefix[start] + kept + self.reserve

    def memory_stop(self, start: int, memory: int, flight: int) -> int:
        """``max_stop`` without a time limit, remembered: it does not change between probes."""
        key = (start, memory, flight)
        stop = self._memory_stops.get(key)
        if stop is None:
            prefix = self._memory_prefix(flight)
            kept = flight * self.inputs[start] if self.workload.recompute else 0
            room = memory - kept - self.reserve
            stop = (
                max(start, bisect_right(prefix, prefix[start] + room) - 1) if room >= 0 else start
            )
            self._memory_stops[key] = stop
        return stop

    def max_stop(self, start: int, slot: Slot, flight: int, limit: float) -> int:
        """The furthest stop of a stage starting at ``start`` on ``slot`` within ``limit``
        seconds per micro-batch and the slot's memory (``start`` itself when nothing fits)."""
        by_memory = self.memory_stop(start, slot.memory, flight)
        if math.isinf(limit):
            return by_memory
        by_time = bisect_right(self.time, self.time[start] + limit * slot.speed * (1 + 1e-12))
        return max(start, min(by_memory, by_time - 1))

    def monotone(self, flight: int) -> bool:
        """Whether a later start never needs more memory for the same stop (the greedy's
        premise). Always without recompute; with it, when no stage input grows by more than
        the activations it skips: flight x (in[i+1] - in[i]) <= act[i], telescoped."""
        if not self.workload.recompute:
            return True
        if self._worst_growth is None:  # the largest input growth per activation byte skipped
            growth = [
                (self.inputs[i + 1] - self.inputs[i], self.act[i + 1] - self.act[i])
                for i in range(self.n - 1)
            ]
            self._worst_growth = max(
                (math.inf if a == 0 else g / a for g, a in growth if g > 0), default=0.0
            )
        return flight * self._worst_growth <= 1

    def stage_time(self, blocks: BlockRange, speed: float) -> float:
        return (self.time[blocks[1]] - self.time[blocks[0]]) / speed


# -------------------------------------------------------------- the cut, for a fixed order


Stops = list[int]
"""Per slot, the stop of its stage; equal to the previous stop when the slot is unused."""


_Probe = Callable[[float], tuple[Stops | None, float]]
"""A feasibility test at a bottleneck limit: the cut (None if none) and, when it fails, a
limit below which it still fails (0 when unknown)."""


_Flights = Sequence[tuple[int, int]]
"""Per slot, the micro-batches in flight its stage is cut for: as the first slot used, and
after a used one (``_flights``)."""


def _flights(model: Model, slots: int, cap: int) -> list[tuple[int, int]]:
    """What stage ``k`` of a cut over ``slots`` holds in flight at most, with ``cap``
    micro-batches: as the first stage of the at most ``slots - k`` left (1F1B keeps one more
    on the first), or after a used slot as stage ``k``. Unused slots only take stages away
    from a pipeline, so they never keep more in flight than that."""
    return [
        (model.in_flight(slots - k, 0, cap), model.in_flight(slots, k, cap)) for k in range(slots)
    ]


def _greedy(model: Model, slots: Sequence[Slot], flights: _Flights) -> _Probe:
    """Each slot takes the most blocks it can: optimal when a later start never needs more
    time or memory, because then covering more blocks early never hurts. On failure, the
    smallest limit at which some slot could take one more block (the next event)."""
    time, n = model.time, model.n
    speeds = [s.speed for s in slots]
    memories = [s.memory for s in slots]

    def probe(limit: float) -> tuple[Stops | None, float]:
        start, stops, event = 0, [], math.inf
        for k, speed in enumerate(speeds):
            if start < n:
                first, later = flights[k]
                room = model.memory_stop(start, memories[k], later if start else first)
                reach = bisect_right(time, time[start] + limit * speed * (1 + 1e-12)) - 1
                if reach < room:
                    event = min(event, (time[reach + 1] - time[start]) / speed)
                    start = reach
                else:
                    start = room
            stops.append(start)
        return (stops, 0.0) if start == n else (None, event)

    return probe


def _sweep(
    model: Model, slots: Sequence[Slot], flights: _Flights, limit: float, skip: bool
) -> Stops | None:
    """Exact feasibility by dynamic programme over the cut positions reachable after each
    slot (``skip``: a slot may stay unused). O(slots x blocks x log blocks)."""
    n = model.n
    reach = [False] * (n + 1)
    reach[0] = True
    parents: list[list[int]] = []
    for slot, (first, later) in zip(slots, flights, strict=True):
        new = list(reach) if skip else [False] * (n + 1)
        parent = list(range(n + 1)) if skip else [-1] * (n + 1)
        furthest, origin = -1, -1
        for stop in range(1, n + 1):
            start = stop - 1
            if reach[start]:
                end = model.max_stop(start, slot, later if start else first, limit)
                if end > furthest:
                    furthest, origin = end, start
            if furthest >= stop and not new[stop]:
                new[stop], parent[stop] = True, origin
        parents.append(parent)
        reach = new
    if not reach[n]:
        return None
    stops, stop = [], n
    for parent in reversed(parents):
        stops.append(stop)
        stop = parent[stop]
    return stops[::-1]


def _bottleneck(model: Model, slots: Sequence[Slot], stops: Stops) -> float:
    start, worst = 0, 0.0
    for slot, stop in zip(slots, stops, strict=True):
        if stop > start:
            worst = max(worst, model.stage_time((start, stop), slot.speed))
        start = stop
    return worst


def cut(
    model: Model,
    slots: Sequence[Slot],
    cap: int,
    *,
    exact_count: bool,
    within: float = math.inf,
    exact: bool = True,
) -> tuple[Stops, float] | None:
    """The cut minimizing the slowest stage on ``slots`` in this order (each slot a stage;
    with ``exact_count`` every slot gets at least one block), or None if memory forbids a
    cut whose slowest stage takes at most ``within`` seconds."""
    p = len(slots)
    if exact_count and p > model.n:
        return None
    flights = _flights(model, p, cap)
    monotone = model.monotone(max(map(max, flights))) or not exact

    def probe_sweep(limit: float) -> tuple[Stops | None, float]:
        return _sweep(model, slots, flights, limit, skip=not exact_count), 0.0

    if monotone:
        found = _bisect(model, slots, _greedy(model, slots, flights), within)
        if found is None or not exact_count or _used(found[0]) == p:
            return found  # the at-most-p optimum with p stages is the exactly-p optimum
    return _bisect(model, slots, probe_sweep, within)


def _used(stops: Stops) -> int:
    return sum(1 for a, b in zip([0, *stops], stops, strict=False) if b > a)


def _bisect(
    model: Model, slots: Sequence[Slot], probe: _Probe, within: float
) -> tuple[Stops, float] | None:
    """Bisection on the slowest stage's time. A feasible probe lowers the top to the
    bottleneck it really found; a failed one raises the bottom to its next event, which is
    then tried at once (often it is the optimum). Stops within a relative ``_TOLERANCE``."""
    best, _ = probe(within)
    if best is None:
        return None
    high = _bottleneck(model, slots, best)
    heaviest = max(c.fwd_bwd_s for c in model.costs)
    fastest = max(s.speed for s in slots)
    low = max(model.time[-1] / sum(s.speed for s in slots), heaviest / fastest)
    while high - low > _TOLERANCE * high:
        middle = (low + high) / 2
        if not low < middle < high:
            break  # the bracket is as narrow as floats allow (tiny, subnormal costs)
        stops, event = probe(middle)
        if stops is None and middle < event < high:
            low = event
            stops, event = probe(low)
        if stops is None:
            low = max(low, middle, event)
        else:
            best, high = stops, _bottleneck(model, slots, stops)
    return best, high
