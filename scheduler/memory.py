"""The memory estimator: the bytes a stage needs on its device, and refusals at submission.

A stage holds its blocks' parameters, their gradients (1x the parameters, accumulated over
the micro-batches of a mini-batch), the optimizer state (SGD 0x, 1x with momentum; Adam and
AdamW 2x: the two moment estimates), and the activations of the micro-batches in flight:
GPipe keeps all ``m`` until the first backward, 1F1B (PipeDream-Flush) at most ``p - s`` on
stage ``s``. With rematerialization (GPipe's activation checkpointing) a stage keeps only its
input per micro-batch in flight, plus one micro-batch's activations while it recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.profile import BlockCost
from scheduler.types import BlockRange

FLOAT_BYTES = 4
"""fp32 parameters and optimizer state (mixed precision keeps fp32 master state too)."""

_OPTIMIZER_STATE: dict[str, float] = {"sgd": 0.0, "adam": 2.0, "adamw": 2.0}
_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


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
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, stages - stage)


def stage_memory(
    costs: Sequence[BlockCost],
    blocks: BlockRange,
    *,
    micro_batch_size: int,
    in_flight: int,
    recompute: bool = False,
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
    return StageMemory(
        params=params,
        grads=params,
        optimizer=sum(c.optim_bytes for c in held),
        activations=micro_batch_size * kept,
    )


def fits(
    costs: Sequence[BlockCost],
    blocks: BlockRange,
    budget_bytes: int,
    *,
    micro_batch_size: int,
    in_flight: int,
    recompute: bool = False,
) -> bool:
    """Whether a stage holding ``blocks`` fits in ``budget_bytes``."""
    need = stage_memory(
        costs, blocks, micro_batch_size=micro_batch_size, in_flight=in_flight, recompute=recompute
    )
    return need.total <= budget_bytes


@dataclass(frozen=True)
class ModelMemory:
    """A model's bytes estimated from its configuration (no torch, nothing built).

    ``static_bytes``: parameters + gradients + optimizer state of the whole model;
    ``activation_bytes``: one micro-batch's activations through every block.
    """

    static_bytes: int
    activation_bytes: int

    def per_device_floor(self, devices: int) -> float:
        """A lower bound on the busiest device's bytes when the model is cut over
        ``devices`` stages: every byte lives somewhere, and every block holds at least one
        micro-batch's activations at some moment, so some device holds the average."""
        return (self.static_bytes + self.activation_bytes) / devices


def estimate_from_config(
    *,
    param_count: int,
    optimizer: str,
    micro_batch_size: int,
    activation_bytes_per_sample: int = 0,
    momentum: bool = False,
    bytes_per_param: int = FLOAT_BYTES,
) -> ModelMemory:
    """The model's memory from the registry's parameter count and a per-sample activation
    estimate (bytes across all blocks; 0 when unknown, which only makes refusals rarer)."""
    factor = 2.0 + optimizer_state_factor(optimizer, momentum=momentum)  # params + grads + state
    return ModelMemory(
        static_bytes=round(param_count * bytes_per_param * factor),
        activation_bytes=micro_batch_size * activation_bytes_per_sample,
    )


def submission_refusal(
    *,
    param_count: int,
    num_blocks: int,
    optimizer: str,
    batch_size: int,
    micro_batches: int,
    largest_device_bytes: int,
    max_devices: int,
    activation_bytes_per_sample: int = 0,
    momentum: bool = False,
) -> str | None:
    """None when the job might fit, else why it cannot fit on any ``max_devices`` devices of
    at most ``largest_device_bytes`` each (a lower bound: never refuses a job that fits)."""
    devices = max(1, min(max_devices, num_blocks))
    estimate = estimate_from_config(
        param_count=param_count,
        optimizer=optimizer,
        micro_batch_size=max(1, batch_size // max(1, micro_batches)),
        activation_bytes_per_sample=activation_bytes_per_sample,
        momentum=momentum,
    )
    floor = estimate.per_device_floor(devices)
    if floor <= largest_device_bytes:
        return None
    split = "on one device" if devices == 1 else f"even split over {devices} devices"
    fixes = ["allow more devices (resources.max_devices)"] if devices < num_blocks else []
    if estimate.activation_bytes > estimate.static_bytes:
        fixes.append("use more micro_batches (smaller micro-batches)")
    fixes.append("use a smaller model")
    return (
        f"the model needs at least {format_bytes(floor)} per device {split}, but the largest"
        f" device has {format_bytes(largest_device_bytes)} ({param_count:,} parameters with"
        f" {optimizer}: {format_bytes(estimate.static_bytes)} of parameters, gradients and"
        f" optimizer state, {format_bytes(estimate.activation_bytes)} of activations per"
        f" micro-batch); {' or '.join(fixes)}"
    )
