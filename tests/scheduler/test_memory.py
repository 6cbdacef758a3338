"""The memory estimator: stage bytes, in-flight micro-batches, refusals at submission."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.scheduler.memory import (
    StageMemory,
    copy_bytes,
    fits,
    format_bytes,
    in_flight,
    optimizer_state_factor,
    replica_state_bytes,
    stage_memory,
    submission_refusal,
)
from shoal.scheduler.partition import PartitionError, plan_partition
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.schedules import build
from shoal.scheduler.schedules import in_flight as peak_in_flight
from shoal.scheduler.workload import DeviceCapacity, Workload

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
    # The largest backward's temporaries, block 0's: two parameter-sized buffers and one
    # micro-batch's activation gradients; every stage keeps room for them.
    transient = 2 * 100 + 4 * 10
    assert kept == StageMemory(
        params=150, grads=150, optimizer=300, activations=3 * 4 * 30, transient=transient
    )
    assert kept.total == 150 + 150 + 300 + 360 + transient
    assert stage_memory(costs, (1, 2), micro_batch_size=4, in_flight=3).transient == transient
    # bf16 autocast: each micro-batch in flight keeps bfloat16 copies of the weights.
    bf16 = stage_memory(costs, (0, 2), micro_batch_size=4, in_flight=3, precision="bf16")
    assert bf16.autocast == 3 * 150 // 2
    assert bf16.total == kept.total + bf16.autocast
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        stage_memory(costs, (0, 2), micro_batch_size=4, in_flight=3, precision="fp8")
    # Rematerialization: the stage input per micro-batch in flight, one micro-batch recomputed.
    recomputed = stage_memory(costs, (1, 2), micro_batch_size=4, in_flight=3, recompute=True)
    assert recomputed.activations == 4 * (3 * 7 + 20)
    assert fits(costs, (0, 2), kept.total, micro_batch_size=4, in_flight=3)
    assert not fits(costs, (0, 2), kept.total - 1, micro_batch_size=4, in_flight=3)


def _blocks(params: int, count: int, optimizer: str, act: int = 0) -> list[BlockCost]:
    """``params`` fp32 parameters over ``count`` blocks (the remainder on block 0)."""
    per_block, extra = divmod(params, count)
    factor = optimizer_state_factor(optimizer)
    sizes = [per_block + (extra if i == 0 else 0) for i in range(count)]
    return [BlockCost(i, 1.0, 4 * n, round(4 * factor * n), act, act) for i, n in enumerate(sizes)]


def test_a_model_that_fits_nowhere_is_refused_with_numbers() -> None:
    message = submission_refusal(
        _blocks(200_000_000, 10, "adam"),  # 0.75 GiB of fp32, x4 with Adam's state and grads
        optimizer="adam",
        micro_batch_size=8,
        largest_device_bytes=1 * GiB,
        max_devices=2,
    )
    assert message == (
        "the model needs at least 1.6 GiB per device even split over 2 devices, but the"
        " largest device has 1.0 GiB (200,000,000 parameters with adam: 3.0 GiB of parameters,"
        " gradients and optimizer state, 0 B of activations per micro-batch, 152.6 MiB for a"
        " backward's temporaries); allow more devices (resources.max_devices) or use a"
        " smaller model"
    )
    roomy = submission_refusal(
        _blocks(200_000_000, 10, "sgd"),
        optimizer="sgd",
        micro_batch_size=8,
        largest_device_bytes=1 * GiB,
        max_devices=4,
    )
    assert roomy is None


def test_a_block_too_big_for_any_device_is_named() -> None:
    costs = [*_blocks(1_000, 2, "sgd"), BlockCost(2, 1.0, GiB, 0, 0, 0)]
    message = submission_refusal(
        costs, optimizer="sgd", micro_batch_size=1, largest_device_bytes=GiB, max_devices=64
    )
    assert message is not None
    # 1 GiB of parameters, 1 GiB of gradients, 2 GiB of a backward's temporaries
    assert message.startswith("the model needs at least 4.0 GiB per device for block 2 alone")
    assert "max_devices" not in message  # more devices cannot split a block


def test_activations_heavy_refusals_suggest_smaller_micro_batches() -> None:
    message = submission_refusal(
        _blocks(1_000, 1, "sgd", act=4 * 2**20),
        optimizer="sgd",
        micro_batch_size=1024,
        largest_device_bytes=GiB,
        max_devices=8,
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


def test_a_block_that_fits_only_sharded_is_admitted_sharded_and_refused_with_the_fix() -> None:
    # One block: 1 GiB of parameters with Adam (2 GiB of moments), on 3 GiB devices: whole,
    # it needs 1 + 1 + 2 GiB (+ a backward's 2 GiB of temporaries); shards of the moments
    # over R replicas bring that to 4 + 2/R GiB.
    costs = [BlockCost(0, 1.0, GiB, 2 * GiB, 0, 0)]
    refusal = submission_refusal(
        costs, optimizer="adam", micro_batch_size=1, largest_device_bytes=5 * GiB, max_devices=4
    )
    assert refusal is not None
    assert refusal.startswith("the model needs at least 6.0 GiB per device on one device")
    assert (
        "shard the optimizer state over 2 or more replicas (parallelism.shard: optimizer,"
        " parallelism.replicas: 2) or use a smaller model"
    ) in refusal
    for shards in (2, 4):
        assert (
            submission_refusal(
                costs,
                optimizer="adam",
                micro_batch_size=1,
                largest_device_bytes=5 * GiB,
                max_devices=4,
                shards=shards,
            )
            is None
        )
    # Where only ZeRO-3 fits (4 GiB: a quarter of 4 GiB of state, the block's parameters
    # gathered whole, 2 GiB of temporaries), it is offered; it is admitted that way.
    tight = submission_refusal(
        costs, optimizer="adam", micro_batch_size=1, largest_device_bytes=4 * GiB, max_devices=4
    )
    assert tight is not None
    assert (
        "shard the parameters, gradients and optimizer state over 4 or more replicas"
        " (parallelism.shard: full, parallelism.replicas: 4)"
    ) in tight
    fields: dict[str, Any] = {"optimizer": "adam", "micro_batch_size": 1, "max_devices": 4}
    assert (
        submission_refusal(costs, largest_device_bytes=4 * GiB, shards=4, full=True, **fields)
        is None
    )
    refused = submission_refusal(costs, largest_device_bytes=4 * GiB, shards=3, full=True, **fields)
    assert refused is not None and "parallelism.shard" not in refused  # sharded as it can be
    # Where no share fits, sharding is not offered as the fix.
    tighter = submission_refusal(costs, largest_device_bytes=3 * GiB + GiB // 2, **fields)
    assert tighter is not None and "parallelism.shard" not in tighter


@given(
    params=st.integers(1, 5_000),
    blocks=st.integers(1, 6),
    devices=st.integers(1, 4),
    memory=st.integers(1, 20_000),
    act=st.integers(0, 50),
    m=st.integers(1, 4),
    optimizer=st.sampled_from(["sgd", "adam"]),
    shard=st.sampled_from(["none", "optimizer", "gradients", "full"]),
)
def test_the_refusal_never_refuses_what_the_partitioner_can_place(
    params: int,
    blocks: int,
    devices: int,
    memory: int,
    act: int,
    m: int,
    optimizer: str,
    shard: str,
) -> None:
    costs = _blocks(params, blocks, optimizer, act)
    pool = [DeviceCapacity(f"d{i}", 1.0, memory) for i in range(devices)]
    try:
        plan_partition(costs, pool, Workload(micro_batches=m, micro_batch_size=2, shard=shard))
    except PartitionError:
        return
    assert (
        submission_refusal(
            costs,
            optimizer=optimizer,
            micro_batch_size=2,
            largest_device_bytes=memory,
            max_devices=devices,
            shards=1 if shard == "none" else devices,  # replicas: auto
            full=shard == "full",
        )
        is None
    )


def test_sharded_replicas_keep_their_share_of_the_optimizer_state() -> None:
    costs = [BlockCost(i, 1.0, 400, 800, 0) for i in range(3)]  # Adam: 2x the parameters
    assert replica_state_bytes(costs, 1, "optimizer") == 3600  # one replica: all of it
    assert replica_state_bytes(costs, 4, "none") == 3600
    assert replica_state_bytes(costs, 4, "optimizer") == 1200 + 600
    assert replica_state_bytes(costs, 4, "gradients") == 1200 + 600
    assert replica_state_bytes(costs, 7, "gradients") == 1200 + 343  # rounded up
    assert replica_state_bytes(costs, 4, "full") == 900  # the parameters' share too
    assert replica_state_bytes(costs, 1, "full") == 3600


def test_a_sharded_replicas_copy_holds_its_slice_of_parameters_and_optimizer_state() -> None:
    costs = [BlockCost(i, 1.0, 400, 800, 0) for i in range(3)]
    assert copy_bytes(costs, 4, "none") == copy_bytes(costs, 1, "gradients") == 3600
    assert copy_bytes(costs, 4, "optimizer") == copy_bytes(costs, 4, "gradients") == 900
    assert copy_bytes(costs, 7, "optimizer") == 515  # rounded up
