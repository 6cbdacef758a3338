"""The cluster simulator: SHARP's policies and the baselines on modelled clusters, with copies,
prefetch and spot outages; the invariants of every schedule it produces."""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.sharp import ModelPlan, Shard
from shoal.scheduler.simcluster import (
    Cluster,
    DeviceKind,
    Outage,
    hydra_setting,
    lower_bound,
    mixed_setting,
    spot_setting,
    sweep_settings,
)
from shoal.scheduler.simresult import SimResult, SimulationError
from shoal.scheduler.simstate import Engine, Moves, Recovery
from shoal.scheduler.simulate import Strategy, compare, simulate

pytestmark = pytest.mark.unit

GiB = 2**30
SHARP = (Strategy.LRTF, Strategy.FIFO, Strategy.ROUND_ROBIN)


def chain(
    model: str,
    shards: int = 2,
    steps: int = 1,
    order: int = 0,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    state: int = GiB,
    recompute: bool = False,
) -> ModelPlan:
    parts = tuple(Shard(i, (i, i + 1), forward, backward, state, 0) for i in range(shards))
    return ModelPlan(model, parts, steps, order, recompute)


def cluster(
    count: int = 1,
    *,
    speed: float = 1.0,
    budget: int = 16 * GiB,
    gbps: float = math.inf,
    spot: bool = False,
    outages: tuple[Outage, ...] = (),
) -> Cluster:
    return Cluster(((DeviceKind("k", speed, budget, gbps, spot), count),), outages=outages)


# ------------------------------------------------------------------- single-model cases


def test_one_model_on_one_device_takes_the_sum_of_its_tasks() -> None:
    plan = chain("m", shards=3, steps=2)
    result = simulate(cluster(), [plan])
    assert result.makespan_s == pytest.approx(plan.work_s) and result.tasks == plan.tasks


def test_without_prefetch_every_change_of_shard_is_a_copy_in() -> None:
    plan = chain("m", shards=3, steps=2, state=10**9)  # 1 s per copy at 1 GB/s
    changes = sum(
        1 for p in range(plan.tasks) if p == 0 or plan.shard_at(p) != plan.shard_at(p - 1)
    )
    result = simulate(cluster(gbps=1.0), [plan], prefetch=False)
    assert changes == 9  # F0 F1 F2 (B2 stays) B1 B0 | (F0 stays) F1 F2 (B2) B1 B0
    assert result.makespan_s == pytest.approx(plan.work_s + changes)
    assert result.exposed_transfer_s == pytest.approx(changes)


def test_prefetch_hides_copies_behind_compute() -> None:
    plan = chain("m", shards=3, steps=2, state=10**9)
    hidden = simulate(cluster(gbps=1.0), [plan])
    assert hidden.makespan_s == pytest.approx(plan.work_s + 1)  # only the very first copy
    assert hidden.makespan_s <= simulate(cluster(gbps=1.0), [plan], prefetch=False).makespan_s


def test_measured_slowness_scales_the_run() -> None:
    plan = chain("m")
    result = simulate(cluster(), [plan], truth={"m": 2.0})
    assert result.makespan_s == pytest.approx(2 * plan.work_s) == result.lower_bound_s


# --------------------------------------------------------------------------- the policies


def test_on_a_device_lrtf_runs_the_model_with_the_most_left_first() -> None:
    plans = [chain("a", 1, 1, 0), chain("b", 1, 1, 1), chain("c", 1, 4, 2)]  # 3, 3, 12 s
    lrtf = simulate(cluster(1), plans, Strategy.LRTF, record=True)
    fifo = simulate(cluster(1), plans, Strategy.FIFO, record=True)
    assert [r.model for r in lrtf.records][:2] == ["c", "c"]
    assert [r.model for r in fifo.records][:2] == ["a", "a"]
    assert lrtf.makespan_s == fifo.makespan_s == pytest.approx(18.0)  # one device: all work


