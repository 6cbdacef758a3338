"""Where a stage's step time goes (``StepTimer``): a part timed inside another is that
part's alone, and an emulated straggler sleeps in proportion to its own compute only."""

from __future__ import annotations

import time

import pytest
import torch

from shoal.workers.pipeline.timing import StepTimer

INNER_S = 0.1
OWN_S = 0.05


def _compute_around_an_exchange(timer: StepTimer) -> None:
    with timer.span("compute"):
        time.sleep(OWN_S)
        with timer.span("allreduce"):
            time.sleep(INNER_S)


@pytest.mark.unit
def test_a_part_timed_inside_another_is_left_out_of_the_outer_one() -> None:
    timer = StepTimer(torch.device("cpu"))
    _compute_around_an_exchange(timer)
    clock = timer.lap()
    assert clock.allreduce_s >= INNER_S, clock
    # Counted twice, compute would be at least OWN_S + INNER_S.
    assert OWN_S <= clock.compute_s < OWN_S + INNER_S / 2, clock
    assert timer.lap().compute_s == 0.0  # a lap restarts the counts


@pytest.mark.unit
def test_a_straggler_sleeps_for_its_own_compute_not_the_exchanges_inside_it() -> None:
    timer = StepTimer(torch.device("cpu"), slowdown=2.0)
    started = time.perf_counter()
    _compute_around_an_exchange(timer)
    wall = time.perf_counter() - started
    clock = timer.lap()
    assert clock.allreduce_s >= INNER_S, clock
    # Twice its own compute; sleeping for the exchange too would add another INNER_S.
    assert 2 * OWN_S <= clock.compute_s < 2 * OWN_S + INNER_S / 2, clock
    assert wall < 2 * OWN_S + INNER_S + INNER_S / 2, wall
