"""SHARP decisions: shards that fit half a device, the task chain, the ordering policies, and
the assignment of tasks to idle devices (locality, memory, prefetch)."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.memory import stage_memory
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.sharp import (
    Assignment,
    IdleDevice,
    ModelPlan,
    Op,
    Policy,
    Progress,
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
from shoal.scheduler.sharp_homes import (
    Faster,
    Home,
    Sharing,
    hand_over_now,
    home_shards,
    move_target,
    moved_end_s,
    trade_pays,
    trade_target,
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


def device(name: str, speed: float = 1.0, budget: int = 16 * GiB) -> IdleDevice:
    return IdleDevice(name, speed, budget, bandwidth_gbps=10.0)


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
    dev: IdleDevice, plans: list[ModelPlan], policy: Policy = Policy.LRTF
) -> Assignment | None:
    return assign(policy, dev, [progress(p, 0) for p in plans], {p.model: p for p in plans})


def test_the_policys_first_model_runs_next() -> None:
    plans = [plan("a", steps=1, order=0), plan("b", steps=3, order=1), plan("c", steps=2, order=2)]
    lrtf = _assign(device("d0"), plans)
    fifo = _assign(device("d0"), plans, policy=Policy.FIFO)
    assert lrtf is not None and lrtf.task == ShardTask("b", 0, Op.FORWARD, 0)
    assert fifo is not None and (fifo.device, fifo.task.model) == ("d0", "a")


def test_a_device_takes_only_what_fits_its_budget() -> None:
    big = plan("big", size=10 * GiB, steps=3)
    small = plan("small", size=GiB)
    out = _assign(device("d0", budget=8 * GiB), [big, small])
    assert out is not None and out.task.model == "small"
    assert _assign(device("d0", budget=8 * GiB), [big]) is None


def test_a_model_is_runnable_once_and_until_its_last_task() -> None:
    m = plan("m")
    twice = [progress(m, 0), progress(m, 0)]
    with pytest.raises(ValueError, match="listed twice"):
        assign(Policy.LRTF, device("d0"), twice, {"m": m})
    with pytest.raises(ValueError, match="finished"):
        assign(Policy.LRTF, device("d0"), [progress(m, m.tasks)], {"m": m})


def test_prefetch_names_the_devices_likeliest_next_task() -> None:
    long, short = plan("long", steps=3), plan("short", steps=1)
    a = _assign(device("d0"), [long, short])
    assert a is not None and a.task.model == "long"
    assert a.prefetch == ShardTask("long", 1, Op.FORWARD, 0)


def test_round_robin_prefetches_the_waiting_model() -> None:
    a = _assign(device("d0"), [plan("a"), plan("b")], policy=Policy.ROUND_ROBIN)
    assert a is not None and (a.task.model, a.prefetch) == ("a", ShardTask("b", 0, Op.FORWARD, 0))


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
    assert transfer_s(10 * 10**9, device("d0")) == 1.0  # 10 GB/s
    assert transfer_s(10, IdleDevice("x", 1.0, 1)) == 0.0  # no bandwidth given: free


# ------------------------------------------------------------------------ homes


def test_a_models_shards_live_together_where_its_work_ends_soonest() -> None:
    shards = [shard(0), shard(1)]  # 3 s a step each
    busy = Home("busy", speed=1.0, load_s=10.0)
    idle = Home("idle", speed=1.0)
    assert home_shards(shards, 2, [busy, idle]) == ["idle", "idle"]
    fast = Home("fast", speed=4.0, load_s=10.0)  # (10 + 12) / 4 < 12
    assert home_shards(shards, 2, [idle, fast]) == ["fast", "fast"]
    assert home_shards(shards, 2, [Home("b"), Home("a")]) == ["a", "a"]  # ties: lowest id


def test_spread_models_take_the_fastest_empty_device_first() -> None:
    shards = [shard(0), shard(1)]
    fast = Home("fast", speed=4.0, load_s=1.0)  # (1 + 6) / 4 is sooner than 6 on "slow"
    slow = Home("slow", speed=1.0)
    slower = Home("slower", speed=0.5)
    assert home_shards(shards, 1, [fast, slow]) == ["fast", "fast"]
    assert home_shards(shards, 1, [fast, slower, slow], spread=True) == ["slow", "slow"]
    busy = Home("slow", speed=1.0, load_s=1.0)
    assert home_shards(shards, 1, [fast, busy], spread=True) == ["fast", "fast"]  # none empty


def test_a_model_trades_up_to_the_fastest_device_whose_model_has_enough_less_to_go() -> None:
    h100, a100 = Faster("h100", 3.0, 50.0), Faster("a100", 1.5, 10.0)
    assert trade_target(100.0, 0.6, [a100, h100]) == h100  # the fastest first
    assert trade_target(100.0, 0.6, [a100, h100], margin=0.6) == a100  # 50 + 60 >= 100
    assert trade_target(100.0, 0.6, [a100, h100], margin=0.95) is None
    assert trade_target(100.0, 3.0, [a100, h100]) is None  # none faster than home
    # As fast: a device holding no model first, then the least to go, then the first given.
    empty, least, other = Faster("e", 3.0, None), Faster("l", 3.0, 5.0), Faster("o", 3.0, 5.0)
    assert trade_target(100.0, 0.6, [least, empty]) == empty
    assert trade_target(100.0, 0.6, [h100, other, least]) == other
    assert trade_target(0.0, 0.6, [empty]) == empty  # an empty device takes any model
    assert trade_target(0.0, 0.6, [least]) is None


def test_a_device_shared_ends_a_model_as_its_time_is_shared() -> None:
    # 10 s to go beside models with 2 and 30 s: all three share the device for 6 s (2 each),
    # then two share it until this one's 8 s left are done: 6 + 16 = 22 = 10 + 2 + 10.
    assert Sharing(1.0, (2.0, 30.0)).end_s(10.0) == 22.0
    assert Sharing(2.0, (2.0, 30.0)).end_s(10.0) == 11.0
    assert Sharing(1.0).end_s(10.0) == 10.0


def test_a_trade_is_made_only_where_it_pays_for_the_moves() -> None:
    slow, fast = Sharing(0.5), Sharing(1.0)
    # Alone on a half-speed device: 10 s to go ends in 20 s, on the empty one in 10 + move.
    assert trade_pays(10.0, slow, fast, 9.9)
    assert not trade_pays(10.0, slow, fast, 10.0)
    assert not trade_pays(1.0, slow, fast, 1.5)  # near its end: the move costs more
    # Beside a model with 0.5 s to go on a device as fast: moving gains only those 0.5 s.
    assert trade_pays(10.0, Sharing(1.0, (0.5,)), fast, 0.4)
    assert not trade_pays(10.0, Sharing(1.0, (0.5,)), fast, 0.6)
    # A trade with a model with 2 s to go there: the later end now is this model's 20 s;
    # traded, max(10 + move, 4 + the other's move).
    assert trade_pays(10.0, slow, fast, 1.0, (2.0, 1.0))
    assert not trade_pays(10.0, slow, fast, 1.0, (2.0, 16.0))  # the other's end: 20
    assert not trade_pays(10.0, slow, fast, 10.0, (2.0, 0.0))
    # Moves cost nothing: it pays while this model has more to go than the other.
    assert trade_pays(2.9, slow, fast, 0.0, (2.0, 0.0))
    assert not trade_pays(2.0, slow, fast, 0.0, (2.0, 0.0))


def test_a_trade_hands_the_device_over_when_that_loses_least_work() -> None:
    # The taker's input is there in 4 s; this model's queued work ends in 1 s; one more
    # task takes 1 s. Now: this device (speed 3) idles 3 s, 9 s of work; one more task:
    # the taker's device (speed 1) idles 0 s (the task ends before the taker's input).
    assert not hand_over_now(4.0, 1.0, 1.0, 3.0, 1.0)
    # Ends in 3.8 s and one more would take 3 s: now 0.2 x 3 = 0.6 against 2.8 x 1.
    assert hand_over_now(4.0, 3.8, 3.0, 3.0, 1.0)
    # The taker's input comes first: now, its device idles 2 s for this model's input (2
    # s of work); later it would idle 3 s.
    assert hand_over_now(1.0, 3.0, 1.0, 3.0, 1.0)
    assert hand_over_now(2.0, 2.0, 0.0, 3.0, 1.0)  # no idle either way: a tie hands over


def test_a_model_lives_only_where_its_largest_shard_fits() -> None:
    shards = [shard(0, size=GiB), shard(1, size=4 * GiB)]
    small, large = Home("small", budget_bytes=2 * GiB), Home("large", load_s=99.0)
    assert home_shards(shards, 1, [small, large]) == ["large", "large"]
    with pytest.raises(ShardError, match=r"largest device has 2\.0 GiB"):
        home_shards(shards, 1, [small])


def test_a_model_moves_where_both_devices_then_end_sooner() -> None:
    # Home: 10 s to go (this model's 4 among them) at speed 1; an idle device of speed 1.
    assert moved_end_s(4.0, (10.0, 1.0), (0.0, 1.0), 0.0) == (10.0, 6.0)
    assert moved_end_s(4.0, (10.0, 1.0), (0.0, 1.0), 7.0) == (10.0, 11.0)  # the copy is long
    # Alone at home: only a faster device pays, and moving back never does.
    assert moved_end_s(4.0, (4.0, 1.0), (0.0, 1.0), 0.0) == (4.0, 4.0)
    assert moved_end_s(4.0, (4.0, 1.0), (0.0, 4.0), 0.0) == (4.0, 1.0)
    ends, back = moved_end_s(4.0, (4.0, 4.0), (0.0, 1.0), 0.0)
    assert back > ends


def test_a_model_moves_to_the_device_where_that_ends_soonest_or_stays() -> None:
    """``move_target``, the rule the executor and the simulator share."""
    home = (5.0, 1.0)  # 5 s to go at speed 1, this model's 4 among them
    # Moved, the later end: an idle slow device 8 s, an idle fast one 2 s, a busy fast 5 s.
    others = {"slow": (0.0, 0.5, 0.0), "fast": (0.0, 2.0, 0.0), "busy": (6.0, 2.0, 0.0)}
    assert move_target(4.0, home, others) == "fast"
    assert move_target(4.0, home, {k: others[k] for k in ("slow", "busy")}) is None
    assert move_target(4.0, home, {"fast": (0.0, 2.0, 9.0)}) is None  # the copy is too long
    # Sooner on either of two alike devices (both then end at 6 s, the home's other work):
    # the first name.
    assert move_target(4.0, (10.0, 1.0), {2: (0.0, 1.0, 0.0), 1: (0.0, 1.0, 0.0)}) == 1
