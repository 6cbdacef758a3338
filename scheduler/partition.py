"""Partitions: which contiguous block range each pipeline stage holds.

The pipeline runs at the pace of its slowest stage ((m + p - 1) x max stage time, GPipe), so
a partition is judged by its heaviest stage. ``balanced_partition`` is exact for any
non-negative block weights; heterogeneous devices (weights that depend on the device a stage
lands on) are a later concern of this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

from scheduler.types import BlockRange


def even_partition(num_blocks: int, stages: int) -> list[BlockRange]:
    """The balanced partition when every block costs the same."""
    return balanced_partition([1.0] * num_blocks, stages)


def balanced_partition(weights: Sequence[float], stages: int) -> list[BlockRange]:
    """Cut ``weights`` into ``stages`` non-empty contiguous ranges minimizing the largest sum.

    Dynamic programme over prefixes, ``best[k][i]`` = the smallest possible heaviest stage
    when the first ``i`` blocks form ``k`` stages. ``best[k-1][j]`` grows with ``j`` while the
    last stage's weight ``sum(weights[j:i])`` shrinks, so the optimal cut is where the two
    cross and is found by bisection: O(stages x blocks x log blocks), exact.
    """
    blocks = len(weights)
    if stages < 1:
        raise ValueError(f"a partition needs at least 1 stage, got {stages}")
    if stages > blocks:
        raise ValueError(
            f"cannot cut {blocks} blocks into {stages} non-empty stages;"
            " use at most as many stages (devices) as the model has blocks"
        )
    bad = next((w for w in weights if not (math.isfinite(w) and w >= 0)), None)
    if bad is not None:
        raise ValueError(f"block weights must be finite and >= 0, got {bad}")

    prefix = [0.0, *accumulate(float(w) for w in weights)]
    best = [prefix[i] for i in range(blocks + 1)]  # k = 1: one stage holds blocks [0, i)
    cuts: list[list[int]] = [[0] * (blocks + 1)]
    for k in range(2, stages + 1):
        previous, best = best, [math.inf] * (blocks + 1)
        cut = [0] * (blocks + 1)
        for i in range(k, blocks + 1):
            cut[i], best[i] = _best_cut(previous, prefix, lo=k - 1, hi=i - 1, stop=i)
        cuts.append(cut)

    ranges: list[BlockRange] = []
    stop = blocks
    for k in range(stages, 0, -1):
        start = cuts[k - 1][stop]
        ranges.append((start, stop))
        stop = start
    return ranges[::-1]


def _best_cut(
    previous: list[float], prefix: list[float], *, lo: int, hi: int, stop: int
) -> tuple[int, float]:
    """The cut ``j`` in ``[lo, hi]`` minimizing max(previous[j], weight of blocks [j, stop))."""
    first, last = lo, hi
    # Smallest j whose prefix cost reaches the last stage's weight (monotone crossing).
    while first < last:
        mid = (first + last) // 2
        if previous[mid] >= prefix[stop] - prefix[mid]:
            last = mid
        else:
            first = mid + 1
    candidates = [j for j in (first - 1, first) if lo <= j <= hi]
    costs = [(max(previous[j], prefix[stop] - prefix[j]), j) for j in candidates]
    cost, j = min(costs)
    return j, cost
