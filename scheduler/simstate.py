"""The simulated SHARP executor's state (``scheduler.simsharp``): its constants, each
device's queue, each model's progress, each task.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from shoal.scheduler.copies import DEFAULT_BUDGET, copy_interval
from shoal.scheduler.memory import format_bytes
from shoal.scheduler.sharp import IdleDevice, ModelId, ModelPlan, transfer_s
from shoal.scheduler.simcluster import SimDevice
from shoal.scheduler.simresult import SimulationError, Tally
from shoal.scheduler.types import DeviceId


class Moves(StrEnum):
    """When a model leaves the device it was placed on (besides a loss of that device)."""

    NONE = "none"
    AT_STEPS = "at-steps"
    """At a step boundary, whole, to the device where that ends both devices' work sooner
    (``move_target``): what the executor does with ``trades`` off."""
    TRADES = "trades"
    """Before any of its tasks, to a faster device holding no model, or trading places
    with the model there with the least work to go (``trade_target``, handed over when
    that loses least: ``hand_over_now``), models placed one a device while any is free
    (``home_shards``' spread): what the executor does by default
    (``workers.sharp.trading``)."""


class Recovery(StrEnum):
    """What a lost device costs the models with shards or tasks on it."""

    STEP = "step"
    """They roll back to their last copy: the step under way's start, or further where
    copies are taken less often than every step (what the executor does with
    ``task_copies`` off)."""
    TASK = "task"
    """The tasks in flight: each task's outputs and each shard's state once its backward
    has stepped it are copied off the device as they are made, so only unfinished tasks
    run again (Hydra's promise): what the executor does by default for a model whose
    copies are taken at every step (``workers.sharp.ledger``); one copied less often
    rolls back to its last copy."""


@dataclass(frozen=True)
class Engine:
    """The executor's constants: tasks queued per device (``QUEUE_DEPTH``), the one-way
    latency between it and a worker (and between two workers), when models move and what
    a lost device costs."""

    depth: int = 2
    latency_s: float = 0.0
    moves: Moves = Moves.TRADES
    recovery: Recovery = Recovery.TASK
    copy_budget: float = DEFAULT_BUDGET
    """Each model's copies' share of its training time (``elastic.copy_budget``): how
    often they are taken (``scheduler.copies``) where they are not ``overlapped``."""
    overlapped: bool = True
    """Copies cost the devices nothing, so they are taken at every step: the executor's
    hosts make them beside the compute (``ShardHost.copy``; a task-copied backward's too),
    on a GPU on a side stream into pinned host memory, and the simulated devices are GPUs.
    False: each shard's backward in a step that ends with a copy copies its state off the
    device at its host link's bandwidth before the device's next task, as a CPU device's
    copying thread takes its cores."""

    def __post_init__(self) -> None:
        if self.depth < 1 or not self.latency_s >= 0:
            raise SimulationError(
                f"engine depth ({self.depth}) must be >= 1 and latency_s ({self.latency_s}) >= 0"
            )


ENGINE = Engine()
"""The executor as it runs by default: two tasks queued per device, models trading places
before a task, copies beside the compute at every step made task by task (a loss costs the
tasks in flight), no latency."""


@dataclass
class SimTask:
    """A task given to a device: its model, chain position and the model's epoch then
    (a roll back makes it stale), when it reached the device and how it ran."""

    ident: int
    model: ModelId
    position: int
    epoch: int
    arrive_s: float
    start_s: float = 0.0
    compute_s: float = 0.0
    copy_s: float = 0.0


@dataclass
class SimQueue:
    """A device as the executor drives it: the task it runs and those queued behind."""

    sim: SimDevice
    idle: IdleDevice
    alive: bool = True
    running: SimTask | None = None
    queue: deque[SimTask] = field(default_factory=deque)
    in_flight: int = 0
    """Tasks the executor has given it and not yet seen end."""
    last: tuple[ModelId, int] | None = None
    """The (model, shard) of its last task: still on the device."""
    woken: float = -1.0


GONE: DeviceId = ""
"""Where a shard's state is when its forward's graph was lost with a device."""


@dataclass
class SimModel:
    """A model's progress as the simulated executor tracks it."""

    plan: ModelPlan
    homes: list[DeviceId]
    """Where each shard lives: the device whose queue takes its tasks."""
    held: list[DeviceId] = field(default_factory=list)
    """Where each shard's state is: its home, or where its last task ran while it
    follows a trade there (``GONE``: its forward's graph was lost with a device)."""
    done: int = 0
    submitted: int = 0
    seen: int = 0
    """Tasks the executor has seen end (it starts a step only after seeing the last one)."""
    epoch: int = 0
    ratio: float = 1.0
    last_run: int = -1
    paused_until: float = 0.0
    input_at: dict[int, float] = field(default_factory=dict)
    """When the input of a task (by position) is on its device."""
    waiting_at: DeviceId | None = None
    last_device: DeviceId | None = None
    """Where its last submitted task runs."""
    joining: tuple[DeviceId, ModelId] | None = None
    """A faster device it takes once the model there hands it over (``hand_over_now``),
    and that model; meanwhile it queues no task."""
    leaving: tuple[DeviceId, ModelId] | None = None
    """Where it goes once it hands its device over, and the model that takes it."""
    step_runs: list[tuple[int, DeviceId, float, float]] = field(default_factory=list)
    """The tally's numbers of the tasks since its last copy (with device, compute, copy):
    undone by a roll back."""
    copy_every: int = 1
    """Steps between its copies (``scheduler.copies.copy_interval``)."""

    def copies_after(self, position: int) -> bool:
        """Whether the task at ``position`` is a backward of a step its copy ends."""
        k, step = len(self.plan.shards), self.plan.task(position).step
        return position % (2 * k) >= k and (step + 1) % self.copy_every == 0

    def rewind(self, tally: Tally, task_by_task: bool) -> float:
        """After a loss: it goes on from its last task done where its tasks copy the step
        off as they go (``task_by_task``, at a copy every step), else from its last copy,
        the tasks since undone in ``tally``. The reference seconds of work to do again."""
        span = 2 * len(self.plan.shards) * self.copy_every
        start = self.done if task_by_task and self.copy_every == 1 else self.done // span * span
        redo = 0.0
        if start < self.done:
            for number, device_id, compute_s, copy_s in self.step_runs:
                tally.undo(number, device_id, compute_s, copy_s)
            redo = sum(self.plan.task_s(p) for p in range(start, self.done))
            self.step_runs = []
        self.done = self.submitted = self.seen = start
        return redo

    def copied(self) -> bool:
        """Its tasks done end a step its copy ends."""
        return self.done % (2 * len(self.plan.shards) * self.copy_every) == 0

    def forward_again(self, position: int, device: DeviceId) -> bool:
        """Whether the task at ``position``, on ``device``, is a backward whose shard's
        forward ran elsewhere (a trade moved it in between, or its device was lost): the
        forward runs again on ``device`` first, from the micro-batches' inputs, as the
        executor hands a shard over (an autograd graph cannot leave its process); never
        with ``recompute``, whose backward runs the forward again anyway."""
        k = len(self.plan.shards)
        moved = self.held[self.plan.shard_at(position).index] != device
        return not self.plan.recompute and position % (2 * k) >= k and moved


def copy_every(plan: ModelPlan, device: IdleDevice, engine: Engine) -> int:
    """How often ``plan``'s copies are taken on ``device`` by ``engine``: every shard's
    state copied off at the device's host bandwidth, against its step's device seconds,
    within the engine's budget (at every step where they are ``overlapped``)."""
    copy_s = sum(transfer_s(s.state_bytes, device) for s in plan.shards)
    budget = 1.0 if engine.overlapped else engine.copy_budget
    return copy_interval(copy_s, plan.work_s / plan.steps / device.speed, budget)


def stuck(devices: Iterable[SimQueue], models: Iterable[SimModel]) -> str:
    """Why the models with work left cannot finish (no event is left to come)."""
    left = [m for m in models if m.done < m.plan.tasks]
    up = [d for d in devices if d.alive]
    if not up:
        return (
            f"{len(left)} model(s) cannot finish: every device is lost and none comes back;"
            " add devices or expect fewer outages"
        )
    largest = max(d.idle.budget_bytes for d in up)
    for model in left:
        shard = model.plan.shard_at(model.done)
        if shard.bytes > largest:
            return (
                f"model {model.plan.model} cannot finish: shard {shard.index} needs"
                f" {format_bytes(shard.bytes)} but the largest device that is up has"
                f" {format_bytes(largest)}; cut its shards for the smallest device"
            )
    return f"{len(left)} model(s) cannot finish: their shards' devices are lost for good"
