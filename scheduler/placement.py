"""Which free devices each queued job gets: a pure function of requests and devices.

Jobs are considered by priority (high first), then age; a job that cannot start yet does not
hold back smaller ones behind it (backfill). ``stages: auto`` takes as many eligible devices
as the job allows (``max_devices``) and the model has blocks; an explicit stage count takes
exactly that many. Data-parallel ``replicas`` multiply the devices: a job of p stages and r
replicas takes p x r devices (with ``stages: auto``, a multiple of r). Devices of one node are
kept together to keep activations node-local; the chosen devices are ordered so that
consecutive runs of p devices, one replica's pipeline, share a node where they can (device
``r * p + s`` is stage s of replica r), leaving only the once-per-step gradient all-reduce to
cross nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.devices import Device
from scheduler.types import JobId


@dataclass(frozen=True)
class JobRequest:
    """What a queued job asks for (from its validated spec)."""

    job_id: JobId
    priority: int
    min_devices: int
    max_devices: int
    stages: int | None  # None: auto
    num_blocks: int
    device_kind: str | None = None
    spot_ok: bool = True
    replicas: int = 1


@dataclass(frozen=True)
class Placement:
    """The devices a job starts on, replica-major: ``devices[r * stages + s]`` runs stage s of
    replica r."""

    job_id: JobId
    devices: tuple[Device, ...]
    replicas: int = 1

    @property
    def stages(self) -> int:
        return len(self.devices) // self.replicas


@dataclass(frozen=True)
class Waiting:
    """A job that stays queued, and why (shown in its events)."""

    job_id: JobId
    reason: str


def eligible(request: JobRequest, devices: Sequence[Device]) -> list[Device]:
    return [
        d
        for d in devices
        if (request.device_kind is None or d.kind == request.device_kind)
        and (request.spot_ok or not d.spot)
    ]


def _wanted(request: JobRequest) -> tuple[int, int]:
    """(fewest, most) devices the job can start with, both multiples of its replicas."""
    r = request.replicas
    if request.stages is not None:
        return request.stages * r, request.stages * r
    most = min(request.max_devices // r, request.num_blocks) * r
    fewest = -(-request.min_devices // r) * r  # min_devices rounded up to whole replicas
    return min(max(fewest, r), most), most


def _pick(candidates: list[Device], count: int) -> tuple[Device, ...]:
    """``count`` devices, filling the nodes with the most free devices first."""
    by_node: dict[str, list[Device]] = {}
    for device in candidates:
        by_node.setdefault(device.node_id, []).append(device)
    nodes = sorted(by_node.values(), key=lambda ds: (-len(ds), ds[0].node_id))
    ordered = [d for node in nodes for d in sorted(node, key=lambda d: d.index)]
    return tuple(ordered[:count])


def place(
    requests: Sequence[JobRequest], free: Sequence[Device]
) -> tuple[list[Placement], list[Waiting]]:
    """Assign free devices to queued jobs; the rest wait with a reason."""
    available = list(free)
    placed: list[Placement] = []
    waiting: list[Waiting] = []
    for request in sorted(requests, key=lambda r: -r.priority):  # stable: age order kept
        fewest, most = _wanted(request)
        candidates = eligible(request, available)
        if len(candidates) < fewest:
            waiting.append(Waiting(request.job_id, _reason(request, fewest, len(candidates))))
            continue
        count = min(most, len(candidates)) // request.replicas * request.replicas
        chosen = _pick(candidates, count)
        placed.append(Placement(request.job_id, chosen, request.replicas))
        taken = {d.id for d in chosen}
        available = [d for d in available if d.id not in taken]
    return placed, waiting


def _reason(request: JobRequest, needed: int, have: int) -> str:
    what = f"{request.device_kind} devices" if request.device_kind else "devices"
    if not request.spot_ok:
        what = f"on-demand (non-spot) {what}"
    return f"needs {needed} free {what}, {have} available"
