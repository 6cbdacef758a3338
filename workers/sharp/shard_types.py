"""What the SHARP executor and its devices' hosts (``workers.sharp.shard_host``) pass each
other: shard keys, a task's result and what it copied off the device, a task's inputs, and a
shard handed over between two hosts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.workers.wire import Wire

ShardKey = tuple[str, int]
"""(model id, shard index)."""

Outputs = list[Wire | None]
"""A shard task's tensors for the model's next task, one per micro-batch."""

Replays = dict[int, tuple[Wire, Wire | None]]
"""The CPU and (on a GPU) CUDA RNG states each micro-batch's forward ran under, in wire form."""


@dataclass(frozen=True)
class Record:
    """What a task copied off its device as it ran (``record``: the model's steps recover
    task by task, ``workers.sharp.ledger``): its outputs for the model's next task, and the
    RNG states of the micro-batches it ran forward; and the seconds taking them held the
    device. A backward's shard states as its step left them come apart, once copied beside
    the tasks after it (``ShardHost.copied``)."""

    outputs: Outputs
    replays: Replays
    seconds: float
    finished: float
    """The wall clock when they were taken (their way to the executor costs too)."""


@dataclass(frozen=True)
class TaskResult:
    """What a shard task tells the executor: the losses of a last shard's micro-batches,
    the compute seconds it took, the bytes it promoted and, when asked, its ``Record``. Its
    outputs, the tensors of the model's next task, go apart (``Outputs``): straight to the
    next task's host on Ray."""

    losses: list[float]
    compute_s: float
    promoted_bytes: int
    record: Record | None = None
    host_s: float = 0.0
    """The task's wall seconds in its worker, from its start to its value (``ShardWorker``):
    what the worker spent on it besides computing, its inputs and outputs moved between
    host and device among it, is ``host_s - compute_s``."""
    idle_s: float = 0.0
    """The wall seconds its worker had no call before it started: waiting for the executor
    to send it, or for its inputs to arrive (Ray fetches them before the call runs)."""


@dataclass(frozen=True)
class Stashed:
    """A task's inputs are the outputs of the model's task at ``position`` - 1, which ran on
    this same host and left them in its stash (``keep``): on the device, never serialized."""

    position: int


@dataclass(frozen=True)
class Drawn:
    """A task's inputs (a model's first shard's forward) or targets (its last shard's) are
    step ``step``'s batch in ``micro_batches`` micro-batches, which the host draws itself
    from the model's data (``workers.sharp.task_io``), as a pipeline's first and last stages
    do: the executor neither makes the batch nor sends it through Ray."""

    step: int
    micro_batches: int


Inputs = Sequence[Wire | None] | Stashed | Drawn
"""What a shard task computes from: tensors sent to it, what the host's stash holds, or
the step's batch, drawn where it runs."""

Targets = Sequence[Wire] | Drawn
"""What a model's last shard's losses compare with: sent, or drawn where it runs."""


@dataclass(frozen=True)
class Handover:
    """A shard on its way to another host between two of its model's tasks (a trade of
    places, ``give`` to ``take``, or rebuilt after a loss from the model's ``Ledger``): its
    blocks' states; the inputs of the micro-batches it ran forward and not yet backward,
    whether they end in the loss, and the RNG states each forward ran under (with
    rematerialization its backward recomputes the forward where it goes; without, an
    autograd graph cannot leave its process, so the forward runs again there from the same
    parameters, input and RNG: the same graph); and the outputs its host kept for the
    model's next task (by that task's position), when that task is this shard's."""

    state: dict[int, Any]
    inputs: dict[int, Wire]
    loss: bool
    stash: tuple[int, list[Wire | None]] | None
    replays: Replays
