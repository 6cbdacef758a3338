"""Where SHARP models live and when they move: every shard of a model on the one device
where its work ends soonest (``home_shards``), and at a step boundary a move to the device
where that ends two devices' work sooner (``move_target``). The executor
(``workers.sharp``) and the simulator (``scheduler.simsharp``) place and move with these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

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


def home_shards(shards: Sequence[Shard], steps: int, devices: Sequence[Home]) -> list[DeviceId]:
    """Where a model's shards live (the host memory of the device whose worker runs their
    tasks): all on the one device that can run each of them where the model's ``steps``
    steps of work would end soonest after what the device holds ((load + work) / speed;
    ties to the lowest id). Placing models heaviest first this way is longest-processing-
    time-first over the devices' speeds.

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
    best = min(fit, key=lambda d: ((d.load_s + work) / d.speed, d.device))
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
