"""The memory estimator: stage bytes, in-flight micro-batches, refusals at submission."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.memory import (
    StageMemory,
    estimate_from_config,
    fits,
    format_bytes,
    in_flight,
    optimizer_state_factor,
    stage_memory,
    submission_refusal,
)
from scheduler.partition import DeviceCapacity, PartitionError, Workload, plan_partition
from scheduler.profile import BlockCost, uniform_costs
from scheduler.schedules import build
from scheduler.schedules import in_flight as peak_in_flight

pytestmark = pytest.mark.unit

GiB = 2**30


@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 8))
def test_in_flight_matches_the_simulated_schedules(schedule: str, stages: int, m: int) -> None:
    built = build(schedule, stages, m)
    for s in range(stages):
        assert in_flight(schedule, stages, s, m) == peak_in_flight(built[s])


def test_optimizer_state_multiples() -> None:
    assert optimizer_state_factor("sgd") == 0
    assert optimizer_state_factor("sgd", momentum=True) == 1
    assert optimizer_state_factor("adam") == optimizer_state_factor("adamw") == 2
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; choose one of"):
        optimizer_state_factor("lamb")


def test_stage_bytes_by_kind() -> None:
    costs = [
        BlockCost(0, 1.0, param_bytes=100, optim_bytes=200, activation_bytes_per_sample=10,
                  input_bytes_per_sample=1),
        BlockCost(1, 1.0, param_bytes=50, optim_bytes=100, activation_bytes_per_sample=20,
                  input_bytes_per_sample=7),
    ]  # fmt: skip
    kept = stage_memory(costs, (0, 2), micro_batch_size=4, in_flight=3)
    assert kept == StageMemory(params=150, grads=150, optimizer=300, activations=3 * 4 * 30)
    assert kept.total == 150 + 150 + 300 + 360
    # Rematerialization: the stage input per micro-batch in flight, one micro-batch recomputed.
    recomputed = stage_memory(costs, (1, 2), micro_batch_size=4, in_flight=3, recompute=True)
    assert recomputed.activations == 4 * (3 * 7 + 20)
    assert fits(costs, (0, 2), kept.total, micro_batch_size=4, in_flight=3)
    assert not fits(costs, (0, 2), kept.total - 1, micro_batch_size=4, in_flight=3)


def test_a_model_that_fits_nowhere_is_refused_with_numbers() -> None:
    message = submission_refusal(
        param_count=200_000_000,  # 0.75 GiB of fp32, x4 with Adam's state and gradients
        num_blocks=10,
        optimizer="adam",
        batch_size=64,
        micro_batches=8,
        largest_device_bytes=1 * GiB,
        max_devices=2,
    )
    assert message == (
        "the model needs at least 1.5 GiB per device even split over 2 devices, but the"
        " largest device has 1.0 GiB (200,000,000 parameters with adam: 3.0 GiB of parameters,"
        " gradients and optimizer state, 0 B of activations per micro-batch); allow more"
        " devices (resources.max_devices) or use a smaller model"
    )
    roomy = submission_refusal(
        param_count=200_000_000,
        num_blocks=10,
        optimizer="sgd",
        batch_size=64,
        micro_batches=8,
        largest_device_bytes=1 * GiB,
        max_devices=4,
    )
    assert roomy is None


def test_activations_heavy_refusals_suggest_smaller_micro_batches() -> None:
    message = submission_refusal(
        param_count=1_000,
        num_blocks=1,
        optimizer="sgd",
        batch_size=1024,
        micro_batches=1,
        largest_device_bytes=GiB,
        max_devices=8,
        activation_bytes_per_sample=4 * 2**20,
    )
    assert message is not None
    assert "on one device" in message
    assert "use more micro_batches (smaller micro-batches) or use a smaller model" in message
    assert "max_devices" not in message  # one block: more devices cannot help


def test_format_bytes() -> None:
    assert format_bytes(3.1 * GiB) == "3.1 GiB"
    assert format_bytes(12 * 2**20) == "12.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(512) == "512 B"


@given(
    params=st.integers(1, 5_000),
    blocks=st.integers(1, 6),
    devices=st.integers(1, 4),
    memory=st.integers(1, 20_000),
    act=st.integers(0, 50),
    m=st.integers(1, 4),
    optimizer=st.sampled_from(["sgd", "adam"]),
)
def test_the_refusal_never_refuses_what_the_partitioner_can_place(
    params: int, blocks: int, devices: int, memory: int, act: int, m: int, optimizer: str
) -> None:
    per_block, extra = divmod(params, blocks)
    factor = optimizer_state_factor(optimizer)
    costs = [
        BlockCost(
            i,
            1.0,
            param_bytes=4 * (per_block + (extra if i == 0 else 0)),
            optim_bytes=round(4 * factor * (per_block + (extra if i == 0 else 0))),
            activation_bytes_per_sample=act,
            input_bytes_per_sample=act,
        )
        for i in range(blocks)
    ]
    pool = [DeviceCapacity(f"d{i}", 1.0, memory) for i in range(devices)]
    try:
        plan_partition(costs, pool, Workload(micro_batches=m, micro_batch_size=2))
    except PartitionError:
        return
    assert (
        submission_refusal(
            param_count=params,
            num_blocks=blocks,
            optimizer=optimizer,
            batch_size=2 * m,
            micro_batches=m,
            largest_device_bytes=memory,
            max_devices=devices,
            activation_bytes_per_sample=act * blocks,
        )
        is None
    )


def test_estimate_from_config_counts_state_and_activations() -> None:
    estimate = estimate_from_config(
        param_count=1_000, optimizer="adamw", micro_batch_size=8, activation_bytes_per_sample=16
    )
    assert estimate.static_bytes == 1_000 * 4 * 4
    assert estimate.activation_bytes == 128
    assert estimate.per_device_floor(4) == (16_000 + 128) / 4
    assert uniform_costs(1)[0].param_bytes == 0
