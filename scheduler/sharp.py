"""Shard alternator parallelism (SHARP): shards, shard tasks, their order and their devices.

Hydra (Nagrecha & Kumar, "Hydra: A System for Large Multi-Model Deep Learning") trains many
models at once on a few devices: each model is cut into *shards* that fit one device, the
inactive shards wait in host memory, and every device runs whichever runnable shard task
comes next, whatever its model, while the shard it will most likely run next is copied in
(double buffering: a shard may use half a device, the prefetched one the other half). One
model's step is a sequential chain, forward shards 0..k-1 then backward k-1..0 (backward
recomputes the shard's activations from its saved input, as GPipe's rematerialization does),
so a model has at most one task in flight; the parallelism is across models. The order is
Hydra's Sharded-LRTF (longest remaining time first), with FIFO and round-robin to compare.

Everything here is a pure function of plain data; the shard pool carries the decisions out
and ``scheduler.simulate`` runs the same code on a modelled cluster.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import TypeAlias

from shoal.scheduler.cut import Model, Slot, cut
from shoal.scheduler.memory import format_bytes, stage_memory
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.types import BlockRange, DeviceId
from shoal.scheduler.workload import DeviceCapacity, Workload

ModelId: TypeAlias = str
"""A model trained under SHARP (a sweep's trial): unique among the models sharing devices."""

Priority: TypeAlias = tuple[float, float, ModelId]
"""A policy's sort key for a runnable model: the smallest goes first; the id breaks ties."""

FORWARD_FRACTION = 1 / 3
"""A forward is ~1/3 of forward+backward: the backward computes gradients of both the inputs
and the weights, ~2x the forward's FLOPs (2N vs 4N FLOPs per token, Kaplan et al., 2020)."""

RATIO_WEIGHT = 0.3
"""Weight of the newest measurement in a model's moving average of measured / estimated."""


class ShardError(ValueError):
    """A model cannot be cut into SHARP shards; the message names the block and the fix."""


@dataclass(frozen=True)
class Shard:
    """Blocks ``[start, stop)`` of a model: reference seconds of its forward and backward
    tasks, the bytes of its state (parameters, gradients, optimizer state: what a promotion
    copies in) and of what its task allocates on the device besides (activations, autocast's
    weight copies, backward temporaries: ``scheduler.memory``), not copied; of both, what its
    micro-batches keep from its forward to its backward and what only a task holds as it
    runs (gradients, temporaries, what a backward recomputes)."""

    index: int
    blocks: BlockRange
    forward_s: float
    backward_s: float
    state_bytes: int
    activation_bytes: int
    kept_bytes: int = 0
    work_bytes: int = 0

    @property
    def bytes(self) -> int:
        """What the shard occupies on a device while it runs."""
        return self.state_bytes + self.activation_bytes


def shard_model(
    costs: Sequence[BlockCost],
    budget_bytes: int,
    micro_batch_size: int,
    *,
    micro_batches: int = 1,
    recompute: bool = True,
    precision: str = "fp32",
    forward_fraction: float = FORWARD_FRACTION,
) -> tuple[Shard, ...]:
    """The fewest contiguous shards whose state and activations each fit half of
    ``budget_bytes`` (the smallest device the model may run on), balanced by compute.

    The other half of a device holds the prefetched next shard (Hydra's double buffering).
    The count is a jump game over the furthest stop each start can reach (exact); among
    cuts into that many shards, the slowest shard is minimized (``scheduler.cut``, exact),
    then the shards are made as alike as that allows (``_even_out``, exact). A shard's
    forward is ``forward_fraction`` of its blocks' forward+backward seconds; its backward
    is the rest plus, under ``recompute``, the forward again (GPipe's rematerialization:
    only the shard's input is kept between its forward and its backward). A shard task runs
    all ``micro_batches`` of a mini-batch, so its memory holds what each of them keeps."""
    if not costs:
        raise ShardError("the model has no blocks; SHARP needs at least one")
    wrong = next((i for i, c in enumerate(costs) if c.index != i), None)
    if wrong is not None:
        raise ShardError(
            f"block costs must be listed by index; position {wrong} holds"
            f" block {costs[wrong].index}"
        )
    if (
        budget_bytes < 2
        or micro_batch_size < 1
        or micro_batches < 1
        or not 0 < forward_fraction < 1
    ):
        raise ShardError(
            f"budget_bytes ({budget_bytes}) must be >= 2, micro_batch_size ({micro_batch_size})"
            f" and micro_batches ({micro_batches}) >= 1 and forward_fraction"
            f" ({forward_fraction}) between 0 and 1"
        )
    half = budget_bytes // 2
    workload = Workload(
        micro_batches, micro_batch_size, schedule="gpipe", recompute=recompute, precision=precision
    )
    model = Model(costs, workload)
    count = _fewest_shards(model, half, budget_bytes)
    slots = [Slot.of([DeviceCapacity(f"shard-{i}", 1.0, half)]) for i in range(count)]
    found = cut(model, slots, micro_batches, exact_count=True)
    if found is None:  # the jump game proved `count` shards fit
        raise RuntimeError(f"no cut into {count} shards although one exists")
    stops = _even_out(model, count, half, found[1]) or found[0]
    return tuple(
        _shard(costs, i, (start, stop), workload, forward_fraction)
        for i, (start, stop) in enumerate(zip([0, *stops], stops, strict=False))
    )


def _shard(
    costs: Sequence[BlockCost],
    index: int,
    blocks: BlockRange,
    workload: Workload,
    forward_fraction: float,
) -> Shard:
    recompute = workload.recompute
    memory = partial(
        stage_memory,
        costs,
        blocks,
        micro_batch_size=workload.micro_batch_size,
        recompute=recompute,
        precision=workload.precision,
    )
    need, bare = memory(in_flight=workload.micro_batches), memory(in_flight=0)
    kept = need.total - bare.total
    seconds = sum(c.fwd_bwd_s for c in costs[blocks[0] : blocks[1]])
    forward = forward_fraction * seconds
    backward = seconds - forward + (forward if recompute else 0.0)
    state = need.params + need.grads + need.optimizer
    work = bare.total - bare.params - bare.optimizer  # with no micro-batch's keeps
    return Shard(index, blocks, forward, backward, state, need.total - state, kept, work)


def _even_out(model: Model, count: int, half: int, slowest: float) -> list[int] | None:
    """The stops of the ``count``-shard cut, none slower than ``slowest``, with the least
    sum of squared shard times: among the cuts whose slowest shard is optimal, the one whose
    shards are most alike (so every shard's compute can hide the next one's copy-in). A
    dynamic programme over (shards, stop), O(count x blocks x blocks per shard)."""
    n, time, flight = model.n, model.time, model.workload.micro_batches
    limit = slowest * (1 + 1e-9) + 1e-12
    cost = [[math.inf] * (n + 1) for _ in range(count + 1)]
    back = [[0] * (n + 1) for _ in range(count + 1)]
    cost[0][0] = 0.0
    for j in range(1, count + 1):
        # The last shard must end at the last block: no other stop of it is ever read.
        for stop in range(j, n - (count - j) + 1) if j < count else (n,):
            start = stop - 1
            while start >= j - 1 and time[stop] - time[start] <= limit:
                previous = cost[j - 1][start]
                if previous < math.inf and model.memory(start, stop, flight) <= half:
                    value = previous + (time[stop] - time[start]) ** 2
                    if value < cost[j][stop]:
                        cost[j][stop], back[j][stop] = value, start
                start -= 1
    if cost[count][n] == math.inf:  # only float rounding can get here: keep the cut
        return None
    stops, stop = [], n
    for j in range(count, 0, -1):
        stops.append(stop)
        stop = back[j][stop]
    return stops[::-1]


def _fewest_shards(model: Model, half: int, budget: int) -> int:
    """Shards in the shortest cover of the blocks, each start reaching its furthest stop
    within ``half`` (a breadth-first jump game, O(blocks log blocks))."""
    count, end, furthest, start = 0, 0, 0, 0
    flight = model.workload.micro_batches
    while end < model.n:
        while start <= end:
            furthest = max(furthest, model.memory_stop(start, half, flight))
            start += 1
        if furthest <= end:
            need = model.memory(end, end + 1, flight)
            raise ShardError(
                f"block {end} needs {format_bytes(need)} (parameters, gradients, optimizer"
                f" state and what {flight} micro-batch(es) of {model.workload.micro_batch_size}"
                " samples keep for the backward, and a backward's temporaries) but a SHARP"
                f" shard may use at most {format_bytes(half)}, half of the smallest device's"
                f" {format_bytes(budget)} (the other half holds the prefetched next shard); use"
                " smaller micro-batches, recompute: true, or devices with more memory"
            )
        count, end = count + 1, furthest
    return count


# ------------------------------------------------------------------ tasks and progress


class Op(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class ShardTask:
    """One unit of SHARP work: a shard's forward or backward in one step of one model."""

    model: ModelId
    shard: int
    op: Op
    step: int

    def __str__(self) -> str:
        return f"{self.model}:{self.op.value[0].upper()}{self.shard}@{self.step}"


@dataclass(frozen=True)
class ModelPlan:
    """A model's SHARP work: ``steps`` times forward shards 0..k-1 then backward k-1..0.

    A task is named by its *position* in that chain (0 .. ``tasks`` - 1); ``order`` is the
    submission order FIFO reads. With ``recompute`` each shard's backward runs its forward
    again from the shard's input (``shard_model``'s cut), so a shard moves between its
    forward and its backward at no cost in compute."""

    model: ModelId
    shards: tuple[Shard, ...]
    steps: int
    order: int = 0
    recompute: bool = False
    _suffix: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.shards or self.steps < 1:
            raise ValueError(
                f"model {self.model}: needs at least one shard and one step, got"
                f" {len(self.shards)} shard(s) and {self.steps} step(s)"
            )
        if [s.index for s in self.shards] != list(range(len(self.shards))):
            raise ValueError(f"model {self.model}: shards must be indexed 0..k-1 in order")
        times = [self.task_s(r) for r in range(2 * len(self.shards))]
        suffix = tuple(itertools.accumulate(reversed(times), initial=0.0))[::-1]
        object.__setattr__(self, "_suffix", suffix)

    @property
    def tasks(self) -> int:
        return 2 * len(self.shards) * self.steps

    @property
    def work_s(self) -> float:
        """Reference seconds of all the model's tasks."""
        return self.steps * self._suffix[0]

    def shard_at(self, position: int) -> Shard:
        k = len(self.shards)
        r = position % (2 * k)
        return self.shards[r if r < k else 2 * k - 1 - r]

    def task(self, position: int) -> ShardTask:
        k = len(self.shards)
        step, r = divmod(position, 2 * k)
        op = Op.FORWARD if r < k else Op.BACKWARD
        return ShardTask(self.model, self.shard_at(position).index, op, step)

    def run_at(self, position: int, homes: Sequence[int]) -> int:
        """How many tasks from ``position`` on run one after another on the device of its
        shard (``homes``: each shard's device), within its step: each after the first
        takes its inputs from the one before, there."""
        end = min(self.tasks, (position // (2 * len(self.shards)) + 1) * 2 * len(self.shards))
        host, length = homes[self.shard_at(position).index], 1
        while position + length < end and homes[self.shard_at(position + length).index] == host:
            length += 1
        return length

    def task_s(self, position: int) -> float:
        """Reference seconds of the task at ``position``."""
        shard, forward = self.shard_at(position), position % (2 * len(self.shards))
        return shard.forward_s if forward < len(self.shards) else shard.backward_s

    def open_forward_s(self, position: int) -> float:
        """Reference seconds of the forwards whose backward is still to come once the
        first ``position`` tasks are done: what moving the model to another device then
        runs again there (a shard's forward graph stays in its process), none with
        ``recompute`` (the backward runs them again anyway)."""
        if self.recompute:
            return 0.0
        k = len(self.shards)
        r = position % (2 * k)
        return sum(s.forward_s for s in self.shards[: r if r < k else 2 * k - r])

    def remaining_s(self, done: int) -> float:
        """Reference seconds of the tasks after the first ``done``; O(1)."""
        if done >= self.tasks:
            return 0.0
        step, r = divmod(done, 2 * len(self.shards))
        return self._suffix[r] + (self.steps - step - 1) * self._suffix[0]


@dataclass(frozen=True)
class Progress:
    """Where one model stands: all the ordering policies read. ``remaining_s`` is the
    estimate, ``ratio`` its correction from measurements, ``last_run`` the dispatch number of
    the model's last task (-1: never ran)."""

    model: ModelId
    order: int
    done: int
    remaining_s: float
    ratio: float = 1.0
    last_run: int = -1


def progress(plan: ModelPlan, done: int, *, ratio: float = 1.0, last_run: int = -1) -> Progress:
    """A model's progress after ``done`` tasks, its remaining time scaled by ``ratio``."""
    return Progress(plan.model, plan.order, done, plan.remaining_s(done) * ratio, ratio, last_run)


def refine_ratio(
    ratio: float, estimated_s: float, measured_s: float, *, weight: float = RATIO_WEIGHT
) -> float:
    """The moving average of measured / estimated task time after one more measurement, so
    that Sharded-LRTF's remaining-time estimates follow what the model really takes."""
    if estimated_s <= 0 or not math.isfinite(measured_s):
        return ratio
    return (1 - weight) * ratio + weight * measured_s / estimated_s


# ------------------------------------------------------------------------- the policies


class Policy(StrEnum):
    LRTF = "lrtf"
    FIFO = "fifo"
    ROUND_ROBIN = "round-robin"


def priority(policy: Policy, model: Progress) -> Priority:
    """The sort key of a runnable model under ``policy``; the smallest runs first.

    Sharded-LRTF (Hydra): the longest estimated remaining time first, so the models that
    bound the makespan are never left for last. FIFO: submission order. Round-robin: the
    model that ran least recently, so the order rotates after every task."""
    if policy is Policy.LRTF:
        return (-model.remaining_s, 0.0, model.model)
    if policy is Policy.FIFO:
        return (float(model.order), 0.0, model.model)
    return (float(model.last_run), float(model.order), model.model)


def next_model(policy: Policy, runnable: Iterable[Progress]) -> ModelId | None:
    """The model an idle device should run next, or None when nothing is runnable."""
    best = min(runnable, key=lambda p: priority(policy, p), default=None)
    return None if best is None else best.model


# ------------------------------------------------------------------------ the assignment


@dataclass(frozen=True)
class IdleDevice:
    """A device with room for a task: relative speed, memory budget, host->device GB/s."""

    device: DeviceId
    speed: float
    budget_bytes: int
    bandwidth_gbps: float = math.inf


@dataclass(frozen=True)
class Assignment:
    """Run ``task`` on ``device`` next. ``prefetch`` is the device's likeliest task after
    it (``lookahead``), whose shard can be copied in while ``task`` computes."""

    device: DeviceId
    task: ShardTask
    prefetch: ShardTask | None


def transfer_s(size: int, device: IdleDevice) -> float:
    """Seconds to copy ``size`` bytes from host memory onto ``device``."""
    rate = device.bandwidth_gbps
    return 0.0 if size == 0 or math.isinf(rate) else size / (rate * 1e9)


def assign(
    policy: Policy,
    device: IdleDevice,
    runnable: Sequence[Progress],
    plans: Mapping[ModelId, ModelPlan],
    *,
    sequence: int = 0,
) -> Assignment | None:
    """The task ``device`` runs next: the next task of the ``policy``'s first model among
    ``runnable`` (models whose next shard lives on the device) whose shard fits its budget,
    None when none does; with its likeliest next task (``lookahead`` among the others) to
    prefetch. ``sequence`` is the dispatch number of this task (round-robin's clock)."""
    seen: set[ModelId] = set()
    for p in runnable:
        if p.model in seen:
            raise ValueError(
                f"model {p.model} is listed twice as runnable; a device takes one task of a"
                " model at a time"
            )
        if p.done >= plans[p.model].tasks:
            raise ValueError(
                f"model {p.model} has finished its {plans[p.model].tasks} tasks; not runnable"
            )
        seen.add(p.model)
    fitting = [p for p in runnable if plans[p.model].shard_at(p.done).bytes <= device.budget_bytes]
    chosen = next_model(policy, fitting)
    if chosen is None:
        return None
    best = next(p for p in fitting if p.model == chosen)
    others = [p for p in fitting if p is not best]
    nxt = lookahead(policy, device, best, plans, others, stamp=sequence)
    return Assignment(device.device, plans[best.model].task(best.done), nxt)


def assign_run(
    policy: Policy,
    device: IdleDevice,
    runnable: Sequence[Progress],
    plans: Mapping[ModelId, ModelPlan],
    homes: Mapping[ModelId, Sequence[int]],
    host: int,
    *,
    sequence: int = 0,
) -> list[Assignment] | None:
    """``assign``'s task for ``device`` (pool position ``host``; ``homes``: where each
    model's shards live) and the tasks of its model that run after it there
    (``ModelPlan.run_at``), each with the task to prefetch behind it where that runs there:
    the next of the run, and after its last the likeliest then (``lookahead``)."""
    first = assign(policy, device, runnable, plans, sequence=sequence)
    if first is None:
        return None
    model = first.task.model
    current = next(p for p in runnable if p.model == model)
    plan, at = plans[model], current.done
    length = plan.run_at(at, homes[model])
    after = first.prefetch
    if length > 1:
        last = progress(plan, at + length - 1, ratio=current.ratio, last_run=current.last_run)
        others = [p for p in runnable if p.model != model]
        after = lookahead(policy, device, last, plans, others, stamp=sequence + length - 1)
    if after is not None and homes[after.model][after.shard] != host:
        after = None
    tasks = [plan.task(at + i) for i in range(length)]
    return [
        Assignment(device.device, task, tasks[i + 1] if i + 1 < length else after)
        for i, task in enumerate(tasks)
    ]


def lookahead(
    policy: Policy,
    device: IdleDevice,
    current: Progress,
    plans: Mapping[ModelId, ModelPlan],
    waiting: Iterable[Progress],
    *,
    stamp: int,
) -> ShardTask | None:
    """The task ``device`` should run once ``current``'s task on it is done, chosen while it
    computes so that its shard is copied in meanwhile (Hydra's double buffering).

    The candidates are ``current``'s own next task, ranked as it will be once this task is
    done (and, for round-robin, dispatched as number ``stamp``), and the policy's first
    ``waiting`` model; the policy's first of the two wins. Only a shard that fits beside the
    current one counts; None when none does. An executor asks as late as the copy allows,
    when its queue is freshest."""
    plan = plans[current.model]
    shard = plan.shard_at(current.done)
    room = device.budget_bytes - shard.bytes
    best: tuple[Priority, ShardTask] | None = None
    if current.done + 1 < plan.tasks:
        nxt = plan.shard_at(current.done + 1)
        if nxt.index == shard.index or nxt.bytes <= room:
            after = progress(plan, current.done + 1, ratio=current.ratio, last_run=stamp)
            best = (priority(policy, after), plan.task(current.done + 1))
    fitting = (w for w in waiting if plans[w.model].shard_at(w.done).bytes <= room)
    other = min(fitting, key=lambda w: priority(policy, w), default=None)
    if other is not None and (best is None or priority(policy, other) < best[0]):
        best = (priority(policy, other), plans[other.model].task(other.done))
    return None if best is None else best[1]