def test_hydra_setting_is_near_the_lower_bound_once_models_move() -> None:
    """The executor's homes (a model's shards on one device, models placed heaviest first),
    its moves at step boundaries and its copies beside the compute: measured 1.041; without
    moves more (devices fall idle as the models placed on them end while others still hold
    two); trading places instead, 1.010; trading with copies on the devices' path (each 8%
    of a step on these devices' 12 GB/s links: taken every 2 steps within 5%), 1.049."""
    setting = hydra_setting()
    results = {r.strategy: r for r in compare(setting)}
    assert 1.0 <= results["sharp-lrtf"].ratio <= 1.06
    pinned = simulate(setting.cluster, setting.plans, engine=Engine(moves=Moves.NONE))
    assert pinned.makespan_s > results["sharp-lrtf"].makespan_s
    trading = simulate(setting.cluster, setting.plans, engine=Engine(moves=Moves.TRADES))
    assert 1.0 <= trading.ratio <= 1.02 and trading.trades > 0
    on_path = Engine(moves=Moves.TRADES, overlapped=False)
    assert 1.04 <= simulate(setting.cluster, setting.plans, engine=on_path).ratio <= 1.07
    assert min(r.ratio for r in results.values()) >= 1.0
    assert results["sharp-lrtf"].makespan_s < results["task-parallel"].makespan_s
    assert results["task-parallel"].makespan_s < results["model-parallel"].makespan_s


AT_STEPS = Engine(moves=Moves.AT_STEPS, recovery=Recovery.STEP)
"""The executor with ``trades`` and ``task_copies`` off: models placed as alike move at step
boundaries, a loss rolls back to the last copy."""


def test_a_model_lives_where_its_work_ends_soonest_for_the_devices_speed() -> None:
    """Placed as alike, moving at step boundaries (``AT_STEPS``)."""
    mixed = Cluster(
        (
            (DeviceKind("fast", 8.0, 16 * GiB, math.inf), 1),
            (DeviceKind("slow", 1.0, 16 * GiB, math.inf), 1),
        )
    )
    plans = [chain(m, shards=2, steps=4, order=i) for i, m in enumerate("abc")]  # 24 s each
    result = simulate(mixed, plans, Strategy.LRTF, record=True, engine=AT_STEPS)
    assert {r.device for r in result.records} == {"fast-0000"}  # 72 / 8 < 24 (the slow one)
    assert result.makespan_s == pytest.approx(72 / 8)


def test_models_that_trade_places_share_the_fast_device_as_the_bound_assumes() -> None:
    """Two alike models on a fast and a slow device: placed and moved at step boundaries
    both live on the fast one (the slow one alone would end later), 64 s; trading places
    before a task (``Moves.TRADES``), each starts on a device of its own and the one on
    the slow device takes the fast one once the other has enough less to go (52 s: each
    hand-over runs the forwards whose backward is to come again on the other device; 50 s
    when the backwards recompute them anyway)."""
    mixed = Cluster(
        (
            (DeviceKind("fast", 3.0, 16 * GiB, math.inf), 1),
            (DeviceKind("slow", 1.0, 16 * GiB, math.inf), 1),
        )
    )
    plans = [chain(m, shards=8, steps=4, order=i) for i, m in enumerate("ab")]  # 96 s each
    at_steps = simulate(mixed, plans, engine=AT_STEPS)
    trading = simulate(mixed, plans, record=True)  # the executor's default
    assert at_steps.makespan_s == pytest.approx(64.0) and at_steps.trades == 0
    assert trading.lower_bound_s == pytest.approx(48.0)  # 192 s of work at 4 per second
    assert trading.trades > 0 and trading.ratio <= 1.1
    again = [chain(m, shards=8, steps=4, order=i, recompute=True) for i, m in enumerate("ab")]
    free = simulate(mixed, again)
    assert free.trades > 0 and free.makespan_s < trading.makespan_s and free.ratio <= 1.05
    for model in "ab":
        assert {r.device for r in trading.records if r.model == model} == {
            "fast-0000",
            "slow-0000",
        }
    check_schedule(mixed, plans, trading)


# ---------------------------------------------------------------------------- the engine


def test_the_executor_latency_is_paid_at_step_boundaries_with_a_queue_of_two() -> None:
    """Two tasks queued per device hide the round trip between a model's tasks on one
    device; only the first task and each step's first (queued once the executor has seen
    the step before end) wait for it."""
    plan = chain("m", shards=2, steps=2)  # 12 s of work, 8 tasks
    queued = simulate(cluster(), [plan], engine=Engine(depth=2, latency_s=0.5))
    assert queued.makespan_s == pytest.approx(12.0 + 0.5 + 2 * 0.5)
    alone = simulate(cluster(), [plan], engine=Engine(depth=1, latency_s=0.5))
    assert alone.makespan_s == pytest.approx(12.0 + 0.5 + 7 * 2 * 0.5)  # a round trip each


