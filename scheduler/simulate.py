"""The cluster simulator's entry point: which strategy trains a set of models on a cluster.

SHARP runs ``scheduler.sharp``'s own ordering, assignment and lookahead
(``scheduler.simsharp``), so what the simulator says about a policy is what the shard pool
would do on such a cluster; the baselines it is compared with hold whole models on their
own devices (``scheduler.simgang``). A result is a ``SimResult``: makespan over lower bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum

from shoal.scheduler.sharp import ModelId, ModelPlan, Policy
from shoal.scheduler.simcluster import Cluster, Setting, sweep_settings
from shoal.scheduler.simgang import run_gangs
from shoal.scheduler.simresult import SimResult, SimulationError
from shoal.scheduler.simsharp import run_sharp
from shoal.scheduler.simstate import ENGINE, Engine


class Strategy(StrEnum):
    LRTF = "sharp-lrtf"
    """SHARP with Hydra's Sharded-LRTF order."""
    FIFO = "sharp-fifo"
    ROUND_ROBIN = "sharp-round-robin"
    MODEL_PARALLEL = "model-parallel"
    """Each model in turn sharded over the devices, no overlap between models."""
    TASK_PARALLEL = "task-parallel"
    """Each model alone on one device where it fits, else over the fewest devices, FIFO."""


_POLICIES = {
    Strategy.LRTF: Policy.LRTF,
    Strategy.FIFO: Policy.FIFO,
    Strategy.ROUND_ROBIN: Policy.ROUND_ROBIN,
}


def simulate(
    cluster: Cluster,
    plans: Sequence[ModelPlan],
    strategy: Strategy = Strategy.LRTF,
    *,
    prefetch: bool = True,
    truth: Mapping[ModelId, float] | None = None,
    engine: Engine = ENGINE,
    record: bool = False,
) -> SimResult:
    """Train ``plans`` together on ``cluster`` under ``strategy``. ``truth`` makes a model's
    tasks take that factor longer than estimated; ``engine`` is SHARP's executor (its queue
    depth and latency); ``record`` keeps every task's record."""
    names = [p.model for p in plans]
    if len(set(names)) != len(names):
        raise SimulationError("model ids must be unique among the models sharing a cluster")
    if not cluster.devices():
        raise SimulationError("the cluster has no devices; give it at least one")
    scale = dict(truth or {})
    bad = next((m for m, f in scale.items() if not f > 0), None)
    if bad is not None:
        raise SimulationError(f"truth factor of model {bad} must be > 0, got {scale[bad]}")
    if strategy in _POLICIES:
        tally = run_sharp(
            cluster,
            plans,
            _POLICIES[strategy],
            prefetch=prefetch,
            truth=scale,
            engine=engine,
            record=record,
        )
    else:
        one = strategy is Strategy.MODEL_PARALLEL
        tally = run_gangs(
            cluster, plans, one_at_a_time=one, prefetch=prefetch, truth=scale, record=record
        )
    return tally.result(strategy.value, prefetch, cluster, plans, truth)


def compare(
    setting: Setting, strategies: Iterable[Strategy] = tuple(Strategy), *, prefetch: bool = True
) -> tuple[SimResult, ...]:
    """Every strategy on one setting, in the order given."""
    return tuple(simulate(setting.cluster, setting.plans, s, prefetch=prefetch) for s in strategies)


def sweep(
    devices: Sequence[int] = (8, 32, 128, 512, 1024),
    models: Sequence[int] = (4, 16, 64, 256, 1000),
    strategies: Iterable[Strategy] = (Strategy.LRTF, Strategy.FIFO, Strategy.ROUND_ROBIN),
    *,
    steps: int = 4,
    prefetch: bool = True,
    seed: int = 0,
) -> tuple[tuple[str, SimResult], ...]:
    """(setting name, result) for every strategy on every (devices, models) pair of the
    heterogeneous fleet (``scheduler.simcluster.sweep_settings``); the baselines are left
    out by default, as one model at a time takes long on a thousand models."""
    chosen = tuple(strategies)
    return tuple(
        (setting.name, result)
        for setting in sweep_settings(devices, models, steps=steps, seed=seed)
        for result in compare(setting, chosen, prefetch=prefetch)
    )
