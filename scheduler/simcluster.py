"""Modelled clusters for the SHARP simulator: device kinds, spot outages, workloads.

A cluster is device kinds and counts and a trace of spot outages. A *setting* is a cluster
and the models to train on it; the builders here make the benchmark's settings: Hydra's own
(8 identical devices, 12 models each needing 2-4 devices' memory), a heterogeneous spot
cluster, and a sweep of sizes.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost
from shoal.scheduler.sharp import ModelId, ModelPlan, shard_model
from shoal.scheduler.types import DeviceId

GiB = 2**30

SEQUENCE_TOKENS = 512
"""Tokens per sample of the synthetic transformer models (their FLOPs scale with it)."""

MICRO_BATCH_SIZE = 4
"""Samples per micro-batch of the synthetic models."""


@dataclass(frozen=True)
class DeviceKind:
    """A kind of device: speed relative to the reference device, memory budget in bytes,
    host<->device copy bandwidth in GB/s, and whether it is a spot (preemptible) device."""

    name: str
    speed: float
    budget_bytes: int
    bandwidth_gbps: float
    spot: bool = False

    def __post_init__(self) -> None:
        if not (self.speed > 0 and self.budget_bytes > 0 and self.bandwidth_gbps > 0):
            raise ValueError(
                f"device kind {self.name}: speed ({self.speed}), budget_bytes"
                f" ({self.budget_bytes}) and bandwidth_gbps ({self.bandwidth_gbps}) must be > 0"
            )


@dataclass(frozen=True)
class Outage:
    """Spot device ``device`` is lost at ``lost_s`` and, unless ``back_s`` is None, returns
    (empty) at ``back_s``."""

    device: DeviceId
    lost_s: float
    back_s: float | None = None


@dataclass(frozen=True)
class SimDevice:
    id: DeviceId
    kind: DeviceKind


@dataclass(frozen=True)
class Cluster:
    """Devices of ``kinds`` (kind, count), and the outages of its spot devices. A model's
    shards live in the host memory of the device that runs them (``scheduler.simsharp``),
    so nodes and the network between them do not enter the model."""

    kinds: tuple[tuple[DeviceKind, int], ...]
    outages: tuple[Outage, ...] = ()

    def __post_init__(self) -> None:
        names = [kind.name for kind, _ in self.kinds]
        if len(set(names)) != len(names) or any(count < 0 for _, count in self.kinds):
            raise ValueError(f"cluster kinds {names} must have distinct names and counts >= 0")

    def devices(self) -> tuple[SimDevice, ...]:
        """Every device, named ``<kind>-<index>``."""
        return tuple(
            SimDevice(f"{kind.name}-{i:04d}", kind)
            for kind, count in self.kinds
            for i in range(count)
        )


@dataclass(frozen=True)
class Setting:
    """A cluster and the models to train on it together."""

    name: str
    cluster: Cluster
    plans: tuple[ModelPlan, ...]


def lower_bound(
    cluster: Cluster, plans: Sequence[ModelPlan], truth: Mapping[ModelId, float] | None = None
) -> float:
    """No schedule finishes sooner (DESIGN.md's SHARP ideal): all the work over the devices'
    speed, as if perfectly divisible with no copies. A model's tasks are sequential, so it
    is never below the longest model's chain on the fastest device, and at most one device
    per model computes at a time, so the capacity at any moment is that of the
    ``len(plans)`` fastest devices *up* then (an outage takes its device's speed away until
    it is back): the bound is when that capacity, integrated from 0, reaches the work.
    ``truth`` scales a model's real times."""
    devices = cluster.devices()
    if not devices or not plans:
        return 0.0
    scale = truth or {}
    work = [p.work_s * scale.get(p.model, 1.0) for p in plans]
    chain = max(work) / max(d.kind.speed for d in devices)
    up = Counter(d.kind.speed for d in devices)
    speed = {d.id: d.kind.speed for d in devices}
    changes = sorted(
        [(o.lost_s, -1, speed[o.device]) for o in cluster.outages]
        + [(o.back_s, 1, speed[o.device]) for o in cluster.outages if o.back_s is not None]
    )
    now, left = 0.0, sum(work)
    for at, delta, changed in [*changes, (math.inf, 0, 0.0)]:
        rate = capacity(up, len(plans))
        if rate > 0 and left <= rate * (at - now):
            return max(now + left / rate, chain)
        left -= rate * (at - now)
        now = at
        up[changed] += delta
    return math.inf  # every device lost for good before the work could be done


def capacity(up: Mapping[float, int], count: int) -> float:
    """The speed of the ``count`` fastest devices of ``up`` (device counts by speed)."""
    total = 0.0
    for speed in sorted(up, reverse=True):
        take = min(count, up[speed])
        total, count = total + take * speed, count - take
    return total


# ----------------------------------------------------------------- synthetic workloads


def transformer_costs(
    layers: int, params_per_layer: float, micro_batch_size: int
) -> tuple[BlockCost, ...]:
    """Blocks of a transformer-like model trained with Adam: 6 FLOPs per parameter per token
    for forward+backward (Kaplan et al., 2020) at the reference device's speed; fp32
    parameters and two Adam moments; for backward a block keeps ~16 bytes per hidden unit
    per token (four fp32 tensors of its width), its input 4."""
    params = int(params_per_layer)
    tokens = micro_batch_size * SEQUENCE_TOKENS
    seconds = 6 * params * tokens / (REFERENCE_GFLOPS * 1e9)
    width = int(math.sqrt(params / 12))  # a layer of width h holds ~12 h^2 parameters
    activation = 16 * width * SEQUENCE_TOKENS
    return tuple(
        BlockCost(i, seconds, 4 * params, 8 * params, activation, 4 * width * SEQUENCE_TOKENS)
        for i in range(layers)
    )


def _model(
    rng: random.Random, name: str, order: int, memory: float, budget: int, steps: int
) -> ModelPlan:
    """A model whose state takes about ``memory`` bytes, cut into shards for ``budget``."""
    layers = rng.randint(24, 48)
    params = memory / layers / 16  # parameters, gradients, two Adam moments: 16 B each
    costs = transformer_costs(layers, params, MICRO_BATCH_SIZE)
    shards = shard_model(costs, budget, MICRO_BATCH_SIZE, recompute=True)
    return ModelPlan(name, shards, steps, order, recompute=True)


def hydra_setting(*, steps: int = 6, seed: int = 0) -> Setting:
    """Hydra's setting: 8 identical 16 GiB devices on one node (PCIe 3, 12 GB/s) and 12
    models, each needing 2-4 devices' worth of memory."""
    kind = DeviceKind("v100-16g", 1.0, 16 * GiB, 12.0)
    rng = random.Random(seed)
    budget = kind.budget_bytes
    plans = tuple(
        _model(rng, f"hydra-{i:02d}", i, rng.uniform(2, 4) * budget, budget, steps)
        for i in range(12)
    )
    return Setting("hydra-8x12", Cluster(((kind, 8),)), plans)


_FLEET = (
    (DeviceKind("h100-80g", 3.0, 80 * GiB, 25.0), 0.125),
    (DeviceKind("a100-40g", 1.5, 40 * GiB, 25.0, spot=True), 0.25),
    (DeviceKind("a10g-24g", 0.6, 24 * GiB, 12.0, spot=True), 0.3125),
    (DeviceKind("t4-16g", 0.25, 16 * GiB, 12.0, spot=True), 0.3125),
)
"""The heterogeneous fleet: a few fast on-demand devices and many spot ones (fractions);
the smallest kind takes what rounding leaves."""


def fleet(devices: int) -> tuple[tuple[DeviceKind, int], ...]:
    """``devices`` of the heterogeneous fleet, as (kind, count)."""
    counts = [int(devices * share) for _, share in _FLEET]
    counts[-1] += devices - sum(counts)
    return tuple((kind, c) for (kind, _), c in zip(_FLEET, counts, strict=True) if c > 0)


def mixed_setting(
    devices: int, models: int, *, steps: int = 4, lost_fraction: float = 0.1, seed: int = 0
) -> Setting:
    """``devices`` of the heterogeneous fleet and ``models`` needing 1.5-5x the smallest
    device's memory (about 8 shards each, cut for the smallest device so that any device
    runs any shard); ``lost_fraction`` of the spot devices are lost during the run (at a
    uniform time before the lower bound), every other one coming back later."""
    rng = random.Random(seed)
    kinds = fleet(devices)
    budget = min(kind.budget_bytes for kind, _ in kinds)
    plans = tuple(
        _model(rng, f"m{i:04d}", i, rng.uniform(1.5, 5) * budget, budget, steps)
        for i in range(models)
    )
    horizon = lower_bound(Cluster(kinds), plans)
    spot = [d.id for d in Cluster(kinds).devices() if d.kind.spot]
    outages = []
    for k, device in enumerate(sorted(rng.sample(spot, int(len(spot) * lost_fraction)))):
        lost = rng.uniform(0, horizon)
        back = lost + rng.uniform(0.1, 0.5) * horizon if k % 2 == 0 else None
        outages.append(Outage(device, lost, back))
    return Setting(f"mixed-{devices}x{models}", Cluster(kinds, outages=tuple(outages)), plans)


def spot_setting(
    *, devices: int = 512, models: int = 300, steps: int = 4, seed: int = 0
) -> Setting:
    """The benchmark's heterogeneous spot cluster: 512 devices of four kinds (the three spot
    kinds losing 10% of their devices during the run) and 300 models of varying sizes."""
    return mixed_setting(devices, models, steps=steps, seed=seed)


def sweep_settings(
    devices: Sequence[int] = (8, 32, 128, 512, 1024),
    models: Sequence[int] = (4, 16, 64, 256, 1000),
    *,
    steps: int = 4,
    seed: int = 0,
) -> tuple[Setting, ...]:
    """Every (devices, models) pair of the sweep, on the heterogeneous fleet."""
    return tuple(mixed_setting(d, m, steps=steps, seed=seed) for d in devices for m in models)
