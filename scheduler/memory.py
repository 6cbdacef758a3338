"""The memory estimator: the bytes a stage needs on its device, and refusals at submission.

A stage holds its blocks' parameters, their gradients (1x the parameters, accumulated over
the micro-batches of a mini-batch), the optimizer state (SGD 0x, 1x with momentum; Adam and
AdamW 2x: the two moment estimates), and the activations of the micro-batches in flight:
GPipe keeps all ``m`` until the first backward, 1F1B (PipeDream-Flush) at most ``p - s`` on
stage ``s``, one more on the first of two or more (``schedules.peak_in_flight``). With
rematerialization (GPipe's activation checkpointing) a stage keeps only its input per
micro-batch in flight, plus one micro-batch's activations while it recomputes.

Two more terms are what the device holds beyond those, measured on a GPU
(docs/architecture.md, "Memory"):
under bf16 autocast every micro-batch in flight keeps bfloat16 copies of its blocks' weights
for its backward (half the fp32 parameter bytes, per micro-batch: autocast casts afresh in
each forward); and while one block runs its backward and update, it allocates a
parameter-sized gradient beside the one accumulated, parameter-sized optimizer temporaries
and the gradients of one micro-batch's activations (``transient``). Every stage keeps room
for the model's largest block's: a bound on its own that keeps a stage's bytes a sum over
its blocks, which the partitioner's exact cut relies on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.scheduler.profile import BlockCost
from shoal.scheduler.schedules import peak_in_flight
from shoal.scheduler.types import BlockRange

FLOAT_BYTES = 4
"""fp32 parameters and optimizer state (mixed precision keeps fp32 master state too)."""

_OPTIMIZER_STATE: dict[str, float] = {"sgd": 0.0, "adam": 2.0, "adamw": 2.0}
_SCHEDULES = ("gpipe", "1f1b")
_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    autocast: int = 0
    """bf16 copies of the weights kept by the micro-batches in flight."""
    transient: int = 0
    """What a block's backward and update allocate for a moment (the model's largest)."""

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.autocast
            + self.transient
        )


def format_bytes(size: float) -> str:
    """``3.1 GiB`` / ``12.0 MiB``: the unit people read device memory in."""
    if size >= 2**30:
        return f"{size / 2**30:.1f} GiB"
    if size >= 2**20:
        return f"{size / 2**20:.1f} MiB"
    if size >= 2**10:
        return f"{size / 2**10:.1f} KiB"
    return f"{size:.0f} B"


def optimizer_state_factor(optimizer: str, *, momentum: bool = False) -> float:
    """Optimizer state as a multiple of the parameters' bytes."""
    factor = _OPTIMIZER_STATE.get(optimizer)
    if factor is None:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPTIMIZER_STATE)}"
        )
    return 1.0 if optimizer == "sgd" and momentum else factor


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``stages`` holds at its peak."""
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(_SCHEDULES)}")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(
            f"stage {stage} of {stages} with {micro_batches} micro-batches is not a pipeline"
            " position; use 0 <= stage < stages and micro_batches >= 1"
        )
    return peak_in_flight(schedule, stages, stage, micro_batches)


def autocast_copy_bytes(cost: BlockCost, precision: str) -> int:
    """The bf16 weight copies one micro-batch keeps of ``cost``'s block under ``precision``
    (an upper bound: autocast casts the weights of matrix products, not of norms or lookups)."""
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(_PRECISIONS)}")
    return cost.param_bytes // 2 if precision == "bf16" else 0


def transient_bytes(cost: BlockCost, micro_batch_size: int) -> int:
    """What ``cost``'s block allocates for a moment in its backward and update: a gradient
    beside the accumulated one, the optimizer's temporaries (a parameter-sized buffer each),
    and the gradients of one micro-batch's activations."""
    return 2 * cost.param_bytes + micro_batch_size * cost.activation_bytes_per_sample


def stage_memory(
    costs: Sequence[BlockCost],
    blocks: BlockRange,
    *,
    micro_batch_size: int,
    in_flight: int,
    recompute: bool = False,
    precision: str = "fp32",
) -> StageMemory:
    """The bytes of a stage holding ``blocks`` with ``in_flight`` micro-batches alive."""
    start, stop = blocks
    held = costs[start:stop]
    params = sum(c.param_bytes for c in held)
    per_sample = sum(c.activation_bytes_per_sample for c in held)
    if recompute and held:
        kept = in_flight * held[0].input_bytes_per_sample + per_sample
    else:
        kept = in_flight * per_sample
    copies = (1 if recompute else in_flight) * sum(autocast_copy_bytes(c, precision) for c in held)
    return StageMemory(
        params=params,
        grads=params,
        optimizer=sum(c.optim_bytes for c in held),
        activations=micro_batch_size * kept,
        autocast=copies,
        transient=max((transient_bytes(c, micro_batch_size) for c in costs), default=0),
    )


