"""Where SHARP models live and when they move: every shard of a model on the one device
where its work ends soonest (``home_shards``), at a step boundary a move to the device
where that ends two devices' work sooner (``move_target``), and before any task a trade of
places with a model on a faster device that has less work to go (``trade_target``) where
that pays for the moves (``trade_pays``). The executor (``workers.sharp``) and the
simulator (``scheduler.simsharp``) place and move with these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from shoal.scheduler.memory import format_bytes
from shoal.scheduler.sharp import Shard, ShardError
from shoal.scheduler.types import DeviceId


@dataclass(frozen=True)
class Home:
    """A device that may hold shards: its relative speed, the largest shard it can run
    (its memory budget) and the reference seconds of the work of the shards it holds."""

    device: DeviceId
    speed: float = 1.0
    load_s: float = 0.0
    budget_bytes: int = 2**62


def home_shards(
    shards: Sequence[Shard], steps: int, devices: Sequence[Home], *, spread: bool = False
) -> list[DeviceId]:
    """Where a model's shards live (the host memory of the device whose worker runs their
    tasks): all on the one device that can run each of them where the model's ``steps``
    steps of work would end soonest after what the device holds ((load + work) / speed;
    ties to the lowest id). Placing models heaviest first this way is longest-processing-
    time-first over the devices' speeds. With ``spread`` a device holding nothing comes
    first, the fastest of them: models that trade places (``trade_target``) start as the
    level rule has them, the heaviest on the fastest devices, one a device while any is
    free, and a slow device's model moves up later.

    Together, because a model's tasks form one chain: spread over several devices its
    shards gain no parallelism (the parallelism is across models), while each hop between
    devices costs a transfer and leaves both devices waiting on the other (simulated:
    ``scheduler.simsharp``). A ``ShardError`` when no device can run its largest shard."""
    need = max((s.bytes for s in shards), default=0)
    fit = [d for d in devices if d.budget_bytes >= need]
    if not fit:
        largest = max((d.budget_bytes for d in devices), default=0)
        raise ShardError(
            f"a shard needs {format_bytes(need)} but the largest device has"
            f" {format_bytes(largest)}; cut its shards for the smallest device"
        )
    work = steps * sum(s.forward_s + s.backward_s for s in shards)
    best = min(fit, key=lambda d: (spread and d.load_s > 0, (d.load_s + work) / d.speed, d.device))
    return [best.device] * len(shards)


def moved_end_s(
    left_s: float,
    home: tuple[float, float],
    there: tuple[float, float],
    copy_s: float,
) -> tuple[float, float]:
    """When the later of two devices would end the work of the models living on them, as
    things stand and if a model at a step boundary with ``left_s`` reference seconds of
    work to go moved from ``home`` to ``there`` (each: the work to go of its models, the
    home's including this one, and its speed), its state copied over in ``copy_s``.

    Homes are fixed when models arrive; as models end, devices fall idle while others
    still hold several, or a device faster than a lone model's falls idle. A move is worth
    it where the second is the sooner: that evens the devices out, and a model moved back
    would not pass the same test (Hydra gets the balance from letting any free device take
    any shard)."""
    (home_left, home_speed), (there_left, there_speed) = home, there
    now = max(home_left / home_speed, there_left / there_speed)
    moved = max((home_left - left_s) / home_speed, copy_s + (there_left + left_s) / there_speed)
    return now, moved


SAME_SPEED = 0.15
"""Measured speeds within this fraction of a faster device's count as that device's: one
CPU core's matmul rate varies by 5-10% between two measurements, and a trade made on
noise costs the open forwards of two models for nothing."""


def speed_levels(measured: Sequence[float], tolerance: float = SAME_SPEED) -> list[float]:
    """Each device's speed relative to the fastest (1.0) from its ``measured`` rate (say,
    GFLOP/s): fastest first, a device within ``tolerance`` below the first of the level
    before it takes that level's speed, else starts a level of its own. Devices alike stay
    alike however their measurements scatter; the executor places and trades by these."""
    if any(not rate > 0 for rate in measured):
        raise ValueError(f"measured speeds must be positive, got {list(measured)}")
    levels = [0.0] * len(measured)
    top, lead = max(measured, default=1.0), math.inf
    for i in sorted(range(len(measured)), key=lambda i: -measured[i]):
        if measured[i] < lead * (1 - tolerance):
            lead = measured[i]
        levels[i] = lead / top
    return levels


Place = TypeVar("Place", str, int)
"""How a caller names devices: the simulator by id, the executor by pool position."""


def move_target(
    left_s: float,
    home: tuple[float, float],
    others: Mapping[Place, tuple[float, float, float]],
) -> Place | None:
    """Where a model at a step boundary with ``left_s`` reference seconds to go moves from
    ``home`` (its models' work to go, this one's included, and its speed): the device of
    ``others`` (each: its models' work to go, its speed, the seconds to copy the model
    there) where the later of the two devices' ends comes soonest (``moved_end_s``), if
    sooner than staying, ties to the first name; None: it stays. The executor and the
    simulator move models with this one rule."""
    best: tuple[float, Place] | None = None
    for name, (left, speed, copy_s) in others.items():
        ends, moved = moved_end_s(left_s, home, (left, speed), copy_s)
        if moved < ends and (best is None or (moved, name) < best):
            best = (moved, name)
    return None if best is None else best[1]


TRADE_MARGIN = 0.3
"""A model takes the place of one on a faster device only when that one has less than
(1 - this) of its own work to go: a smaller margin trades more often (each trade costs the
two models' next shards their copy to a new device and a wait for each other's task in
flight), a larger one leaves the levels further apart. Simulated (``scheduler.simsharp``,
losses costing the tasks in flight): 0.1, 0.2, 0.3 and 0.5 gave 1.07-1.09, 1.08-1.09,
1.07 and 1.06-1.07 of the lower bound on four seeds of the spot cluster, and 0.3 and 0.5
gave 1.01-1.02 and 1.04-1.05 on two of Hydra's setting."""


