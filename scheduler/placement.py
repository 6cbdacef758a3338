"""Which free devices each queued job gets: a pure function of requests and devices.

Jobs are considered by priority (high first), then age; a job that cannot start yet does not
hold back smaller ones behind it (backfill). Devices come in whole units: an explicit stage
count p with explicit replicas r takes exactly p x r devices; with replicas ``auto``, as many
whole pipelines of p as ``max_devices`` allows (at least one); with ``stages: auto`` and r
replicas, a multiple of r up to r x the model's blocks; with both ``auto``, up to
``max_devices``. ``scheduler.layout`` then decides how many of them to use and how (devices it
leaves out go back to the pool). Devices of one node are kept together; within the placement,
consecutive devices share a node where they can.
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
    replicas: int | None = 1  # None: auto


@dataclass(frozen=True)
class Placement:
    """The devices a job may start on (``scheduler.layout`` orders and cuts over them)."""

    job_id: JobId
    devices: tuple[Device, ...]


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


def _wanted(request: JobRequest) -> tuple[int, int, int]:
    """(fewest, most, unit): the devices the job can start with, in whole units."""
    p, r = request.stages, request.replicas
    if p is not None and r is not None:
        return p * r, p * r, p * r
    if p is not None:  # replicas auto: whole pipelines
        return p, max(p, request.max_devices // p * p), p
    if r is not None:  # stages auto: whole replicas, at most one stage per block each
        most = min(request.max_devices // r, request.num_blocks) * r
        fewest = -(-request.min_devices // r) * r  # min_devices rounded up to whole replicas
        return min(max(fewest, r), most), most, r
    return min(max(request.min_devices, 1), request.max_devices), request.max_devices, 1


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
        fewest, most, unit = _wanted(request)
        candidates = eligible(request, available)
        if len(candidates) < fewest:
            waiting.append(Waiting(request.job_id, _reason(request, fewest, len(candidates))))
            continue
        chosen = _pick(candidates, min(most, len(candidates)) // unit * unit)
        placed.append(Placement(request.job_id, chosen))
        taken = {d.id for d in chosen}
        available = [d for d in available if d.id not in taken]
    return placed, waiting


def _reason(request: JobRequest, needed: int, have: int) -> str:
    what = f"{request.device_kind} devices" if request.device_kind else "devices"
    if not request.spot_ok:
        what = f"on-demand (non-spot) {what}"
    return f"needs {needed} free {what}, {have} available"
