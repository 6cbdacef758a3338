"""The simulated half of ``shoal bench sharp``: SHARP's orderings on modelled clusters.

Pure (no Ray, no torch): ``scheduler.simulate`` runs the executor's own ordering and
assignment code on Hydra's setting (8 devices, 12 models of 2-4 devices' memory) and on a
heterogeneous spot cluster, against the lower bound no schedule can beat
(``scheduler.simcluster.lower_bound``), and is timed on a 1,024-device, 1,000-model run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shoal.scheduler.sharp import ModelPlan, Shard
from shoal.scheduler.simcluster import (
    Cluster,
    DeviceKind,
    Setting,
    hydra_setting,
    mixed_setting,
    spot_setting,
)
from shoal.scheduler.simstate import ENGINE, Engine, Moves, Recovery
from shoal.scheduler.simulate import Strategy, simulate
from shoal.service.bench.report import SHARP_PHASES, Progress, SharpSettings

NO_PREFETCH = "sharp-lrtf-no-prefetch"
"""Sharded-LRTF with every shard copied in only when its task starts."""

AT_STEPS = "sharp-lrtf-at-steps"
"""Sharded-LRTF on the executor with ``trades`` and ``task_copies`` off: models placed as
alike move at step boundaries, and a loss rolls back to the last copy (by default models
trade places with one on a faster device before any task, and each task's outputs and
stepped state are copied off the devices as it goes, so a loss costs the tasks in
flight)."""

_AT_STEPS = Engine(moves=Moves.AT_STEPS, recovery=Recovery.STEP)


def simulate_setting(setting: Setting) -> dict[str, Any]:
    """Every strategy on ``setting`` (and Sharded-LRTF without prefetch, and without trades
    and task copies): each one's makespan, the lower bound, their ratio and the mean
    device utilization."""
    rows: dict[str, dict[str, float]] = {}
    runs = [(s.value, s, True, ENGINE) for s in Strategy] + [
        (NO_PREFETCH, Strategy.LRTF, False, ENGINE),
        (AT_STEPS, Strategy.LRTF, True, _AT_STEPS),
    ]
    for name, strategy, prefetch, engine in runs:
        result = simulate(
            setting.cluster, setting.plans, strategy, prefetch=prefetch, engine=engine
        )
        rows[name] = {
            "ratio": result.ratio,
            "makespan_s": result.makespan_s,
            "lower_bound_s": result.lower_bound_s,
            "mean_utilization": result.mean_utilization,
        }
    return {
        "name": setting.name,
        "devices": len(setting.cluster.devices()),
        "models": len(setting.plans),
        "outages": len(setting.cluster.outages),
        "results": rows,
    }


def simulate_local(
    shards: Sequence[Shard],
    models: int,
    steps: int,
    budget: int,
    devices: int = 2,
    *,
    latency_s: float = 0.0,
    bandwidth_gbps: float | None = None,
) -> dict[str, float]:
    """The real half's run as the simulator sees it: ``models`` models of ``shards`` (the
    real run's measured task seconds, when the bench has them) on ``devices`` devices with
    the executor's measured ``latency_s``, their shards copied in at ``bandwidth_gbps``
    (a GPU's measured host-to-device rate; None: copies cost nothing, as on CPU devices that
    share host memory, and whose copying threads take their cores: copies on their path):
    what the engine would reach with the machine's cores to itself."""
    free = bandwidth_gbps is None
    kind = DeviceKind("local-cpu" if free else "local-gpu", 1.0, budget, bandwidth_gbps or 1e6)
    cluster = Cluster(((kind, devices),))
    plans = [ModelPlan(f"model-{i}", tuple(shards), steps, i) for i in range(models)]
    engine = Engine(latency_s=latency_s, overlapped=not free)
    sharp = simulate(cluster, plans, Strategy.LRTF, engine=engine)
    plain = simulate(cluster, plans, Strategy.MODEL_PARALLEL)
    return {
        "lrtf_ratio": sharp.ratio,
        "lrtf_mean_utilization": sharp.mean_utilization,
        "speedup_vs_model_parallel": plain.makespan_s / sharp.makespan_s,
        "latency_s": latency_s,
    }


def worst_ratio(settings: Sequence[dict[str, Any]], strategy: str) -> float:
    """The largest makespan / lower bound of ``strategy`` over the simulated settings."""
    return max(float(row["results"][strategy]["ratio"]) for row in settings)


def run_simulated(s: SharpSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """The simulated numbers of ``shoal bench sharp`` (its first three phases)."""
    progress(SHARP_PHASES[0])
    hydra = simulate_setting(hydra_setting(seed=s.seed))
    progress(SHARP_PHASES[1])
    spot = simulate_setting(spot_setting(devices=s.spot_devices, models=s.spot_models, seed=s.seed))
    progress(SHARP_PHASES[2])
    scale = mixed_setting(s.scale_devices, s.scale_models, seed=s.seed)
    started = time.perf_counter()
    big = simulate(scale.cluster, scale.plans, Strategy.LRTF)
    seconds = time.perf_counter() - started
    settings = [hydra, spot]
    return {
        "sim_lrtf_over_lower_bound": worst_ratio(settings, Strategy.LRTF.value),
        "sim_fifo_over_lower_bound": worst_ratio(settings, Strategy.FIFO.value),
        "sim_at_steps_over_lower_bound": worst_ratio(settings, AT_STEPS),
        "sim_1024_devices_seconds": seconds,
        "sim_settings": settings,
        "sim_scale": {
            "name": scale.name,
            "devices": len(scale.cluster.devices()),
            "models": len(scale.plans),
            "lrtf_ratio": big.ratio,
            "tasks": big.tasks,
        },
    }
