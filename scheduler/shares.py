"""Micro-batch shares between the replicas of one cut."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shoal.scheduler.cut import Model
from shoal.scheduler.types import BlockRange
from shoal.scheduler.workload import Workload


def share(times: Sequence[float], limits: Sequence[int], total: int, stages: int) -> list[int]:
    """Micro-batches per replica (each >= 1, at most its memory limit, summing to ``total``)
    minimizing the slowest replica's (m_g + stages - 1) x time_g. The optimum is one of the
    values (k + stages - 1) x time_g: bracket it, then binary-search those candidates."""
    if len(times) == 1:
        return [total]

    def counts(step: float) -> list[int]:
        return [
            min(limit, total if t <= 0 else math.floor(step / t * (1 + 1e-12)) - stages + 1)
            for t, limit in zip(times, limits, strict=True)
        ]

    def feasible(step: float) -> bool:
        trial = counts(step)
        return min(trial) >= 1 and sum(trial) >= total

    slowest = max(times)
    rate = sum(1 / t for t in times if t > 0)
    # Lower bounds: every replica runs >= 1 micro-batch; the continuous relaxation.
    low = max(stages * slowest, (total + len(times) * (stages - 1)) / rate if rate else 0.0)
    high, ceiling = low + slowest, (total + stages - 1) * slowest
    while high < ceiling and not feasible(high):
        high = min(ceiling, low + 2 * (high - low))
    candidates = sorted(
        {
            (k + stages - 1) * t
            for t in times
            if t > 0
            for k in range(max(1, math.floor(low / t) - stages), math.ceil(high / t) - stages + 2)
        }
        | {high}
    )
    lo, hi = 0, len(candidates) - 1  # candidates[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(candidates[mid]) else (mid + 1, hi)
    shares = counts(candidates[hi])
    while sum(shares) > total:  # drop the surplus where it costs most
        g = max(
            (g for g in range(len(shares)) if shares[g] > 1),
            key=lambda g: (shares[g] + stages - 1) * times[g],
        )
        shares[g] -= 1
    return shares


_UNLIMITED = 2**62
"""A share limit no mini-batch reaches."""


def flight_limit(model: Model, blocks: BlockRange, memory: int, stages: int, stage: int) -> int:
    """The most micro-batches one replica may take before this stage outgrows ``memory``;
    unlimited where the most the schedule ever keeps in flight on it fits
    (``peak_in_flight``: 1F1B's p - s, one more on the first of two or more stages)."""
    base = model.memory(*blocks, flight=0)
    per = model.memory(*blocks, flight=1) - base
    if base + per * model.in_flight(stages, stage, _UNLIMITED) <= memory:
        return _UNLIMITED
    return 0 if per == 0 else max(0, (memory - base) // per)


def workload_shares(
    workload: Workload, times: Sequence[float], limits: Sequence[int], stages: int
) -> list[int] | None:
    """Each replica's micro-batches (``share``); ZeRO-3's replicas run in lockstep
    (``workers.pipeline.gathering``): the same number each, or none fits (None)."""
    m, r = workload.micro_batches, len(times)
    if workload.shard != "full" or r == 1:
        return share(times, limits, m, stages)
    if m % r or m // r > min(limits):
        return None
    return [m // r] * r


def uneven_refusal(replicas: int, micro_batches: int) -> str:
    """Why ZeRO-3 cannot run ``replicas`` replicas over ``micro_batches``."""
    return (
        f"shard: full runs {replicas} replicas in lockstep on equal micro-batches, but the"
        f" mini-batch has {micro_batches}; use a multiple of {replicas} micro_batches or"
        " other replicas"
    )
