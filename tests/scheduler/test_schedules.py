"""GPipe / 1F1B schedules: complete, deadlock-free, memory-bounded; broken ones rejected."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.scheduler.schedules import (
    Action,
    Op,
    ScheduleError,
    build,
    dependencies,
    gpipe,
    in_flight,
    one_f_one_b,
    peak_in_flight,
    render,
    simulate,
    submission_order,
    validate,
)

pytestmark = pytest.mark.unit

sizes = st.tuples(st.integers(1, 8), st.integers(1, 16))
names = st.sampled_from(["gpipe", "1f1b"])


@given(sizes, names)
def test_built_schedules_validate(size: tuple[int, int], name: str) -> None:
    stages, micro_batches = size
    schedule = build(name, stages, micro_batches)
    validate(schedule)
    assert len(schedule) == stages
    assert all(len(row) == 2 * micro_batches for row in schedule)


@given(sizes)
def test_1f1b_bounds_in_flight_micro_batches(size: tuple[int, int]) -> None:
    # p - s on stage s, one more on the first stage of a pipeline (it runs a forward ahead).
    stages, micro_batches = size
    for s, actions in enumerate(one_f_one_b(stages, micro_batches)):
        ahead = 1 if s == 0 and stages > 1 else 0
        assert in_flight(actions) == min(stages - s + ahead, micro_batches)
    for s, actions in enumerate(one_f_one_b(stages, micro_batches, ahead=0)):
        assert in_flight(actions) == min(stages - s, micro_batches)


@given(sizes, names)
def test_peak_in_flight_is_the_built_schedules(size: tuple[int, int], name: str) -> None:
    stages, micro_batches = size
    for s, actions in enumerate(build(name, stages, micro_batches)):
        assert peak_in_flight(name, stages, s, micro_batches) == in_flight(actions)


def _step_seconds(
    schedule: tuple[tuple[Action, ...], ...], cost: list[tuple[float, float]]
) -> float:
    """When the last action of ``schedule`` ends, each stage running its actions in order as
    soon as their inputs are there, stage s's forward taking ``cost[s][0]`` seconds and its
    backward ``cost[s][1]`` (transfers free)."""
    ended: dict[Action, float] = {}
    free = [0.0] * len(schedule)
    cursors = [0] * len(schedule)
    last = len(schedule) - 1
    while any(c < len(row) for c, row in zip(cursors, schedule, strict=True)):
        for s, row in enumerate(schedule):
            if cursors[s] == len(row):
                continue
            a = row[cursors[s]]
            needs = dependencies(a, last)
            if any(d not in ended for d in needs):
                continue
            start = max([free[s], *(ended[d] for d in needs)])
            free[s] = ended[a] = start + cost[s][0 if a.op is Op.F else 1]
            cursors[s] += 1
    return max(free)


@given(
    st.integers(2, 5),
    st.integers(1, 12),
    st.lists(st.tuples(st.floats(0.1, 4), st.floats(0.1, 4)), min_size=5, max_size=5),
)
def test_the_first_stage_running_ahead_never_lengthens_a_step(
    stages: int, micro_batches: int, costs: list[tuple[float, float]]
) -> None:
    cost = costs[:stages]
    plain = _step_seconds(one_f_one_b(stages, micro_batches, ahead=0), cost)
    ahead = _step_seconds(one_f_one_b(stages, micro_batches), cost)
    assert ahead <= plain + 1e-9


def test_the_first_stage_running_ahead_fills_its_wait_when_it_is_the_slowest() -> None:
    # The pipeline bench's two stages: the first 8% the heavier, a backward twice a forward.
    cost = [(1.08, 2.17), (1.0, 2.0)]
    plain = _step_seconds(one_f_one_b(2, 8, ahead=0), cost)
    ahead = _step_seconds(one_f_one_b(2, 8), cost)
    busy = 8 * sum(cost[0])
    assert busy / plain == pytest.approx(0.905, abs=0.005)
    assert busy / ahead == pytest.approx(0.954, abs=0.005)


@given(sizes)
def test_gpipe_holds_every_micro_batch(size: tuple[int, int]) -> None:
    stages, micro_batches = size
    assert all(in_flight(row) == micro_batches for row in gpipe(stages, micro_batches))


@given(sizes, names)
def test_makespan_is_the_pipeline_bound(size: tuple[int, int], name: str) -> None:
    # Unit-time F and B: 2 (m + p - 1) slots, the (p-1)/(m+p-1) bubble of GPipe and 1F1B.
    stages, micro_batches = size
    timeline, stuck = simulate(build(name, stages, micro_batches))
    assert not any(stuck)
    assert len(timeline[0]) == 2 * (micro_batches + stages - 1)


@given(sizes, names)
def test_submission_order_respects_dependencies(size: tuple[int, int], name: str) -> None:
    stages, micro_batches = size
    schedule = build(name, stages, micro_batches)
    order = submission_order(schedule)
    position = {a: i for i, a in enumerate(order)}
    assert len(position) == 2 * stages * micro_batches
    for a in order:
        if a.op is Op.F and a.stage > 0:
            assert position[Action(a.stage - 1, Op.F, a.microbatch)] < position[a]
        if a.op is Op.B:
            before = a.stage + 1 if a.stage < stages - 1 else a.stage
            op = Op.B if a.stage < stages - 1 else Op.F
            assert position[Action(before, op, a.microbatch)] < position[a]
    for s in range(stages):
        assert tuple(a for a in order if a.stage == s) == schedule[s]


@given(sizes, names, st.data())
def test_swapping_a_backward_before_its_forward_is_rejected(
    size: tuple[int, int], name: str, data: st.DataObject
) -> None:
    stages, micro_batches = size
    schedule = [list(row) for row in build(name, stages, micro_batches)]
    s = data.draw(st.integers(0, stages - 1))
    j = data.draw(st.integers(0, micro_batches - 1))
    row = schedule[s]
    f, b = row.index(Action(s, Op.F, j)), row.index(Action(s, Op.B, j))
    row[f], row[b] = row[b], row[f]
    with pytest.raises(ScheduleError, match=f"B{j} before F{j}"):
        validate(tuple(tuple(r) for r in schedule))


@given(sizes, names, st.data())
def test_dropping_an_action_is_rejected(
    size: tuple[int, int], name: str, data: st.DataObject
) -> None:
    stages, micro_batches = size
    schedule = [list(row) for row in build(name, stages, micro_batches)]
    s = data.draw(st.integers(0, stages - 1))
    dropped = schedule[s].pop(data.draw(st.integers(0, len(schedule[s]) - 1)))
    with pytest.raises(ScheduleError, match="never runs") as error:
        validate(tuple(tuple(r) for r in schedule))
    assert f"stage {s} never runs {dropped}" in str(error.value)


def test_a_deadlock_is_rejected_with_the_grid() -> None:
    # Stage 0 waits for B0 before its F1; stage 1 insists on F1 first: neither can move.
    schedule = (
        (Action(0, Op.F, 0), Action(0, Op.B, 0), Action(0, Op.F, 1), Action(0, Op.B, 1)),
        (Action(1, Op.F, 1), Action(1, Op.F, 0), Action(1, Op.B, 0), Action(1, Op.B, 1)),
    )
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        validate(schedule)
    assert str(error.value).splitlines()[1:] == [
        "s0  F0   | B0! F1! B1!",
        "s1   .   | F1! F0! B0! B1!",
    ]


def test_duplicates_foreign_actions_and_empty_schedules_are_rejected() -> None:
    one = gpipe(1, 1)[0]
    with pytest.raises(ScheduleError, match="runs F0 twice"):
        validate(((*one, Action(0, Op.F, 0)),))
    with pytest.raises(ScheduleError, match="action of another stage"):
        validate((one, one))
    with pytest.raises(ScheduleError, match="not a micro-batch index"):
        validate(((*one, Action(0, Op.F, -1), Action(0, Op.B, -1)),))
    with pytest.raises(ScheduleError, match="at least one stage"):
        validate(())
    with pytest.raises(ScheduleError, match="no actions"):
        validate(((),))


def test_build_refuses_unknown_names_and_sizes() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        build("zb", 2, 2)
    with pytest.raises(ScheduleError, match="at least 1 stage"):
        build("gpipe", 0, 2)
    with pytest.raises(ScheduleError, match="micro_batches=0"):
        build("1f1b", 2, 0)


def test_render_1f1b_grid() -> None:
    assert render(one_f_one_b(3, 4)).splitlines() == [
        "s0 F0 F1 F2 F3  . B0  . B1  . B2  . B3",
        "s1  . F0 F1  . B0 F2 B1 F3 B2  . B3  .",
        "s2  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  .",
    ]
