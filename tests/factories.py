"""Builders of test data shared across the suite."""

from __future__ import annotations

import copy
from typing import Any

from scheduler.devices import Device

BASE_SPEC: dict[str, Any] = {
    "name": "digits-mlp",
    "model": {"builtin": "mlp", "config": {"hidden": 32, "layers": 2}},
    "data": {"builtin": "digits", "config": {}},
    "optimizer": {"name": "adam", "lr": 0.01},
    "batch_size": 32,
    "micro_batches": 2,
    "steps": 20,
    "checkpoint": {"every_steps": 10, "keep": 2},
}


def job_spec(**overrides: Any) -> dict[str, Any]:
    """A small, valid job spec (dict) with top-level fields replaced by ``overrides``."""
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(copy.deepcopy(overrides))
    return spec


def device(
    node: str = "n0000000a",
    index: int = 0,
    kind: str = "cpu",
    *,
    spot: bool = False,
    memory_mb: int = 2048,
) -> Device:
    return Device(
        id=f"{node[:8]}-{kind}-{index}",
        node_id=node,
        index=index,
        kind=kind,
        memory_mb=memory_mb,
        gpu=False,
        spot=spot,
    )
