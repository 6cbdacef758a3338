"""The device model: what a device is and how the inventory is read from Ray node data.

A *device* is one accelerator Shoal may place a stage on. On GPU nodes devices come from
Ray's ``GPU`` and ``accelerator_type:*`` resources; on CPU-only nodes they are *virtual*,
declared with the custom resource ``shoal_device`` and the node labels below, so that
heterogeneous, spot-laden clusters can be started on one laptop. The emulated slowdown is
carried so the worker can act it out; no policy may read it (policies see measured times).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shoal.scheduler.types import DeviceId, NodeId

DEVICE_RESOURCE = "shoal_device"
LABEL_KIND = "shoal.io/device-kind"
LABEL_MEMORY_MB = "shoal.io/device-memory-mb"
LABEL_SPOT = "shoal.io/spot"
LABEL_SLOWDOWN = "shoal.io/emulate-slowdown"

DEFAULT_VIRTUAL_KIND = "cpu"
DEFAULT_VIRTUAL_MEMORY_MB = 2048

# Memory of common accelerators when no label says otherwise (Ray reports the type, not the size).
_KNOWN_GPU_MEMORY_MB: dict[str, int] = {
    "a100": 40 * 1024,
    "a100-80g": 80 * 1024,
    "h100": 80 * 1024,
    "h200": 141 * 1024,
    "l4": 24 * 1024,
    "a10g": 24 * 1024,
    "t4": 16 * 1024,
    "v100": 16 * 1024,
}

_ACCEL_PREFIX = "accelerator_type:"
_KIND_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{0,62}\Z")


class InventoryError(ValueError):
    """A node's labels or resources cannot be read as devices; the message says which and why."""


@dataclass(frozen=True)
class NodeInfo:
    """What Ray tells about one node, as plain data."""

    node_id: NodeId
    alive: bool
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False
    """Ray is draining the node (a spot preemption notice, an autoscaler's scale-down,
    ``ray drain-node``): it still runs, but jobs must leave its devices before it goes."""


@dataclass(frozen=True)
class Device:
    """One placeable device."""

    id: DeviceId
    node_id: NodeId
    index: int
    kind: str
    memory_mb: int
    gpu: bool
    spot: bool = False
    emulate_slowdown: float = 1.0
    overhead_mb: int = 0
    """What the device holds for a worker before its stage (CUDA context, kernels, library
    workspaces): as a worker measured it (``workers.device_memory``), else as
    ``planned_overhead_mb`` estimates it."""

    @property
    def usable_bytes(self) -> int:
        """The memory stages may plan in: the declared size less the measured overhead."""
        return max(0, self.memory_mb - self.overhead_mb) * 2**20


UNMEASURED_GPU_OVERHEAD_MB = 1024
"""What a GPU device is planned to hold for a worker before its stage until a worker has
measured it there: above the 0.5-0.8 GiB per process measured on an H200 with torch 2.11
(docs/architecture.md, "Memory"), so the first job on a GPU, and a sweep's shard workers,
plan in what the device has."""


def planned_overhead_mb(measured_mb: int | None, gpu: bool) -> int:
    """The overhead stages are planned around: the measured one, else the estimate on a GPU
    (``UNMEASURED_GPU_OVERHEAD_MB``); a CPU device's memory is the host's: none."""
    if measured_mb is not None:
        return measured_mb
    return UNMEASURED_GPU_OVERHEAD_MB if gpu else 0


def parse_bool(value: str, *, what: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise InventoryError(f"{what}={value!r} is not a boolean; use true or false")


def _positive_float(value: str, *, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise InventoryError(f"{what}={value!r} is not a number") from None
    if not number > 0:
        raise InventoryError(f"{what}={value!r} must be > 0")
    return number


def _kind(value: str, *, what: str) -> str:
    kind = value.strip().lower()
    if not _KIND_RE.match(kind):
        raise InventoryError(
            f"{what}={value!r} is not a device kind; use lower-case letters, digits, '.', '-'"
        )
    return kind


def device_id(node_id: NodeId, kind: str, index: int) -> DeviceId:
    return f"{node_id[:8]}-{kind}-{index}"


def node_devices(node: NodeInfo) -> list[Device]:
    """The devices one node offers (none if it is dead or declares none)."""
    if not node.alive:
        return []
    labels = node.labels
    spot = parse_bool(labels.get(LABEL_SPOT, "false"), what=LABEL_SPOT)
    slowdown = _positive_float(labels.get(LABEL_SLOWDOWN, "1"), what=LABEL_SLOWDOWN)
    memory_label = labels.get(LABEL_MEMORY_MB)
    memory_mb = int(_positive_float(memory_label, what=LABEL_MEMORY_MB)) if memory_label else None
    gpus = int(node.resources.get("GPU", 0))
    if gpus > 0:
        accel = next(
            (k[len(_ACCEL_PREFIX) :] for k in node.resources if k.startswith(_ACCEL_PREFIX)),
            "gpu",
        )
        kind = _kind(labels.get(LABEL_KIND, accel), what=LABEL_KIND)
        memory = memory_mb or _KNOWN_GPU_MEMORY_MB.get(kind, 0)
        count, gpu = gpus, True
    else:
        count = int(node.resources.get(DEVICE_RESOURCE, 0))
        kind = _kind(labels.get(LABEL_KIND, DEFAULT_VIRTUAL_KIND), what=LABEL_KIND)
        memory = memory_mb or DEFAULT_VIRTUAL_MEMORY_MB
        gpu = False
    return [
        Device(
            id=device_id(node.node_id, kind, i),
            node_id=node.node_id,
            index=i,
            kind=kind,
            memory_mb=memory,
            gpu=gpu,
            spot=spot,
            emulate_slowdown=slowdown,
        )
        for i in range(count)
    ]


def inventory(nodes: Iterable[NodeInfo]) -> list[Device]:
    """All devices of the live nodes, in a stable order (node id, then index)."""
    devices = [d for node in nodes for d in node_devices(node)]
    return sorted(devices, key=lambda d: (d.node_id, d.index))