def replica_state_bytes(costs: Sequence[BlockCost], replicas: int, shard: str) -> int:
    """What one replica of a stage holding ``costs``' blocks keeps between steps: their
    parameters and optimizer state, whole, or sharded over ``replicas``
    (``workers.pipeline.sharding``: 1/R of every block's optimizer state, rounded up; and
    of its parameters too under ``full``)."""
    params = sum(c.param_bytes for c in costs)
    optimizer = sum(c.optim_bytes for c in costs)
    if shard == "none" or replicas < 2:
        return params + optimizer
    if shard == "full":
        return -(-(params + optimizer) // replicas)
    return params + -(-optimizer // replicas)


def copy_bytes(costs: Sequence[BlockCost], replicas: int, shard: str) -> int:
    """What one replica's in-memory copy of a stage holding ``costs``' blocks holds: their
    parameters and optimizer state whole, or sharded over ``replicas`` a slice of each
    (``workers.pipeline.sharding``: 1/R of both, rounded up)."""
    whole = sum(c.param_bytes + c.optim_bytes for c in costs)
    if shard == "none" or replicas < 2:
        return whole
    return -(-whole // replicas)


def fits(
    costs: Sequence[BlockCost],
    blocks: BlockRange,
    budget_bytes: int,
    *,
    micro_batch_size: int,
    in_flight: int,
    recompute: bool = False,
    precision: str = "fp32",
) -> bool:
    """Whether a stage holding ``blocks`` fits in ``budget_bytes``."""
    need = stage_memory(
        costs,
        blocks,
        micro_batch_size=micro_batch_size,
        in_flight=in_flight,
        recompute=recompute,
        precision=precision,
    )
    return need.total <= budget_bytes


def _block_floor(
    cost: BlockCost, micro_batch_size: int, transient: int, shards: int = 1, full: bool = False
) -> int:
    """The least a stage holding this block needs: its state (parameters, gradients, and
    its optimizer state or a share of it over ``shards`` sharded replicas; ``full``, a
    share of all three and the parameters gathered whole while it runs), one micro-batch
    of it and the room every stage keeps for a backward's temporaries (``transient``)."""
    if full and shards > 1:
        state = -(-(2 * cost.param_bytes + cost.optim_bytes) // shards) + cost.param_bytes
    else:
        state = 2 * cost.param_bytes + -(-cost.optim_bytes // shards)
    return state + micro_batch_size * cost.activation_bytes_per_sample + transient


def submission_refusal(
    costs: Sequence[BlockCost],
    *,
    optimizer: str,
    micro_batch_size: int,
    largest_device_bytes: int,
    max_devices: int,
    shards: int = 1,
    full: bool = False,
) -> str | None:
    """None when the job might fit, else why it cannot fit on any ``max_devices`` devices of
    at most ``largest_device_bytes`` each. A lower bound, so it never refuses a job that
    fits: every byte of state lives on some device, every stage holds at least one
    micro-batch's activations of each of its blocks at its peak, so the busiest device holds
    at least the average; no device holds less than the largest block it gets (with its
    optimizer state shared by at most ``shards`` sharded replicas: 1 where the job does not
    shard; ``full``, its parameters and gradients too, gathered whole one block at a time);
    and every device keeps room for a backward's temporaries."""
    devices = max(1, min(max_devices, len(costs)))
    whole = sum(2 * c.param_bytes for c in costs)
    optimizer_bytes = sum(c.optim_bytes for c in costs)
    static = whole + optimizer_bytes
    activations = micro_batch_size * sum(c.activation_bytes_per_sample for c in costs)
    transient = max(transient_bytes(c, micro_batch_size) for c in costs)

    def bounds(shards: int, full: bool) -> tuple[int, int, BlockCost]:
        """The even split's bound, the largest block's, and that block, when each block's
        optimizer state (``full``: all its state) may be shared by ``shards`` replicas.
        Stages are at most one per block; sharded replicas of them spread what they share
        over up to ``shards`` times as many devices."""
        sharing = max(1, min(max_devices, devices * shards))
        shared = optimizer_bytes + (whole if full else 0)
        spread = (static - shared + activations) * sharing + shared * devices
        even = -(-spread // (devices * sharing)) + transient
        if full and sharing > 1:  # one block's parameters gathered whole
            even += max(c.param_bytes for c in costs)

        def floor(cost: BlockCost) -> int:
            return _block_floor(cost, micro_batch_size, transient, shards, full)

        biggest = max(costs, key=floor)
        return even, floor(biggest), biggest

    even, block, biggest = bounds(shards, full)
    floor = max(even, block)
    if floor <= largest_device_bytes:
        return None
    if floor > even:
        where = f"for block {biggest.index} alone (a block is never split)"
    else:
        where = "on one device" if devices == 1 else f"even split over {devices} devices"
    fixes = []
    if floor == even and devices < len(costs):
        fixes.append("allow more devices (resources.max_devices)")
    if not full:
        for mode, what, also in (
            ("optimizer", "the optimizer state", False),
            ("full", "the parameters, gradients and optimizer state", True),
        ):
            if shards > 1 and not also:
                continue  # sharded already: only sharding more of it can help
            enough = next(
                (
                    r
                    for r in range(2, max_devices + 1)
                    if max(bounds(r, also)[:2]) <= largest_device_bytes
                ),
                None,
            )
            if enough is not None:
                fixes.append(
                    f"shard {what} over {enough} or more replicas"
                    f" (parallelism.shard: {mode}, parallelism.replicas: {enough})"
                )
                break
    one = max(c.activation_bytes_per_sample for c in costs)  # in the temporaries
    activation_part = micro_batch_size * one + (
        activations if floor == even else micro_batch_size * biggest.activation_bytes_per_sample
    )
    if 2 * activation_part > floor:  # mostly activations: smaller micro-batches help
        fixes.append("use more micro_batches (smaller micro-batches)")
    fixes.append("use a smaller model")
    params = sum(c.param_bytes for c in costs) // FLOAT_BYTES
    return (
        f"the model needs at least {format_bytes(floor)} per device {where}, but the largest"
        f" device has {format_bytes(largest_device_bytes)} ({params:,} parameters with"
        f" {optimizer}: {format_bytes(static)} of parameters, gradients and optimizer state,"
        f" {format_bytes(activations)} of activations per micro-batch, {format_bytes(transient)}"
        f" for a backward's temporaries); {' or '.join(fixes)}"
    )
