"""A model's arrival in the SHARP executor: cut into shards for the smallest device, given
homes, restored from its latest checkpoint."""

from __future__ import annotations

import threading

from scheduler.sharp import ModelPlan, shard_model
from workers.checkpoint_events import resumed_event
from workers.checkpoints import CheckpointStore
from workers.sharp.homes import Homes
from workers.sharp.models import ModelRun
from workers.snapshot import JobSnapshot, RunStatus
from workers.zoo.data import make_data


def arrive(
    snap: JobSnapshot, budget: int, order: int, homes: Homes, lock: threading.Lock
) -> ModelRun:
    """``snap`` as a model of the executor: cut into shards that fit half of ``budget`` (the
    smallest device's), living where ``homes`` places them (heaviest models placed first
    by the caller), at the step of its latest checkpoint, whose block states become its
    ``origin``; LOST when no device is left (the control plane places it again)."""
    costs = sorted(snap.block_costs, key=lambda c: c.index)
    shards = shard_model(
        costs,
        budget,
        snap.batch_size // snap.micro_batches,
        micro_batches=snap.micro_batches,
        recompute=snap.recompute,
        precision=snap.precision,
    )
    plan = ModelPlan(snap.job_id, shards, snap.steps, order)
    data = make_data(snap.data, snap.seed, snap.allowed_factories)
    if not homes.live():
        model = ModelRun(snap, plan, data, [0] * len(shards), lock, status=RunStatus.LOST)
        model.error = "every device of this executor was lost; no device is left"
        return model
    model = ModelRun(snap, plan, data, homes.place(shards, snap.steps), lock)
    restorable = CheckpointStore(snap.checkpoint_root).restorable(snap.job_id)
    latest = restorable.info
    model.origin = restorable.blocks or None
    if latest is not None or restorable.skipped:
        model.record(resumed_event(restorable))
    if latest is not None:
        model.restart(latest.step)
        model.placed = model.done
        with lock:
            model.step = latest.step
    model.record(model.placement(homes.devices))
    return model