def test_prefetch_never_slows_sharp_down() -> None:
    for setting in (hydra_setting(steps=2), mixed_setting(16, 24, steps=2, lost_fraction=0)):
        for strategy in SHARP:
            on = simulate(setting.cluster, setting.plans, strategy)
            off = simulate(setting.cluster, setting.plans, strategy, prefetch=False)
            assert on.makespan_s <= off.makespan_s * (1 + 1e-9), (setting.name, strategy)


def test_results_are_deterministic() -> None:
    setting = mixed_setting(16, 24, steps=2)
    for strategy in Strategy:
        first = simulate(setting.cluster, setting.plans, strategy, record=True)
        assert first == simulate(setting.cluster, setting.plans, strategy, record=True)


def test_compare_runs_each_strategy_in_order() -> None:
    setting = hydra_setting(steps=1)
    assert [r.strategy for r in compare(setting)] == [s.value for s in Strategy]


# ---------------------------------------------------------------------------- spot losses


STEP_COPIES = Engine(recovery=Recovery.STEP)
"""Copies at every step that cost nothing, each loss rolling back to the step's start."""


def test_a_spot_loss_costs_the_step_under_way() -> None:
    """As the executor's in-memory copies allow: the model rolls back to its step's start
    on the device left (its first copy-in again), the tasks of that step done before lost."""
    plan = chain("m", forward=10.0, backward=20.0, state=10**9)  # 1 s copies at 1 GB/s
    base = simulate(cluster(2, gbps=1.0, spot=True), [plan], record=True, engine=STEP_COPIES)
    assert base.records[1].start_s < 15.0 < base.records[1].end_s  # F1 runs at 15 s
    lost = simulate(
        cluster(2, gbps=1.0, spot=True, outages=(Outage("k-0000", 15.0),)),
        [plan],
        record=True,
        engine=STEP_COPIES,
    )
    assert (lost.lost_tasks, lost.tasks) == (2, plan.tasks)
    assert sorted(r.position for r in lost.records if not r.completed) == [0, 1]
    assert {r.device for r in lost.records if r.completed} == {"k-0001"}
    assert lost.makespan_s == pytest.approx(15.0 + 1.0 + plan.work_s)


def test_with_task_recovery_a_spot_loss_costs_the_tasks_in_flight_and_the_open_forwards() -> None:
    """``Recovery.TASK``: what a task made is copied off its device as it is made, so the
    model goes on from its last task done on the device left, but a backward whose
    forward's graph was lost runs that forward again first. Lost in B0 at 50 s: F0, F1 and
    B1 are kept, and B0 runs after F0 again (1 s to copy shard 0 in, 10 s, 20 s). Lost in
    F1 at 15 s it saves nothing: F0's forward runs again before B0, as a step's roll back
    would run it before F1."""
    plan = chain("m", forward=10.0, backward=20.0, state=10**9)
    engine = Engine(recovery=Recovery.TASK)
    world = cluster(2, gbps=1.0, spot=True, outages=(Outage("k-0000", 50.0),))
    lost = simulate(world, [plan], engine=engine, record=True)
    assert (lost.lost_tasks, lost.tasks) == (1, plan.tasks)
    assert [(r.position, r.completed) for r in lost.records if r.device == "k-0000"] == [
        (0, True),
        (1, True),
        (2, True),
        (3, False),
    ]
    assert lost.makespan_s == pytest.approx(50.0 + 1.0 + 10.0 + 20.0)
    check_schedule(world, [plan], lost)
    early = cluster(2, gbps=1.0, spot=True, outages=(Outage("k-0000", 15.0),))
    task = simulate(early, [plan], engine=engine)
    step = simulate(early, [plan], engine=STEP_COPIES)
    assert task.makespan_s == pytest.approx(step.makespan_s) == pytest.approx(15 + 1 + 60)


