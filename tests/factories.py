"""Builders of test data shared across the suite: API specs, devices, engine snapshots."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoal.scheduler.devices import Device
from shoal.scheduler.types import BlockRange
from shoal.workers.snapshot import DataRef, JobSnapshot, ModelRef, OptimizerConf, StagePlan

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


def sweep_spec(**overrides: Any) -> dict[str, Any]:
    """A small, valid sweep spec (dict) over ``job_spec()``'s learning rate."""
    spec: dict[str, Any] = {
        "name": "lr-sweep",
        "base": job_spec(optimizer={"name": "sgd", "lr": 0.05}, steps=30),
        "space": {"optimizer.lr": {"type": "log_uniform", "low": 0.001, "high": 0.5}},
        "algorithm": "random",
        "seed": 7,
        "max_trials": 8,
        "max_concurrent": 1,
        "objective": {"metric": "loss", "direction": "minimize", "every_steps": 5},
        "early_stopping": {"rule": "asha", "min_steps": 5, "reduction_factor": 2},
        "retention": {"keep_best": 2},
    }
    spec.update(copy.deepcopy(overrides))
    return spec


BUILTIN_DATA: list[tuple[str, dict[str, Any]]] = [
    ("synthetic-regression", {"features": 5, "outputs": 3}),
    ("synthetic-lm", {"vocab_size": 11, "seq_len": 7}),
    ("digits", {}),
    ("digits", {"images": False}),
    ("pysource", {"seq_len": 9, "max_bytes": 20_000}),
]
"""Every built-in dataset (and variant) with a small config: name and config."""


# ------------------------------------------------------------- engine snapshots

MLP = ModelRef("mlp", None, {"hidden": 16, "layers": 3})
REGRESSION = DataRef("synthetic-regression", None, {"features": 8, "outputs": 2})
GPT = ModelRef("gpt", None, {"d_model": 16, "n_layers": 2, "n_heads": 2})
TOKENS = DataRef("synthetic-lm", None, {"vocab_size": 16, "seq_len": 6})
ADAM = OptimizerConf("adam", 0.01)
SGD = OptimizerConf("sgd", 0.1, {"momentum": 0.9})


def even_ranges(num_blocks: int, stages: int) -> list[BlockRange]:
    """``num_blocks`` cut into ``stages`` contiguous ranges of equal counts, the remainder
    to the last stages."""
    share, rest = divmod(num_blocks, stages)
    sizes = [share] * (stages - rest) + [share + 1] * rest
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def plans(ranges: Sequence[BlockRange], node: str = "n0000000a") -> tuple[StagePlan, ...]:
    return tuple(
        StagePlan(i, r, Device(f"{node[:8]}-cpu-{i}", node, i, "cpu", 2048, False))
        for i, r in enumerate(ranges)
    )


def dp_plans(
    ranges: Sequence[BlockRange], replicas: int, node: str = "n0000000a"
) -> tuple[StagePlan, ...]:
    """``replicas`` copies of the stages ``ranges``, each on its own device."""
    depth = len(ranges)
    return tuple(
        StagePlan(
            i,
            r,
            Device(f"{node[:8]}-cpu-{k * depth + i}", node, k * depth + i, "cpu", 2048, False),
            replica=k,
        )
        for k in range(replicas)
        for i, r in enumerate(ranges)
    )


def job(root: Path | str, ranges: Sequence[BlockRange], **fields: Any) -> JobSnapshot:
    base = JobSnapshot(
        job_id="job-1",
        attempt=1,
        model=MLP,
        data=REGRESSION,
        optimizer=ADAM,
        batch_size=8,
        micro_batches=2,
        steps=3,
        seed=11,
        schedule="1f1b",
        recompute=False,
        stages=plans(ranges),
        num_blocks=4,
        checkpoint_root=str(root),
        checkpoint_every=0,
        checkpoint_keep=0,
    )
    return replace(base, **fields)
