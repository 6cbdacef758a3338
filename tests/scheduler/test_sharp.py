"""SHARP decisions: shards that fit half a device, the task chain, the ordering policies, and
the assignment of tasks to idle devices (locality, memory, prefetch)."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.memory import stage_memory
from scheduler.profile import BlockCost
from scheduler.sharp import (
    Assignment,
    IdleDevice,
    Locality,
    ModelPlan,
    Op,
    Policy,
    Progress,
    Residence,
    Shard,
    ShardError,
    ShardTask,
    assign,
    lookahead,
    next_model,
    priority,
    progress,
    refine_ratio,
    shard_model,
    transfer_s,
)

pytestmark = pytest.mark.unit

GiB = 2**30


def block(i: int, seconds: float = 1.0, params: int = GiB // 4, activation: int = 0) -> BlockCost:
    return BlockCost(i, seconds, params, 2 * params, activation, activation)


def shard(index: int, forward: float = 1.0, size: int = GiB, backward: float = 2.0) -> Shard:
    return Shard(index, (index, index + 1), forward, backward, size, 0)


def plan(
    model: str,
    shards: int = 2,
    steps: int = 1,
    order: int = 0,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    size: int = GiB,
) -> ModelPlan:
    chain = tuple(shard(i, forward, size, backward) for i in range(shards))
    return ModelPlan(model, chain, steps, order)


def device(name: str, node: str = "n0", speed: float = 1.0, budget: int = 16 * GiB) -> IdleDevice:
    return IdleDevice(name, node, speed, budget, bandwidth_gbps=10.0)


# ------------------------------------------------------------------------------ shards


def test_shards_fit_half_the_budget_and_cover_the_blocks_in_order() -> None:
    costs = [block(i) for i in range(10)]  # 1 GiB of state each, 1/2 GiB of temporaries
    shards = shard_model(costs, 9 * GiB, micro_batch_size=1)  # 4 blocks fit half of 9 GiB
    assert [s.blocks[0] for s in shards] + [10] == [0, *[s.blocks[1] for s in shards]]
    assert sorted(s.blocks[1] - s.blocks[0] for s in shards) == [3, 3, 4]
    assert all(s.bytes <= 4.5 * GiB for s in shards)


def test_a_shard_is_its_blocks_state_and_what_one_micro_batch_allocates() -> None:
    costs = [block(i, activation=1000) for i in range(4)]
    (only,) = shard_model(costs, 64 * GiB, micro_batch_size=8)
    need = stage_memory(costs, (0, 4), micro_batch_size=8, in_flight=1, recompute=True)
    assert (only.state_bytes, only.activation_bytes) == (4 * GiB, need.total - 4 * GiB)
    assert only.activation_bytes == need.activations + need.transient
    (bf16,) = shard_model(costs, 64 * GiB, micro_batch_size=8, precision="bf16")
    assert bf16.activation_bytes == only.activation_bytes + 4 * GiB // 4 // 2  # weight copies


def test_without_recompute_every_micro_batch_keeps_its_activations() -> None:
    costs = [block(i, activation=1000) for i in range(4)]
    (kept,) = shard_model(costs, 64 * GiB, 8, micro_batches=3, recompute=False)
    need = stage_memory(costs, (0, 4), micro_batch_size=8, in_flight=3, recompute=False)
    assert kept.activation_bytes == need.activations + need.transient
    (one,) = shard_model(costs, 64 * GiB, 8, micro_batches=1, recompute=False)
    assert kept.activation_bytes > one.activation_bytes


def test_backward_recomputes_the_forward() -> None:
    (only,) = shard_model([block(0, seconds=3.0)], 8 * GiB, micro_batch_size=1)
    assert (only.forward_s, only.backward_s) == pytest.approx((1.0, 3.0))
    (plain,) = shard_model([block(0, seconds=3.0)], 8 * GiB, 1, recompute=False)
    assert plain.backward_s == pytest.approx(2.0)


def test_fewest_shards_then_balanced_compute() -> None:
    costs = [block(i, seconds=s) for i, s in enumerate([4.0, 1.0, 1.0, 1.0, 1.0])]
    shards = shard_model(costs, 9 * GiB, micro_batch_size=1)  # at most 4 blocks a shard
    assert [s.blocks for s in shards] == [(0, 1), (1, 5)]


def test_a_block_that_cannot_fit_alone_is_refused_with_the_fix() -> None:
    costs = [block(0), block(1, params=GiB), block(2)]  # 4 GiB of state, 2 of temporaries
    with pytest.raises(ShardError, match=r"block 1 needs 6\.0 GiB .* at most 3\.0 GiB") as err:
        shard_model(costs, 6 * GiB, micro_batch_size=1)
    assert "smaller micro-batches, recompute: true, or devices with more memory" in str(err.value)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ShardError, match="no blocks"):
        shard_model([], GiB, 1)
    with pytest.raises(ShardError, match="listed by index"):
        shard_model([block(1)], GiB, 1)
    with pytest.raises(ShardError, match="micro_batch_size"):
        shard_model([block(0)], GiB, 0)


def _fits(costs: list[BlockCost], a: int, b: int, half: int) -> bool:
    need = stage_memory(costs, (a, b), micro_batch_size=2, in_flight=1, recompute=True)
    return need.total <= half


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=7
    ),
    st.integers(12, 40),
)
def test_shard_model_matches_exhaustive_search(
    blocks: list[tuple[int, int, int]], budget: int
) -> None:
    costs = [BlockCost(i, float(t), p, p, a, a) for i, (t, p, a) in enumerate(blocks)]
    n, half = len(costs), budget // 2
    covers = [
        cuts
        for k in range(n)
        for cuts in combinations(range(1, n), k)
        if all(_fits(costs, a, b, half) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
    ]
    if not covers:
        with pytest.raises(ShardError):
            shard_model(costs, budget, micro_batch_size=2)
        return
    shards = shard_model(costs, budget, micro_batch_size=2)
    fewest = min(len(c) for c in covers) + 1
    times = [
        [sum(blocks[i][0] for i in range(a, b)) for a, b in zip((0, *c), (*c, n), strict=True)]
        for c in covers
        if len(c) + 1 == fewest
    ]
    best = min(max(t) for t in times)
    evenest = min(sum(x * x for x in t) for t in times if max(t) == best)
    got = [(s.forward_s + s.backward_s) * 3 / 4 for s in shards]
    assert sum(x * x for x in got) == pytest.approx(evenest)
    assert len(shards) == fewest
    assert [s.blocks[0] for s in shards] + [n] == [0, *[s.blocks[1] for s in shards]]
    assert all(s.bytes <= half for s in shards)
    assert max(s.forward_s + s.backward_s for s in shards) == pytest.approx(best * 4 / 3)


# --------------------------------------------------------------------- tasks, progress


def test_a_step_is_forward_shards_up_then_backward_down() -> None:
    chain = plan("m", shards=3, steps=2)
    tasks = [chain.task(p) for p in range(chain.tasks)]
    assert [f"{t.op.value[0]}{t.shard}" for t in tasks[:6]] == ["f0", "f1", "f2", "b2", "b1", "b0"]
    assert tasks[6] == ShardTask("m", 0, Op.FORWARD, 1) and chain.tasks == 12


def test_remaining_time_counts_the_tasks_left() -> None:
    chain = plan("m", shards=2, steps=3, forward=1.0, backward=2.0)  # 6 s a step
    assert [chain.remaining_s(d) for d in (0, 1, 3, 4, 11, 12)] == [18, 17, 14, 12, 2, 0]
    assert chain.work_s == 18 and chain.task_s(2) == 2.0


def test_a_plan_needs_shards_in_order_and_steps() -> None:
    with pytest.raises(ValueError, match="at least one shard and one step"):
        ModelPlan("m", (shard(0),), 0)
    with pytest.raises(ValueError, match=r"indexed 0\.\.k-1"):
        ModelPlan("m", (shard(1),), 1)


def test_measured_ratio_moves_towards_what_is_measured() -> None:
    assert refine_ratio(1.0, 2.0, 4.0) == pytest.approx(1.3)
    assert refine_ratio(1.0, 2.0, 4.0, weight=1.0) == 2.0
    assert refine_ratio(1.5, 0.0, 4.0) == 1.5
    assert progress(plan("m"), 0, ratio=2.0).remaining_s == 2 * plan("m").work_s


# ------------------------------------------------------------------------- the policies


def test_lrtf_runs_the_longest_remaining_model_first() -> None:
    models = [Progress("a", 0, 0, 10.0), Progress("b", 1, 0, 30.0), Progress("c", 2, 0, 20.0)]
    assert next_model(Policy.LRTF, models) == "b"


def test_lrtf_reads_the_refined_estimate() -> None:
    short = plan("short", shards=1, steps=1)
    long = plan("long", shards=2, steps=1)
    slow = progress(short, 0, ratio=3.0)  # measured 3x slower than estimated
    assert next_model(Policy.LRTF, [progress(long, 0), slow]) == "short"


def test_fifo_runs_in_submission_order() -> None:
    models = [Progress("a", 2, 0, 99.0), Progress("b", 0, 5, 1.0), Progress("c", 1, 0, 50.0)]
    assert next_model(Policy.FIFO, models) == "b"


def test_round_robin_rotates_after_each_task() -> None:
    models = [Progress("a", 0, 1, 1.0, last_run=3), Progress("b", 1, 0, 1.0, last_run=-1)]
    assert next_model(Policy.ROUND_ROBIN, models) == "b"
    models = [Progress("a", 0, 1, 1.0, last_run=3), Progress("b", 1, 1, 1.0, last_run=4)]
    assert next_model(Policy.ROUND_ROBIN, models) == "a"


def test_ties_go_to_the_lowest_model_id() -> None:
    twins = [Progress("b", 0, 0, 5.0), Progress("a", 0, 0, 5.0)]
    assert {next_model(p, twins) for p in Policy} == {"a"}
    assert next_model(Policy.LRTF, []) is None
    assert priority(Policy.LRTF, twins[0]) > priority(Policy.LRTF, twins[1])


# ------------------------------------------------------------------------ the assignment


def _assign(
    idle: list[IdleDevice],
    plans: list[ModelPlan],
    residency: dict[str, Residence] | None = None,
    policy: Policy = Policy.LRTF,
    network_gbps: float = math.inf,
) -> tuple[Assignment, ...]:
    progresses = [progress(p, 0) for p in plans]
    by_id = {p.model: p for p in plans}
    return assign(policy, idle, progresses, by_id, residency or {}, network_gbps=network_gbps)


def test_a_shard_stays_on_the_device_that_holds_it() -> None:
    idle = [device("d0"), device("d1"), device("d2")]
    (a,) = _assign(idle, [plan("m")], {"m": Residence("d1", "n0")})
    assert (a.device, a.locality) == ("d1", Locality.RESIDENT)


def test_then_a_device_on_the_node_holding_it_then_any() -> None:
    idle = [device("d0", "n0"), device("d1", "n1"), device("d2", "n1")]
    (near,) = _assign(idle, [plan("m")], {"m": Residence(None, "n1")}, network_gbps=5.0)
    assert (near.device, near.locality) == ("d1", Locality.LOCAL)
    gone = {"m": Residence("dx", "n9")}
    (far,) = _assign(idle, [plan("m")], gone, network_gbps=5.0)
    assert (far.device, far.locality) == ("d0", Locality.REMOTE)


def test_a_much_faster_idle_device_beats_staying() -> None:
    idle = [device("slow", speed=0.25), device("fast", speed=3.0)]
    (a,) = _assign(idle, [plan("m")], {"m": Residence("slow", "n0")})
    assert a.device == "fast"


def test_a_late_model_waits_for_a_fast_device_soon_free_rather_than_start_on_a_slow_one() -> None:
    # plan("m")'s first task: 1 reference second; 4.1 s on the slow device (copy included),
    # 1.33 s once the fast one is free in 1 s; the rest of its chain: 5 s, 5/3 s on the fast.
    slow = device("slow", speed=0.25)
    soon = replace(device("fast", speed=3.0), free_in_s=1.0)
    m = [progress(plan("m"), 0)]
    plans = {"m": plan("m")}

    def run(
        offered: list[IdleDevice], horizon: float, more: tuple[Progress, ...] = ()
    ) -> tuple[Assignment, ...]:
        both = {**plans, **{p.model: plan(p.model) for p in more}}
        return assign(Policy.LRTF, offered, [*m, *more], both, {}, horizon_s=horizon)

    assert run([slow, soon], horizon=4.0) == ()  # 4.1 + 5/3 s would be late: it waits
    (a,) = run([slow, soon], horizon=10.0)
    assert a.device == "slow"  # it has the slack: the slow device works
    (a,) = run([slow, soon], horizon=math.inf)
    assert a.device == "slow"  # no horizon: never waits
    (a,) = run([slow, replace(soon, free_in_s=5.0)], horizon=4.0)
    assert a.device == "slow"  # late either way, and later there
    # Once m waits for it, the fast device is free 1/3 s later: the next model weighs that.
    # On a 0.7 device: m would end at 1.53 + 5/3 s, late for 3 s, so it waits (1.33 s); n
    # then ends at 1.67 s on the fast one but at 1.53 s here, so it starts here.
    slow = device("slow", speed=0.7)
    n = progress(plan("n"), 0)
    (b,) = run([slow, soon], horizon=3.0, more=(n,))
    assert (b.task.model, b.device) == ("n", "slow")


def test_models_in_policy_order_take_the_idle_devices() -> None:
    plans = [plan("a", steps=1, order=0), plan("b", steps=3, order=1), plan("c", steps=2, order=2)]
    lrtf = _assign([device("d0")], plans)
    fifo = _assign([device("d0")], plans, policy=Policy.FIFO)
    assert [a.task.model for a in lrtf] == ["b"] and [a.task.model for a in fifo] == ["a"]


def test_a_device_takes_only_what_fits_its_budget() -> None:
    big = plan("big", size=10 * GiB)
    small = plan("small", size=GiB)
    out = _assign([device("d0", budget=8 * GiB)], [big, small])
    assert [a.task.model for a in out] == ["small"]
    assert _assign([device("d0", budget=8 * GiB)], [big]) == ()


def test_one_task_per_model_and_per_device() -> None:
    plans = [plan(m) for m in "abcde"]
    out = _assign([device(f"d{i}") for i in range(3)], plans)
    assert len({a.task.model for a in out}) == len({a.device for a in out}) == 3
    twice = [progress(plans[0], 0), progress(plans[0], 0)]
    with pytest.raises(ValueError, match="at most one task in flight"):
        assign(Policy.LRTF, [device("d0")], twice, {"a": plans[0]}, {})


def test_a_finished_model_is_not_runnable() -> None:
    done = plan("m")
    with pytest.raises(ValueError, match="finished"):
        assign(Policy.LRTF, [device("d0")], [progress(done, done.tasks)], {"m": done}, {})


def test_assignment_is_deterministic_and_ties_go_to_the_lowest_device_id() -> None:
    idle = [device("d2"), device("d0"), device("d1")]
    first = _assign(idle, [plan("m"), plan("n")])
    assert first == _assign(list(reversed(idle)), [plan("n"), plan("m")])
    assert [a.device for a in first] == ["d0", "d1"]


def test_prefetch_names_the_devices_likeliest_next_task() -> None:
    long, short = plan("long", steps=3), plan("short", steps=1)
    (a,) = _assign([device("d0")], [long, short])
    assert a.task.model == "long" and a.prefetch == ShardTask("long", 1, Op.FORWARD, 0)
    rivals = [plan("a", steps=2), plan("b", steps=2), plan("c", steps=1)]
    out = _assign([device("d0"), device("d1")], rivals)
    assert [x.prefetch for x in out] == [
        ShardTask("a", 1, Op.FORWARD, 0),
        ShardTask("b", 1, Op.FORWARD, 0),
    ]


def test_round_robin_prefetches_the_waiting_model() -> None:
    (a,) = _assign([device("d0")], [plan("a"), plan("b")], policy=Policy.ROUND_ROBIN)
    assert (a.task.model, a.prefetch) == ("a", ShardTask("b", 0, Op.FORWARD, 0))


def test_lookahead_respects_memory_and_the_end_of_the_chain() -> None:
    last = plan("m", shards=1, steps=1, size=3 * GiB)
    big = plan("big", size=6 * GiB)
    small = device("d0", budget=8 * GiB)
    plans = {"m": last, "big": big}
    assert lookahead(Policy.LRTF, small, progress(last, 1), plans, [], stamp=0) is None
    waiting = [progress(big, 0)]
    assert lookahead(Policy.LRTF, small, progress(last, 0), plans, waiting, stamp=0) == (
        ShardTask("m", 0, Op.BACKWARD, 0)
    )
    roomy = device("d1", budget=16 * GiB)
    nxt = lookahead(Policy.LRTF, roomy, progress(last, 0), plans, waiting, stamp=0)
    assert nxt is not None and nxt.model == "big"


def test_transfer_estimates() -> None:
    d = device("d0")
    assert transfer_s(10 * 10**9, d, False, 2.0) == 1.0
    assert transfer_s(10 * 10**9, d, True, 2.0) == 5.0
    assert transfer_s(10, IdleDevice("x", "n", 1.0, 1), False, math.inf) == 0.0