def test_copies_cost_the_state_copied_off_after_each_backward_as_often_as_the_budget_allows() -> (
    None
):
    """Each backward of a step that ends with a copy copies its shard's state off the
    device (1 s at 1 GB/s) before the device's next task: 2 s a step of 60 s, 3.3%, so at
    every step within 5%; within 1%, every 4 steps (the interval ``scheduler.copies``
    gives). A loss then rolls back to the last copy even where tasks copy the step off:
    they do so only for models copied at every step."""
    plan = chain("m", forward=10.0, backward=20.0, state=10**9, steps=4)
    world = cluster(1, gbps=1.0)
    free = simulate(world, [plan], prefetch=False).makespan_s  # beside the compute
    on_path = Engine(overlapped=False)
    every = simulate(world, [plan], prefetch=False, engine=on_path).makespan_s
    rare = Engine(copy_budget=0.01, overlapped=False)
    rarely_s = simulate(world, [plan], prefetch=False, engine=rare).makespan_s
    assert (every - free, rarely_s - free) == (pytest.approx(8.0), pytest.approx(2.0))
    spot = cluster(2, gbps=1.0, spot=True, outages=(Outage("k-0000", 200.0),))
    task_by_task = Engine(recovery=Recovery.TASK, overlapped=False)
    task = simulate(spot, [plan], prefetch=False, engine=task_by_task, record=True)
    assert task.lost_tasks == 1  # step 4's F0 (at 193-203 s): the tasks before were copied
    rarely = Engine(recovery=Recovery.TASK, copy_budget=0.01, overlapped=False)
    rare_task = simulate(spot, [plan], prefetch=False, engine=rarely)
    assert rare_task.lost_tasks == 4 * 3 + 2  # F1 (197-208 s), and every task since the start
    check_schedule(spot, [plan], task)


def test_a_device_may_come_back() -> None:
    plan = chain("m", forward=10.0, backward=20.0)
    outage = Outage("k-0000", 15.0, back_s=30.0)
    result = simulate(cluster(1, spot=True, outages=(outage,)), [plan], engine=STEP_COPIES)
    assert result.lost_tasks == 2 and result.makespan_s == pytest.approx(30.0 + plan.work_s)


def test_losing_every_device_for_good_is_a_clear_error() -> None:
    outage = Outage("k-0000", 5.0)
    for strategy in Strategy:
        with pytest.raises(SimulationError, match="cannot"):
            simulate(cluster(1, spot=True, outages=(outage,)), [chain("m", steps=3)], strategy)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(SimulationError, match="unique"):
        simulate(cluster(), [chain("m"), chain("m")])
    with pytest.raises(SimulationError, match="unknown device"):
        simulate(cluster(outages=(Outage("nope", 1.0),)), [chain("m")])
    with pytest.raises(SimulationError, match="truth factor"):
        simulate(cluster(), [chain("m")], truth={"m": 0.0})
    with pytest.raises(SimulationError, match="largest device"):
        simulate(cluster(budget=GiB // 2), [chain("m")])


# ------------------------------------------------------------------------- the baselines


def test_model_parallel_keeps_one_device_busy_at_a_time() -> None:
    plans = [chain("a", 4, 2, 0, state=6 * GiB), chain("b", 4, 2, 1, state=6 * GiB)]
    result = simulate(cluster(4), plans, Strategy.MODEL_PARALLEL, record=True)
    spans = sorted((r.start_s, r.end_s) for r in result.records)
    assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))
    assert result.makespan_s == pytest.approx(sum(p.work_s for p in plans))
    assert len({r.device for r in result.records if r.model == "a"}) == 2  # 4 x 6 GiB


def test_task_parallel_puts_a_model_alone_on_one_device_where_it_fits() -> None:
    plans = [chain("a", 2, 1, 0), chain("b", 2, 1, 1), chain("big", 4, 1, 2, state=6 * GiB)]
    result = simulate(cluster(4), plans, Strategy.TASK_PARALLEL, record=True)
    devices = defaultdict(set)
    for r in result.records:
        devices[r.model].add(r.device)
    assert [len(devices[m]) for m in ("a", "b", "big")] == [1, 1, 2]
    assert result.makespan_s == pytest.approx(max(p.work_s for p in plans))


def test_a_model_no_gang_can_hold_is_a_clear_error() -> None:
    huge = chain("huge", 8, 1, state=6 * GiB)  # 48 GiB of state
    with pytest.raises(SimulationError, match="cannot be placed"):
        simulate(cluster(2), [huge], Strategy.MODEL_PARALLEL)
    assert simulate(cluster(2), [huge]).tasks == huge.tasks  # SHARP spills to host memory


# ------------------------------------------------------------------- bound and settings


