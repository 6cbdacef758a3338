"""Which free devices each queued job gets: a pure function of requests and devices.

Jobs are considered by priority (high first), then, among equal priorities, the owner holding
the fewest devices first (fair share: placed devices count at once), then age; a job that
cannot start yet does not hold back smaller ones behind it (backfill). Per-user quotas cap the
jobs a user runs at once and the devices they hold: a job is offered no more devices than its
owner has left, and waits, saying so, when that is fewer than it needs. A job that waits for
devices held by jobs of lower priority may preempt them (``preemptions``): they checkpoint,
requeue and resume later, losing nothing.

Devices come in whole units: an explicit stage count p with explicit replicas r takes exactly
p x r devices; with replicas ``auto``, as many whole pipelines of p as ``max_devices`` allows
(at least one); with ``stages: auto`` and r replicas, a multiple of r up to r x the model's
blocks; with both ``auto``, up to ``max_devices``. ``scheduler.layout`` then decides how many
of them to use and how (devices it leaves out go back to the pool). Devices of one node are
kept together; within the placement, consecutive devices share a node where they can.

With ``parallelism.tensor: N`` each stage runs on a *tensor group* of N devices of one node,
so all of the above counts whole groups (``min_devices`` and ``max_devices`` stay totals of
devices), a node offers only as many devices as make whole groups, and the placement is
node by node, N devices of one node after another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.scheduler.devices import Device
from shoal.scheduler.tensor import node_devices
from shoal.scheduler.types import JobId


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
    owner: str = ""
    tensor: int = 1  # devices per tensor-parallel group, all on one node


@dataclass(frozen=True)
class Quota:
    """A user's limits; None: no limit."""

    max_jobs: int | None = None
    max_devices: int | None = None


