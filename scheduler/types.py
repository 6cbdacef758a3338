"""Domain aliases shared by every package: one place, so a type means one thing."""

from __future__ import annotations

from typing import TypeAlias

DeviceId: TypeAlias = str
"""A device's stable name: ``<node id prefix>-<kind>-<index>`` (see ``scheduler.devices``)."""

NodeId: TypeAlias = str
"""A Ray node id (hex)."""

JobId: TypeAlias = str

BlockRange: TypeAlias = tuple[int, int]
"""Half-open range ``[start, stop)`` of block indices held by one stage."""
