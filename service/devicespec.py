"""Device specs (``SHOAL_DEVICES``, ``shoal node GROUP``): the Ray nodes of a local cluster
and the virtual devices each declares, as ``COUNTxKIND:MEMORY_MB[:slowdown=F][:spot]``
groups separated by commas.

Each node declares its devices the way ``scheduler.devices`` reads them back (the
``shoal_device`` resource and the ``shoal.io/*`` labels); a spec the inventory would refuse
later is refused here, with the same rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shoal.scheduler.devices import (
    DEVICE_RESOURCE,
    LABEL_KIND,
    LABEL_MEMORY_MB,
    LABEL_SLOWDOWN,
    LABEL_SPOT,
    InventoryError,
    NodeInfo,
    node_devices,
)

SPEC_FORM = "COUNTxKIND:MEMORY_MB[:slowdown=F][:spot]"
SPEC_EXAMPLE = "2xcpu-fast:2048,2xcpu-slow:2048:slowdown=2"
MAX_COUNT = 64
MAX_MEMORY_MB = 10_000_000
MAX_GROUPS = 16
"""Each group is one Ray node (a handful of processes); more does not fit on one machine."""
_COUNT_KIND_RE = re.compile(r"^(\d+)x(.+)\Z")


class DeviceSpecError(ValueError):
    """A device spec (``SHOAL_DEVICES``) that cannot be read; the message says how to fix it."""


@dataclass(frozen=True)
class VirtualNode:
    """One Ray node of the local cluster and the virtual devices it declares."""

    count: int
    kind: str
    memory_mb: int
    slowdown: float = 1.0
    spot: bool = False
    gpus: int | None = None
    """The GPUs the node offers: None for those Ray finds on the machine (its devices are
    then the GPUs), 0 for none (virtual CPU devices even on a GPU machine)."""

    @property
    def group(self) -> str:
        """The device group this node is, as ``parse_devices`` reads it."""
        slowdown = f":slowdown={self.slowdown:g}" if self.slowdown != 1.0 else ""
        return f"{self.count}x{self.kind}:{self.memory_mb}{slowdown}{':spot' if self.spot else ''}"

    @property
    def labels(self) -> dict[str, str]:
        return {
            LABEL_KIND: self.kind,
            LABEL_MEMORY_MB: str(self.memory_mb),
            LABEL_SPOT: "true" if self.spot else "false",
            LABEL_SLOWDOWN: f"{self.slowdown:g}",
        }


def _group_error(group: str, problem: str) -> DeviceSpecError:
    return DeviceSpecError(
        f"device group {group!r}: {problem}; expected {SPEC_FORM}, e.g. {SPEC_EXAMPLE}"
    )


def _bounded_int(text: str, low: int, high: int, *, group: str, what: str) -> int:
    if not text.isdigit():
        raise _group_error(group, f"{what} {text!r} is not a whole number")
    value = int(text)
    if not low <= value <= high:
        raise _group_error(group, f"{what} {value} is outside {low}..{high}")
    return value


def _slowdown(text: str, *, group: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _group_error(group, f"slowdown {text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 1.0):
        raise _group_error(group, f"slowdown {text!r} must be a finite number >= 1")
    return value


def _parse_group(group: str) -> VirtualNode:
    parts = [part.strip() for part in group.split(":")]
    head = _COUNT_KIND_RE.match(parts[0])
    if head is None or len(parts) < 2:
        raise _group_error(group, "it does not start with COUNTxKIND:MEMORY_MB")
    count = _bounded_int(head.group(1), 1, MAX_COUNT, group=group, what="count")
    memory_mb = _bounded_int(parts[1], 1, MAX_MEMORY_MB, group=group, what="memory (MB)")
    slowdown: float | None = None
    spot = False
    for option in parts[2:]:
        name, sep, value = option.partition("=")
        if name == "slowdown" and sep and slowdown is None:
            slowdown = _slowdown(value, group=group)
        elif option == "spot" and not spot:
            spot = True
        elif name in {"slowdown", "spot"}:
            raise _group_error(group, f"option {name!r} is given twice or malformed")
        else:
            raise _group_error(group, f"unknown option {option!r} (known: slowdown=F, spot)")
    node = VirtualNode(count, head.group(2).strip().lower(), memory_mb, slowdown or 1.0, spot)
    # Refuse here what the inventory would refuse later, with the same rules.
    try:
        node_devices(NodeInfo("local", True, {DEVICE_RESOURCE: count}, node.labels))
    except InventoryError as exc:
        raise _group_error(group, str(exc)) from None
    return node


def parse_devices(spec: str) -> list[VirtualNode]:
    """The Ray nodes a device spec asks for, one per comma-separated group, head first."""
    groups = [group.strip() for group in spec.split(",")]
    if not spec.strip():
        raise DeviceSpecError(
            f"the device spec is empty; expected {SPEC_FORM}, e.g. {SPEC_EXAMPLE}"
        )
    if any(not group for group in groups):
        raise DeviceSpecError(
            f"the device spec {spec!r} has an empty group; separate groups with single commas,"
            f" e.g. {SPEC_EXAMPLE}"
        )
    if len(groups) > MAX_GROUPS:
        raise DeviceSpecError(
            f"the device spec has {len(groups)} groups, more than {MAX_GROUPS}; raise COUNT"
            " of a group instead of repeating it"
        )
    return [_parse_group(group) for group in groups]