@dataclass(frozen=True)
class Faster(Generic[Place]):
    """A live device, as ``trade_target`` reads it: its speed and the least work to go
    (reference seconds) among the models living on it, None when none does."""

    place: Place
    speed: float
    least_left_s: float | None


def trade_target(
    left_s: float,
    home_speed: float,
    devices: Iterable[Faster[Place]],
    *,
    margin: float = TRADE_MARGIN,
) -> Faster[Place] | None:
    """Where a model about to queue its next task goes instead of its home, whose speed is
    ``home_speed``: the fastest of ``devices`` faster than home that holds no model, or
    whose model with the least work to go has at least ``margin`` times ``left_s`` (the
    model's work to go) less to go: those two trade places. Among devices
    as fast, an empty one first, then the least work to go, then the first given. None: it
    stays.

    Horvath, Lam and Sethi's level rule (the models with the most work left on the fastest
    devices) is optimal when work may move at any moment; a model's step is a chain of
    tasks, so here it moves between two of them. Without it, devices are as fast as the
    models placed on them were when they arrived: a model on a slow device stays there
    while faster ones finish theirs early and fall idle."""
    best: tuple[tuple[float, bool, float], Faster[Place]] | None = None
    for device in devices:
        least = device.least_left_s
        if device.speed <= home_speed or (least is not None and least + margin * left_s >= left_s):
            continue
        key = (-device.speed, least is not None, least or 0.0)
        if best is None or key < best[0]:
            best = (key, device)
    return None if best is None else best[1]


@dataclass(frozen=True)
class Sharing:
    """A device as ``trade_pays`` reads it: its speed and the work to go (reference
    seconds) of each model living on it, but for the two that would trade places."""

    speed: float
    left_s: tuple[float, ...] = ()

    def end_s(self, left_s: float) -> float:
        """When a model with ``left_s`` to go would end living here beside these models,
        the device's time shared evenly among those with work to go: each of them takes
        as much of it as the model before the model ends, or its own work, the less."""
        return (left_s + sum(min(w, left_s) for w in self.left_s)) / self.speed


def trade_pays(
    left_s: float,
    home: Sharing,
    there: Sharing,
    move_s: float,
    other: tuple[float, float] | None = None,
) -> bool:
    """Whether a model with ``left_s`` reference seconds to go gains by going from
    ``home`` to ``there`` (``trade_target``'s choice), its move costing ``move_s`` (what
    holding its shards costs the device they go to), in a trade with ``other``'s model
    there (its work to go and its move's cost), if any: when the later of the two models'
    ends comes sooner, or, the device holding no model, its own end.

    Counted as the devices share their time (``Sharing``), not as their speed over the
    models living there: near its end a model on a shared device is about to have it to
    itself, and a move gains what the model beside it still has to do, not half the
    model's own work; near every model's end a move costs more than it gains."""
    if other is None:
        return there.end_s(left_s) + move_s < home.end_s(left_s)
    least, other_move_s = other
    stay = max(home.end_s(left_s), there.end_s(least))
    traded = max(there.end_s(left_s) + move_s, home.end_s(least) + other_move_s)
    return traded < stay


def hand_over_now(
    ready_in_s: float,
    busy_in_s: float,
    next_s: float,
    speed: float,
    partner_speed: float,
    redo_s: tuple[float, float] = (0.0, 0.0),
) -> bool:
    """Whether a model that a trade (``trade_target``) sends off its device hands the
    device over now rather than after one more task there. The model taking its
    place has its input there in ``ready_in_s``; this model's work queued on the device ends
    in ``busy_in_s``, and one more task would take ``next_s``. Now: this device (``speed``)
    idles until the other's input comes, or the other's (``partner_speed``) until this
    model's does. One more task: the other's device idles from the other's input until
    this model's. Either way the forwards whose backward is still to come run again where
    the model goes (``redo_s``, reference seconds now and after one more task:
    ``ModelPlan.open_forward_s``). The one that loses less work wins; a tie hands over."""
    now = (
        max(0.0, ready_in_s - busy_in_s) * speed + max(0.0, busy_in_s - ready_in_s) * partner_speed
    )
    later = max(0.0, busy_in_s + next_s - ready_in_s) * partner_speed
    return now + redo_s[0] <= later + redo_s[1]