def test_the_lower_bound() -> None:
    fleet = Cluster(
        ((DeviceKind("fast", 3.0, GiB, 1.0), 1), (DeviceKind("slow", 1.0, GiB, 1.0), 1))
    )
    one = chain("a", 1, 4)  # 12 s of work
    assert lower_bound(fleet, [one]) == pytest.approx(4.0)  # its chain on the fast device
    assert lower_bound(fleet, [one, chain("b", 1, 4)]) == pytest.approx(6.0)  # 24 s over 4
    assert lower_bound(fleet, [one], {"a": 2.0}) == pytest.approx(8.0)
    # Outages take capacity away while they last: the fast device is lost at 2 s and back
    # at 5 s; 24 s of work: 8 done by 2 s, 3 more by 5 s, the last 13 at 4 per second.
    lossy = replace(fleet, outages=(Outage("fast-0000", 2.0, 5.0),))
    assert lower_bound(lossy, [one, chain("b", 1, 4)]) == pytest.approx(5.0 + 13 / 4)
    gone = replace(fleet, outages=(Outage("fast-0000", 2.0),))
    assert lower_bound(gone, [one, chain("b", 1, 4)]) == pytest.approx(2.0 + 16 / 1)


def test_hydra_setting_is_eight_devices_and_twelve_big_models() -> None:
    setting = hydra_setting()
    ((kind, count),) = setting.cluster.kinds
    states = [sum(s.state_bytes for s in p.shards) / kind.budget_bytes for p in setting.plans]
    assert (count, len(setting.plans)) == (8, 12)
    assert all(1.9 <= s <= 4.1 for s in states)
    assert all(s.bytes <= kind.budget_bytes // 2 for p in setting.plans for s in p.shards)


def test_spot_setting_is_a_heterogeneous_cluster_losing_spot_devices() -> None:
    setting = spot_setting()
    devices = {d.id: d for d in setting.cluster.devices()}
    spot = [d for d in devices.values() if d.kind.spot]
    assert len(devices) == 512 and len(setting.cluster.kinds) == 4 and len(setting.plans) == 300
    assert all(devices[o.device].kind.spot for o in setting.cluster.outages)
    assert len(setting.cluster.outages) == len(spot) // 10
    assert any(o.back_s is not None for o in setting.cluster.outages)


def test_sweep_settings_cover_every_size_pair() -> None:
    settings_ = sweep_settings(devices=(8, 16), models=(4, 6), steps=1)
    sizes = [(sum(c for _, c in s.cluster.kinds), len(s.plans)) for s in settings_]
    assert sizes == [(8, 4), (8, 6), (16, 4), (16, 6)]


# ---------------------------------------------------------------------- the invariants


@st.composite
def worlds(draw: st.DrawFn, max_shards: int = 3) -> tuple[Cluster, list[ModelPlan]]:
    kinds = []
    for k in range(draw(st.integers(1, 2))):
        kind = DeviceKind(
            f"k{k}",
            draw(st.sampled_from([0.5, 1.0, 2.0])),
            draw(st.sampled_from([8, 12])) * GiB,
            draw(st.sampled_from([2.0, 20.0])),
            spot=k > 0 and draw(st.booleans()),
        )
        kinds.append((kind, draw(st.integers(1, 3))))
    sizes = st.integers(GiB // 8, 3 * GiB)
    plans = []
    for m in range(draw(st.integers(1, 4))):
        shards = tuple(
            Shard(
                i,
                (i, i + 1),
                draw(st.floats(0.1, 5.0)),
                draw(st.floats(0.1, 5.0)),
                draw(sizes),
                draw(st.integers(0, GiB)),
            )
            for i in range(draw(st.integers(1, max_shards)))
        )
        plans.append(ModelPlan(f"m{m}", shards, draw(st.integers(1, 2)), draw(st.integers(0, 3))))
    cluster_ = Cluster(tuple(kinds))
    spot = [d.id for d in cluster_.devices() if d.kind.spot]
    outages = tuple(
        Outage(d, draw(st.floats(0.0, 20.0)), draw(st.none() | st.floats(20.0, 40.0)))
        for d in spot
        if draw(st.booleans())
    )
    return Cluster(cluster_.kinds, outages), plans


def check_schedule(world: Cluster, plans: list[ModelPlan], result: SimResult) -> None:
    by_model = defaultdict(list)
    by_device = defaultdict(list)
    for r in result.records:
        by_model[r.model].append(r)
        by_device[r.device].append(r)
    for plan in plans:
        runs = sorted(by_model[plan.model], key=lambda r: (r.start_s, r.end_s))
        done = [r.position for r in runs if r.completed]
        assert done == list(range(plan.tasks)), plan.model  # in order, each exactly once
        assert all(b.start_s >= a.end_s - 1e-9 for a, b in itertools.pairwise(runs))
    budgets = {d.id: d.kind.budget_bytes for d in world.devices()}
    for device, runs in by_device.items():
        runs.sort(key=lambda r: (r.start_s, r.end_s))
        assert all(b.start_s >= a.end_s - 1e-9 for a, b in itertools.pairwise(runs))
        assert all(r.device_bytes <= budgets[device] for r in runs)
    assert all(peak <= budgets[d] for d, peak in result.peak_bytes)
    assert result.tasks == sum(p.tasks for p in plans)
    assert result.makespan_s >= result.lower_bound_s * (1 - 1e-9)


ENGINES = [
    Engine(moves=m, recovery=r, latency_s=0.1, overlapped=o)
    for m in Moves
    for r in Recovery
    for o in (True, False)
]


@settings(max_examples=200, deadline=None)
@given(worlds(), st.sampled_from(SHARP), st.booleans(), st.sampled_from([Engine(), *ENGINES]))
def test_every_sharp_schedule_keeps_the_invariants(
    world: tuple[Cluster, list[ModelPlan]], strategy: Strategy, prefetch: bool, engine: Engine
) -> None:
    cluster_, plans = world
    result = simulate(cluster_, plans, strategy, prefetch=prefetch, engine=engine, record=True)
    check_schedule(cluster_, plans, result)


@settings(max_examples=60, deadline=None)
@given(
    worlds(max_shards=2),
    st.sampled_from([Strategy.MODEL_PARALLEL, Strategy.TASK_PARALLEL]),
    st.booleans(),
)
def test_every_baseline_schedule_keeps_the_invariants(
    world: tuple[Cluster, list[ModelPlan]], strategy: Strategy, prefetch: bool
) -> None:
    cluster_, plans = world
    result = simulate(cluster_, plans, strategy, prefetch=prefetch, record=True)
    check_schedule(cluster_, plans, result)


@pytest.mark.slow
def test_the_spot_cluster_ends_near_the_bound_with_trades_and_task_copies_beside_the_compute() -> (
    None
):
    """Issue 20's goal (<= 1.1 the lower bound) needs models that trade places and copy each
    task's outputs and stepped state off the devices as they go (a loss costs the tasks in
    flight), beside the compute, so at every step: 1.071. Losing the step under way
    instead: 1.137; moving at step boundaries instead of trading: 1.301. Copies on the
    devices' path (5-12% of a step on these devices: the fast devices' models copy every
    2-3 steps of their 4, and a loss replays those): 1.262 even trading."""
    setting = spot_setting()

    def ratio(engine: Engine) -> float:
        return simulate(setting.cluster, setting.plans, engine=engine).ratio

    task = ratio(Engine())  # the executor's default
    step = ratio(Engine(recovery=Recovery.STEP))
    at_steps = ratio(AT_STEPS)
    on_path = ratio(Engine(overlapped=False))
    assert task <= 1.1 < step <= 1.16 < 1.2 <= min(at_steps, on_path), (
        task,
        step,
        at_steps,
        on_path,
    )


@pytest.mark.slow
def test_a_thousand_models_on_a_thousand_devices() -> None:
    setting = mixed_setting(1024, 1000)
    began = time.perf_counter()
    result = simulate(setting.cluster, setting.plans, Strategy.LRTF)
    print(f"1,024 devices x 1,000 models: {time.perf_counter() - began:.1f} s wall")
    assert result.tasks == sum(p.tasks for p in setting.plans)
    assert 1.0 <= result.ratio < 3.0 and 0.0 < result.mean_utilization <= 1.0


def test_a_device_lost_with_a_task_of_a_model_that_moved_away_rolls_that_model_back() -> None:
    """A model that moved while a task of its was still queued on its old device (a trade
    hands over behind the tasks queued there) rolls back when that device is lost, as the
    executor's task there fails; it was left waiting for that task for good."""
    from shoal.scheduler.sharp import Policy
    from shoal.scheduler.simsharp import _Sharp
    from shoal.scheduler.simstate import SimTask

    sim = _Sharp(cluster(2), [chain("m", steps=2)], Policy.LRTF, True, {}, Engine(), False)
    model = sim.models["m"]
    old, new = sorted(sim.devices)
    if model.homes[0] != old:
        old, new = new, old
    sim._relocate(model, new)
    model.held = [new] * len(model.held)
    sim.devices[old].queue.append(SimTask(0, "m", 0, model.epoch, 0.0))
    model.submitted = 1
    sim._lose(sim.devices[old], 0.0)
    assert (model.epoch, model.submitted, model.done) == (1, 0, 0), model
    assert sim.run().tasks == model.plan.tasks
