"""Which devices a *running* job should move to: away from draining devices, onto free ones.

Queued jobs are placed first (``scheduler.placement``); what is left free is offered to
running jobs, oldest first, up to their ``max_devices``. A device being drained (an admin's
``POST /devices/{id}/drain``, or a spot node's notice) must be left: the job moves its blocks
away while the device still answers, replacing it with a free device where one fits. The
caller lays the candidate devices out (``scheduler.layout``) and moves only if that is worth
it: always when leaving a draining device, and when growing, only if the predicted step is
at least ``min_gain`` faster (``worth_growing``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shoal.scheduler.devices import Device
from shoal.scheduler.placement import JobRequest, eligible
from shoal.scheduler.types import DeviceId


@dataclass(frozen=True)
class Candidate:
    """Devices to lay the job out on, and why."""

    devices: tuple[Device, ...]
    draining: tuple[DeviceId, ...]
    added: tuple[DeviceId, ...]
    reason: str


def candidate(
    request: JobRequest,
    current: Sequence[Device],
    free: Sequence[Device],
    draining: Collection[DeviceId],
) -> Candidate | None:
    """The job's devices less the draining ones plus eligible free ones up to
    ``max_devices`` (devices of nodes the job already uses first); None if nothing changes."""
    kept = [d for d in current if d.id not in draining]
    leaving = tuple(d.id for d in current if d.id in draining)
    room = max(0, request.max_devices - len(kept))
    nodes = {d.node_id for d in kept}
    offered = sorted(
        (d for d in eligible(request, free) if d.id not in draining),
        key=lambda d: (d.node_id not in nodes, d.node_id, d.index),
    )[:room]
    if not leaving and not offered:
        return None
    added = tuple(d.id for d in offered)
    if leaving:
        reason = f"leaving draining devices {list(leaving)}" + (
            f", taking {list(added)}" if added else ""
        )
    else:
        reason = f"growing onto free devices {list(added)}"
    return Candidate((*kept, *offered), leaving, added, reason)


def worth_growing(current_step_s: float, new_step_s: float, min_gain: float) -> bool:
    """Grow only for a predicted step at least ``min_gain`` faster."""
    return new_step_s <= current_step_s * (1.0 - min_gain)
