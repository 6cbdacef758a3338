"""Partitions: which devices hold which contiguous block range, and how many replicas.

The pipeline runs at the pace of its slowest stage: one mini-batch of ``m`` micro-batches
takes ``(m + p - 1) x max stage time`` on ``p`` stages (GPipe and 1F1B have the same bubble,
DESIGN.md). ``plan_partition`` chooses, for devices that differ in speed and memory
(HetPipe, PipeDream's planner), the ordered devices, the cut of the blocks into contiguous
stages, and a data-parallel replica count ``r`` that minimize that step time while every
stage fits its device's memory (``scheduler.memory``).

What is exact and what is a heuristic:

- For a *fixed order* of stage devices the cut is exact: bisection on the bottleneck time,
  each probe answered by a greedy that gives every stage the most blocks that fit (optimal
  because a later start never needs more time or memory), or, when that does not hold
  (rematerialization keeps the stage input, whose size depends on where a stage starts; or an
  exact stage count is asked for), by a dynamic programme over reachable cut positions.
  Bisection stops within a relative ``1e-9`` of the optimum.
- Small single-pipeline problems (few devices, few blocks) are solved exactly over every
  ordered choice of devices: a dynamic programme over (set of devices used, blocks covered).
- ``plan_partition`` on larger problems takes the greedy cut even where the later-start
  premise fails (rematerialization with stage inputs that grow along the chain): valid, fast,
  not proven optimal; it looks exactly only when the greedy finds nothing at all.
- Otherwise the device order is a heuristic. Devices are ranked fastest first (then largest
  memory): for a set of devices, the stage times depend on the order only through the
  block costs' unevenness (with equal blocks any order of the same devices is as good), so a
  pipeline of ``p`` stages takes the ``p`` fastest devices, and three orders of them are
  tried: fastest first, slowest first, and largest memory first (1F1B's early stages keep
  the most micro-batches in flight). The best of these is returned.
- Replicas: ``r`` copies of the pipeline share one cut; stage ``s`` of every replica runs on
  the ``s``-th group of ``r`` consecutive devices in the ranking, so replicas are as alike as
  the devices allow. The cut is made for each stage's slowest, smallest device of its group,
  and micro-batches are then shared between the replicas to equalize
  ``(m_g + p - 1) x bottleneck_g`` (a faster replica takes more), exactly for that cut.
  Gradient all-reduce time is modelled only when ``sync_s_per_byte`` is given.
- Framework overhead: ``Workload.stage_overhead_s`` is added to every stage's time per
  micro-batch. A constant on every stage leaves each cut's optimum where it was, so the cut
  searches ignore it and only the choice of stage and replica counts sees it (more stages
  pay it more often in the bubble).
- Not modelled: activation transfer sizes between stages, and the extra forward of recompute
  (measure ``fwd_bwd_s`` with the job's recompute setting so it is in the costs).
- Search: (replicas, stages) pairs are tried in order of a lower bound on their step time
  and the search stops once no bound can beat the best plan found.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from shoal.scheduler.cut import Model, Slot, Stops, cut
from shoal.scheduler.memory import format_bytes
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.shares import flight_limit, uneven_refusal, workload_shares
from shoal.scheduler.types import BlockRange, DeviceId
from shoal.scheduler.workload import DeviceCapacity, Workload

_EXACT_WORK = 300_000
"""Largest exhaustive search (devices subsets x blocks^2 x devices^2) worth its time."""

_FALLBACK_WORK = 3_000_000
"""Largest exhaustive search worth running before refusing a job: the three device orders
of the heuristic can all miss a memory-feasible order (devices of different sizes whose
right order is none of fastest-, slowest- or largest-first)."""

_SCHEDULES = ("gpipe", "1f1b")


class PartitionError(ValueError):
    """No partition meets the request; the message names the constraint and how to fix it."""


@dataclass(frozen=True)
class StageAssignment:
    """One pipeline stage: its blocks, and its device in each replica (in replica order)."""

    device_ids: tuple[DeviceId, ...]
    blocks: BlockRange


@dataclass(frozen=True)
class PartitionPlan:
    """Stages (same cut in every replica), replicas, each replica's share of the micro-batches
    (summing to the mini-batch's), the predicted step seconds and why this plan."""

    stages: tuple[StageAssignment, ...]
    replicas: int
    micro_batches: tuple[int, ...]
    predicted_step_s: float
    bottleneck_s: tuple[float, ...]
    reason: str

    @property
    def device_ids(self) -> tuple[DeviceId, ...]:
        """Every device the plan uses, stage by stage."""
        return tuple(d for stage in self.stages for d in stage.device_ids)

    def replica(self, index: int) -> tuple[tuple[DeviceId, BlockRange], ...]:
        """Replica ``index`` as (device, blocks) per stage: what one pipeline runs."""
        return tuple((stage.device_ids[index], stage.blocks) for stage in self.stages)


# ------------------------------------------------------------------- the plan of a cut


def _assemble(
    model: Model,
    slots: Sequence[Slot],
    stops: Stops,
    sync_s_per_byte: float,
    reason: str,
    shares: Sequence[int] | None = None,
    beat: float = math.inf,
) -> PartitionPlan | None:
    """The plan of a cut: per-replica bottlenecks on the real device speeds, the micro-batch
    shares, and the predicted step time; None when it cannot be faster than ``beat``."""
    used: list[tuple[Slot, BlockRange]] = []
    start = 0
    for slot, stop in zip(slots, stops, strict=True):
        if stop > start:
            used.append((slot, (start, stop)))
        start = stop
    p, r = len(used), len(used[0][0].devices)
    overhead = model.workload.stage_overhead_s  # the same on every stage: no cut changes
    times = [
        max(model.stage_time(b, s.devices[g].speed) for s, b in used) + overhead for g in range(r)
    ]
    if shares is None:
        rate = sum(1 / t for t in times if t > 0)
        m = model.workload.micro_batches
        if rate and max((m + r * (p - 1)) / rate, p * max(times)) >= beat * (1 - 1e-9):
            return None  # the continuous relaxation of the shares is already too slow
        limits = [
            min(
                flight_limit(model, b, s.devices[g].memory_bytes, p, k)
                for k, (s, b) in enumerate(used)
            )
            for g in range(r)
        ]
        shares = workload_shares(model.workload, times, limits, p)
        if shares is None:
            return None
    sync = 0.0
    if r > 1 and sync_s_per_byte > 0:  # ring all-reduce of each stage's gradients, in parallel
        grads = max(sum(c.param_bytes for c in model.costs[b[0] : b[1]]) for _, b in used)
        sync = sync_s_per_byte * 2 * (r - 1) / r * grads
    step = max((m + p - 1) * t for m, t in zip(shares, times, strict=True)) + sync
    stages = tuple(StageAssignment(tuple(d.device_id for d in s.devices), b) for s, b in used)
    return PartitionPlan(stages, r, tuple(shares), step, tuple(times), reason)


def _whole(plan: PartitionPlan | None) -> PartitionPlan:
    """``_assemble``'s plan when no ``beat`` was given (it is then never None)."""
    if plan is None:
        raise RuntimeError("a plan assembled without a bound to beat came back empty")
    return plan


def _better(a: PartitionPlan, b: PartitionPlan | None) -> bool:
    """Faster wins; at equal speed, fewer devices, then fewer stages (leave devices free)."""
    if b is None:
        return True
    if not math.isclose(a.predicted_step_s, b.predicted_step_s, rel_tol=1e-9, abs_tol=1e-15):
        return a.predicted_step_s < b.predicted_step_s
    return (len(a.device_ids), len(a.stages)) < (len(b.device_ids), len(b.stages))


# -------------------------------------------------------------- exhaustive (small) search


def _exhaustive(
    model: Model, devices: Sequence[DeviceCapacity], stage_counts: Iterable[int]
) -> PartitionPlan | None:
    """The best single pipeline over every ordered choice of devices: for each stage count
    p, a dynamic programme over (set of devices used, blocks covered) -> smallest bottleneck.
    Exact; O(2^D x D x n^2) per p."""
    n, count, m = model.n, len(devices), model.workload.micro_batches
    best_plan: PartitionPlan | None = None
    for p in stage_counts:
        best: dict[tuple[int, int], tuple[float, tuple[int, int, int]]] = {
            (0, 0): (0.0, (0, 0, -1))
        }
        for used in range(1 << count):
            s = used.bit_count()
            if s >= p:
                continue
            flight = model.in_flight(p, s, m)
            for start in range(n):
                entry = best.get((used, start))
                if entry is None:
                    continue
                for d, device in enumerate(devices):
                    if used >> d & 1:
                        continue
                    slot = Slot.of([device])
                    first = n if s == p - 1 else start + 1
                    last = min(model.max_stop(start, slot, flight, math.inf), n - (p - s - 1))
                    for stop in range(first, last + 1):
                        value = max(entry[0], model.stage_time((start, stop), device.speed))
                        key = (used | 1 << d, stop)
                        if key not in best or value < best[key][0]:
                            best[key] = (value, (used, start, d))
        finals = [(v[0], k) for k, v in best.items() if k[1] == n and k[0].bit_count() == p]
        if not finals:
            continue
        _, key = min(finals)
        order: list[tuple[int, int]] = []
        while key != (0, 0):
            _, (used, start, d) = best[key]
            order.append((d, key[1]))
            key = (used, start)
        order.reverse()
        slots = [Slot.of([devices[d]]) for d, _ in order]
        plan = _assemble(model, slots, [stop for _, stop in order], 0.0, "exact search")
        if plan is not None and _better(plan, best_plan):
            best_plan = plan
    return best_plan


# ------------------------------------------------------------------------------ the API


def _check(costs: Sequence[BlockCost], devices: Sequence[DeviceCapacity], w: Workload) -> None:
    if not costs:
        raise PartitionError("the model has no blocks; a partition needs at least one")
    wrong = next((i for i, c in enumerate(costs) if c.index != i), None)
    if wrong is not None:
        raise PartitionError(
            f"block costs must be listed by index 0..{len(costs) - 1}; position {wrong} holds"
            f" block {costs[wrong].index}"
        )
    if not devices:
        raise PartitionError("no devices to partition over; wait for devices or add some")
    ids = [d.device_id for d in devices]
    if len(set(ids)) != len(ids):
        raise PartitionError(f"device ids must be unique, got {sorted(ids)}")
    bad = next((d for d in devices if not (math.isfinite(d.speed) and d.speed > 0)), None)
    if bad is not None:
        raise PartitionError(f"device {bad.device_id} has speed {bad.speed}; measure it again")
    if w.schedule not in _SCHEDULES:
        raise PartitionError(f"unknown schedule {w.schedule!r}; choose one of {list(_SCHEDULES)}")
    if w.micro_batches < 1 or w.micro_batch_size < 1:
        raise PartitionError(
            f"micro_batches ({w.micro_batches}) and micro_batch_size ({w.micro_batch_size})"
            " must both be >= 1"
        )


def _memory_refusal(model: Model, devices: Sequence[DeviceCapacity], stages: str) -> str:
    largest = max(d.memory_bytes for d in devices)
    single = [model.memory(i, i + 1, 1) for i in range(model.n)]
    worst = max(range(model.n), key=lambda i: single[i])
    if single[worst] > largest:
        return (
            f"no partition into {stages} fits device memory: block {worst} alone needs"
            f" {format_bytes(single[worst])} with one micro-batch in flight but the largest"
            f" device has {format_bytes(largest)}; use more micro_batches (smaller"
            " micro-batches), recompute, or a smaller model"
        )
    need = model.memory(0, model.n, 1)
    room = sum(d.memory_bytes for d in devices)
    return (
        f"no partition into {stages} fits device memory: the model needs at least"
        f" {format_bytes(need)} and the {len(devices)} device(s) hold {format_bytes(room)}"
        " together; allow more devices, use recompute or more micro_batches, or a smaller model"
    )


def _orders(slots: list[Slot]) -> list[list[Slot]]:
    """Fastest first, slowest first, largest memory first; duplicates dropped."""
    candidates = [slots, slots[::-1], sorted(slots, key=lambda s: -s.memory)]
    seen: set[tuple[tuple[float, int], ...]] = set()
    unique = []
    for order in candidates:
        key = tuple((s.speed, s.memory) for s in order)
        if key not in seen:
            seen.add(key)
            unique.append(order)
    return unique


def _lower_bounds(
    model: Model, ranked: Sequence[DeviceCapacity], pairs: Iterable[tuple[int, int]]
) -> dict[tuple[int, int], float]:
    """Per (replicas r, stages p), a bound below any step of p stages x r replicas on the
    r x p fastest devices: all work over their total speed, with each replica's bubble."""
    m, heaviest = model.workload.micro_batches, max(c.fwd_bwd_s for c in model.costs)
    speed = [0.0, *accumulate(d.speed for d in ranked)]
    return {
        (r, p): max(
            model.time[-1] * (m + r * (p - 1)) / speed[r * p], p * heaviest / ranked[0].speed
        )
        for r, p in pairs
    }


def plan_partition(
    costs: Sequence[BlockCost],
    devices: Sequence[DeviceCapacity],
    workload: Workload,
    *,
    stages: int | None = None,
    replicas: int | None = None,
    sync_s_per_byte: float = 0.0,
) -> PartitionPlan:
    """The fastest plan of ``costs`` on (a subset of) ``devices``: see the module docstring
    for what is exact. ``stages`` / ``replicas`` None choose them; a number is honoured or
    refused with ``PartitionError`` naming the constraint (blocks, devices, micro-batches,
    memory)."""
    _check(costs, devices, workload)
    model, n, count, m = Model(costs, workload), len(costs), len(devices), workload.micro_batches
    if stages is not None and not 1 <= stages <= n:
        raise PartitionError(
            f"cannot cut {n} blocks into {stages} non-empty stages; use 1 to {n} stages"
        )
    if replicas is not None and not 1 <= replicas <= m:
        raise PartitionError(
            f"{replicas} replicas need at least {replicas} micro-batches (one each) but the"
            f" mini-batch has {m}; raise micro_batches or use 1 to {m} replicas"
        )
    lockstep = workload.shard == "full"  # ZeRO-3: every replica the same micro-batches
    if lockstep and replicas is not None and m % replicas:
        raise PartitionError(uneven_refusal(replicas, m))
    wanted = (stages or 1) * (replicas or 1)
    if wanted > count:
        raise PartitionError(
            f"{stages or 1} stages x {replicas or 1} replicas need {wanted} devices but"
            f" {count} are available; allow more devices or ask for fewer"
        )
    ranked = sorted(devices, key=lambda d: (-d.speed, -d.memory_bytes, d.device_id))
    pairs = [
        (r, p)
        for r in ([replicas] if replicas else range(1, min(count, m) + 1))
        for p in ([stages] if stages else range(1, min(n, count // r) + 1))
        if r * p <= count and not (lockstep and m % r)
    ]
    best: PartitionPlan | None = None
    exact = (replicas in (None, 1)) and (1 << count) * count**2 * n * n <= _EXACT_WORK
    if exact:
        best = _exhaustive(model, ranked, [stages] if stages else range(1, min(n, count) + 1))
        pairs = [(r, p) for r, p in pairs if r > 1]
    best = _heuristic(model, ranked, pairs, best, stages, sync_s_per_byte, exact_cut=False)
    if best is None and workload.recompute:  # the greedy cut may miss one: look exactly
        best = _heuristic(model, ranked, pairs, best, stages, sync_s_per_byte, exact_cut=True)
    if (
        best is None
        and not exact
        and replicas in (None, 1)
        and ((1 << count) * count**2 * n * n <= _FALLBACK_WORK)
    ):  # before refusing, try every device order where that is affordable
        best = _exhaustive(model, ranked, [stages] if stages else range(1, min(n, count) + 1))
    if best is None:
        what = f"{stages} stages" if stages else "any number of stages"
        raise PartitionError(_memory_refusal(model, devices, what))
    return _explained(best, count, workload)


def _heuristic(
    model: Model,
    ranked: Sequence[DeviceCapacity],
    pairs: Sequence[tuple[int, int]],
    best: PartitionPlan | None,
    stages: int | None,
    sync_s_per_byte: float,
    *,
    exact_cut: bool,
) -> PartitionPlan | None:
    """The best plan over (replicas, stages) pairs, most promising first, and the three
    device orders; ``exact_cut`` False takes the greedy cut even where it is not proven
    optimal (rematerialization with growing stage inputs), which is much faster."""
    m = model.workload.micro_batches
    bounds = _lower_bounds(model, ranked, pairs)
    for r, p in sorted(pairs, key=bounds.__getitem__):
        beat = math.inf if best is None else best.predicted_step_s
        if bounds[(r, p)] >= beat * (1 - 1e-9):
            break  # sorted by the bound: nothing left can be faster
        slots = [Slot.of(ranked[q * r : (q + 1) * r]) for q in range(p)]
        # A cut can beat the best plan only if its slowest stage, on the slowest device of
        # each group (spread <= kappa), is below this: the busiest replica runs ceil(m/r).
        kappa = max(max(d.speed for d in s.devices) / s.speed for s in slots)
        within = beat * kappa / (math.ceil(m / r) + p - 1) * (1 + 1e-9)
        cap = math.ceil(m / r)
        tag = "heuristic order" if exact_cut or model.monotone(cap) else "greedy cut"
        held = model.for_replicas(r)  # sharded replicas each keep a share of the state
        for order in _orders(slots):
            found = cut(
                held,
                order,
                cap,
                exact_count=stages is not None,
                within=within,
                exact=exact_cut,
            )
            if found is not None:
                plan = _assemble(held, order, found[0], sync_s_per_byte, tag, beat=beat)
                if plan is not None and _better(plan, best):
                    best = plan
    return best


def _explained(plan: PartitionPlan, available: int, workload: Workload) -> PartitionPlan:
    p, r = len(plan.stages), plan.replicas
    bubble = max((p - 1) / (m + p - 1) for m in plan.micro_batches)
    how = {
        "exact search": "exact over every device order",
        "fixed order": "exact cut for this device order",
        "greedy cut": "greedy cut (stage inputs grow along the chain under recompute) for the"
        " best of the fastest-first, slowest-first and memory-first orders",
    }.get(
        plan.reason,
        "exact cut for the best of the fastest-first, slowest-first and memory-first orders",
    )
    reason = (
        f"{p} stage(s) x {r} replica(s) on {len(plan.device_ids)} of {available} device(s),"
        f" {workload.schedule}, micro-batches per replica {list(plan.micro_batches)}: slowest"
        f" stage {max(plan.bottleneck_s):.4g} s per micro-batch, step {plan.predicted_step_s:.4g}"
        f" s, bubble {bubble:.0%}; {how}"
    )
    return PartitionPlan(
        plan.stages,
        plan.replicas,
        plan.micro_batches,
        plan.predicted_step_s,
        plan.bottleneck_s,
        reason,
    )


def order_partition(
    costs: Sequence[BlockCost],
    stage_devices: Sequence[Sequence[DeviceCapacity]],
    workload: Workload,
    *,
    sync_s_per_byte: float = 0.0,
) -> PartitionPlan:
    """The best cut with exactly these devices in this order (``stage_devices[s]``: stage
    s's device in each replica): exact; what a repartition between running workers uses."""
    flat = [d for group in stage_devices for d in group]
    _check(costs, flat, workload)
    widths = {len(group) for group in stage_devices}
    if len(widths) != 1:
        raise PartitionError(
            f"every stage needs one device per replica; got groups of sizes {sorted(widths)}"
        )
    r = widths.pop()
    model, p = Model(costs, workload, r), len(stage_devices)
    if p > model.n:
        raise PartitionError(
            f"cannot cut {model.n} blocks into {p} non-empty stages; use at most {model.n}"
        )
    if r > workload.micro_batches:
        raise PartitionError(
            f"{r} replicas need at least {r} micro-batches but the mini-batch has"
            f" {workload.micro_batches}; raise micro_batches or use fewer replicas"
        )
    if workload.shard == "full" and workload.micro_batches % r:
        raise PartitionError(uneven_refusal(r, workload.micro_batches))
    slots = [Slot.of(group) for group in stage_devices]
    found = cut(model, slots, math.ceil(workload.micro_batches / r), exact_count=True)
    if found is None:
        raise PartitionError(_memory_refusal(model, flat, f"{p} stages on these devices"))
    plan = _whole(_assemble(model, slots, found[0], sync_s_per_byte, "fixed order"))
    return _explained(plan, len(flat), workload)


def evaluate(
    plan: PartitionPlan,
    costs: Sequence[BlockCost],
    devices: Sequence[DeviceCapacity],
    workload: Workload,
    *,
    sync_s_per_byte: float = 0.0,
) -> float:
    """The predicted step seconds of ``plan`` with the devices' current speeds."""
    by_id = {d.device_id: d for d in devices}
    missing = sorted(set(plan.device_ids) - set(by_id))
    if missing:
        raise PartitionError(f"the plan uses devices {missing} that are not given; re-plan")
    model = Model(costs, workload, plan.replicas)
    slots = [Slot.of([by_id[d] for d in stage.device_ids]) for stage in plan.stages]
    stops = [stage.blocks[1] for stage in plan.stages]
    shares = plan.micro_batches
    return _whole(_assemble(model, slots, stops, sync_s_per_byte, "", shares)).predicted_step_s