@dataclass
class Usage:
    """What a user runs now: jobs and the devices they hold."""

    jobs: int = 0
    devices: int = 0


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
    over_quota: bool = False
    """Its owner's quota holds it back (not the devices: preempting others would not help)."""


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it: what it asked for, the devices it holds."""

    request: JobRequest
    devices: tuple[Device, ...]


def eligible(request: JobRequest, devices: Sequence[Device]) -> list[Device]:
    return [
        d
        for d in devices
        if (request.device_kind is None or d.kind == request.device_kind)
        and (request.spot_ok or not d.spot)
    ]


def _wanted(request: JobRequest) -> tuple[int, int, int]:
    """(fewest, most, unit): the devices the job can start with, in whole units of whole
    tensor groups."""
    n = request.tensor
    fewest, most, unit = _wanted_groups(
        request, -(-request.min_devices // n), request.max_devices // n
    )
    return fewest * n, most * n, unit * n


def _wanted_groups(request: JobRequest, low: int, high: int) -> tuple[int, int, int]:
    """``_wanted`` in tensor groups, between ``low`` and ``high`` groups."""
    p, r = request.stages, request.replicas
    if p is not None and r is not None:
        return p * r, p * r, p * r
    if p is not None:  # replicas auto: whole pipelines
        return p, max(p, high // p * p), p
    if r is not None:  # stages auto: whole replicas, at most one stage per block each
        most = min(high // r, request.num_blocks) * r
        fewest = -(-low // r) * r  # low rounded up to whole replicas
        return min(max(fewest, r), most), most, r
    return min(max(low, 1), high), high, 1


def _usable(devices: Sequence[Device], tensor: int) -> int:
    """How many of ``devices`` make whole tensor groups on one node."""
    return sum(len(ds) for ds in node_devices(devices, tensor))


def _pick(candidates: list[Device], count: int, tensor: int) -> tuple[Device, ...]:
    """``count`` devices (whole tensor groups), filling the nodes with the most usable free
    devices first, so that each ``tensor`` consecutive devices share a node."""
    nodes = sorted(node_devices(candidates, tensor), key=lambda ds: (-len(ds), ds[0].node_id))
    return tuple(d for node in nodes for d in node)[:count]


def place(
    requests: Sequence[JobRequest],
    free: Sequence[Device],
    *,
    usage: Mapping[str, Usage] | None = None,
    quotas: Mapping[str, Quota] | None = None,
) -> tuple[list[Placement], list[Waiting]]:
    """Assign free devices to queued jobs; the rest wait with a reason. ``usage``: what each
    owner runs now; ``quotas``: each owner's limits (absent: none)."""
    available = list(free)
    using = {owner: Usage(u.jobs, u.devices) for owner, u in (usage or {}).items()}
    limits = quotas or {}
    placed: list[Placement] = []
    waiting: list[Waiting] = []
    pending = sorted(requests, key=lambda r: -r.priority)  # stable: age order kept
    while pending:
        top = pending[0].priority
        # Fair share: of the jobs at the top priority, the owner holding least goes first.
        request = min(
            (r for r in pending if r.priority == top),
            key=lambda r: using.get(r.owner, Usage()).devices,
        )
        pending.remove(request)
        used, quota = using.setdefault(request.owner, Usage()), limits.get(request.owner, Quota())
        fewest, most, unit = _wanted(request)
        over = _over_quota(request, used, quota, fewest)
        if over is not None:
            waiting.append(Waiting(request.job_id, over, over_quota=True))
            continue
        if quota.max_devices is not None:
            most = min(most, quota.max_devices - used.devices)
        candidates = eligible(request, available)
        usable = _usable(candidates, request.tensor)
        if usable < fewest:
            waiting.append(Waiting(request.job_id, _reason(request, fewest, candidates)))
            continue
        chosen = _pick(candidates, min(most, usable) // unit * unit, request.tensor)
        placed.append(Placement(request.job_id, chosen))
        used.jobs, used.devices = used.jobs + 1, used.devices + len(chosen)
        taken = {d.id for d in chosen}
        available = [d for d in available if d.id not in taken]
    return placed, waiting


def preemptions(
    waiting: JobRequest, running: Sequence[Running], free: Sequence[Device]
) -> list[JobId]:
    """The running jobs of lower priority to suspend (they checkpoint and requeue, losing
    nothing) so that ``waiting`` can start: lowest priority first, then in ``running``'s order
    (give the youngest first: the least progress paused); none when the free devices already
    suffice or when even all of them would not. With tensor groups, devices count only in
    whole groups of one node, a victim's together with the free ones there."""
    fewest, _, _ = _wanted(waiting)
    pool = eligible(waiting, free)
    if _usable(pool, waiting.tensor) >= fewest:
        return []
    victims = []
    lower = [r for r in running if r.request.priority < waiting.priority]
    for job in sorted(lower, key=lambda r: r.request.priority):  # stable: caller's order
        victims.append(job.request.job_id)
        pool += eligible(waiting, job.devices)
        if _usable(pool, waiting.tensor) >= fewest:
            return victims
    return []


def _over_quota(request: JobRequest, used: Usage, quota: Quota, fewest: int) -> str | None:
    """Why the owner's quota keeps ``request`` waiting, if it does."""
    if quota.max_jobs is not None and used.jobs >= quota.max_jobs:
        return f"{request.owner} runs {used.jobs} jobs: the quota's most (max_jobs)"
    if quota.max_devices is not None and quota.max_devices - used.devices < fewest:
        return (
            f"needs {fewest} devices, but {request.owner} holds {used.devices} of a quota of"
            f" {quota.max_devices} (max_devices)"
        )
    return None


def _reason(request: JobRequest, needed: int, candidates: Sequence[Device]) -> str:
    what = f"{request.device_kind} devices" if request.device_kind else "devices"
    if not request.spot_ok:
        what = f"on-demand (non-spot) {what}"
    n = request.tensor
    if n == 1:
        return f"needs {needed} free {what}, {len(candidates)} available"
    groups = _usable(candidates, n) // n
    reason = f"needs {needed // n} tensor groups of {n} {what} on one node each, {groups} available"
    per_node = sorted(Counter(d.node_id for d in candidates).values(), reverse=True)
    if per_node:  # the free devices, spread too thin over the nodes
        shown = ", ".join(map(str, per_node[:4])) + (", ..." if len(per_node) > 4 else "")
        reason += f" (free per node: {shown})"
    return reason
