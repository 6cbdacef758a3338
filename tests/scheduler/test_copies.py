"""How often in-memory copies are taken: their measured cost against the job's budget."""

from __future__ import annotations

import pytest

from shoal.scheduler.copies import (
    LONGEST_INTERVAL,
    CopyCadence,
    copy_interval,
    copy_seconds,
    most_replayed,
)

pytestmark = pytest.mark.unit


def test_the_interval_is_the_fewest_steps_that_keep_copies_within_the_budget() -> None:
    # A 10 ms copy against 100 ms steps: 10% each step, so every 2 steps for 5%.
    assert copy_interval(0.010, 0.100, 0.05) == 2
    assert copy_interval(0.005, 0.100, 0.05) == 1  # exactly the budget: every step
    assert copy_interval(0.0051, 0.100, 0.05) == 2
    assert copy_interval(0.050, 0.100, 0.05) == 10
    assert copy_interval(0.0, 0.100, 0.05) == 1
    assert copy_interval(10.0, 0.001, 0.05) == LONGEST_INTERVAL == 100  # as the README says
    assert copy_interval(0.010, 0.0, 0.05) == LONGEST_INTERVAL
    # The whole training time: no limit, however costly a copy.
    assert copy_interval(10.0, 0.001, 1.0) == 1
    assert copy_interval(0.2, 0.1, 0.99) == 3
    with pytest.raises(ValueError, match="copy_budget"):
        copy_interval(0.01, 0.1, 0.0)


def test_the_cadence_waits_for_a_measured_copy_then_decides_once_and_on_changes() -> None:
    cadence = CopyCadence(0.05)
    assert not cadence.plan() and cadence.interval == 1  # nothing measured yet
    cadence.observe(step_time_s=0.120, copy_s=0.020)  # a step that followed a copy
    assert cadence.step_s == pytest.approx(0.100)  # its time less the copy
    assert cadence.plan() and cadence.interval == 4  # 20 ms / (5% x 100 ms)
    assert cadence.overhead == pytest.approx(0.05)
    assert not cadence.plan()  # no news
    for _ in range(3):
        cadence.observe(step_time_s=0.100, copy_s=0.0)
    cadence.observe(step_time_s=0.300, copy_s=0.100)
    cadence.observe(step_time_s=0.100, copy_s=0.0)
    # Two copies: the median is their middle, 60 ms; the steps less their copies are
    # 100 ms but one of 200 ms, of which the last five count.
    assert cadence.copy_s == pytest.approx(0.060) and cadence.step_s == pytest.approx(0.100)
    assert cadence.plan() and cadence.interval == 12


def test_the_interval_goes_down_only_by_a_quarter_or_more() -> None:
    cadence = CopyCadence(0.05, interval=10)
    cadence.observe(step_time_s=0.100, copy_s=0.0)
    cadence.observe(step_time_s=0.145, copy_s=0.045)  # wants 9: not worth the change
    assert cadence.plan() and cadence.interval == 10  # the first decision is news
    assert not cadence.plan()
    cadence = CopyCadence(0.05, interval=10)
    cadence.observe(step_time_s=0.100, copy_s=0.0)
    cadence.observe(step_time_s=0.130, copy_s=0.030)  # wants 6
    assert cadence.plan() and cadence.interval == 6
    cadence.observe(step_time_s=0.130, copy_s=0.030)
    cadence.observe(step_time_s=0.200, copy_s=0.100)  # copies 30/30/100 -> wants 6
    assert not cadence.plan() and cadence.interval == 6


def test_a_copy_is_due_an_interval_after_the_last() -> None:
    cadence = CopyCadence(0.05, interval=3)
    assert cadence.steps_to_next(None, 7) == 0  # none taken yet: now
    assert [cadence.steps_to_next(4, s) for s in (4, 5, 6, 7, 9)] == [3, 2, 1, 0, 0]


def test_a_loss_replays_at_most_the_interval_or_the_steps_since_the_copy_kept() -> None:
    assert most_replayed(4, step=9, kept=None) == 4  # none kept yet
    assert most_replayed(4, step=10, kept=8) == 4
    assert most_replayed(4, step=13, kept=8) == 5  # the copy of 12 on its way, one step on
    # The interval shrank to 2 at the copy of step 20, taken 10 steps after the one before:
    # lost while that copy is on its way, the job goes back to step 10.
    assert most_replayed(2, step=20, kept=10) == 10
    # The copies after steps 1 and 2 were not made: lost after step 3, back to step 0.
    assert most_replayed(1, step=3, kept=0) == 3
    # A recovery copies the step it went back to, before the last copy's step.
    assert most_replayed(2, step=5, kept=9) == 2


@pytest.mark.unit
def test_copies_made_beside_steps_longer_than_them_still_let_the_cadence_decide() -> None:
    """On a busy machine a CPU device's copying thread may take longer than the step it ran
    beside: the step is then measured whole, and the interval is decided all the same."""
    cadence = CopyCadence(budget=0.05)
    for _ in range(3):
        cadence.observe(step_time_s=0.003, copy_s=0.011)
    assert cadence.plan() and cadence.interval == 74  # 0.011 / (0.05 x 0.003), rounded up
    assert cadence.step_s == pytest.approx(0.003)


def test_a_copy_costs_the_slowest_worker_or_all_of_them_where_they_share_the_cores() -> None:
    """Two CPU stages on a machine of two cores: each one's copying threads take the core
    the other computes on, so the step pays both copies; on devices of their own (GPUs,
    CPU devices that leave a core free) it waits for the slowest alone."""
    assert copy_seconds([0.020, 0.025], cores_shared=False) == 0.025
    assert copy_seconds([0.020, 0.025], cores_shared=True) == pytest.approx(0.045)
    assert copy_seconds([0.030], cores_shared=True) == 0.030  # one stage: either way
    assert copy_seconds([], cores_shared=True) == 0.0
    # The interval doubles with the cost: 45 ms a copy against 140 ms steps at 5%.
    assert copy_interval(0.045, 0.140, 0.05) == 7
    assert copy_interval(0.025, 0.140, 0.05) == 4
