"""A checkpoint as a job's log tells it, the same for both engines: one written (with its
manifest, then the retention) and one resumed from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from shoal.workers.checkpoints import CheckpointStore, Restorable
from shoal.workers.snapshot import JobSnapshot, RunnerEvent


def resumed_event(restorable: Restorable) -> RunnerEvent:
    """The event of a run that restored a checkpoint, naming the newer ones it passed over
    as corrupt (or that found none usable and starts from its seed)."""
    latest, skipped = restorable.info, restorable.skipped
    step = latest.step if latest is not None else 0
    message = (
        f"resumed from the checkpoint at step {step}"
        if latest is not None
        else "no usable checkpoint: training from the start"
    )
    if skipped:
        passed = "; ".join(f"step {s}: {why}" for s, why in skipped)
        message += f" (passed over as unusable: {passed})"
    data: dict[str, Any] = {"step": step, "path": latest.path if latest is not None else None}
    if skipped:
        data["skipped"] = [{"step": s, "reason": why} for s, why in skipped]
    return RunnerEvent("resumed", step, message, data)


def write_checkpoint(
    store: CheckpointStore,
    snap: JobSnapshot,
    step: int,
    blocks: dict[int, Any],
    stages: list[dict[str, Any]],
    split: Sequence[int],
) -> RunnerEvent:
    """Write the job's checkpoint of ``step`` (every block's state, and the layout it ran
    under: ``stages`` rows and the replicas' micro-batch ``split``), apply the retention,
    and return the event that says so."""
    manifest = {
        "model": asdict(snap.model),
        "data": asdict(snap.data),
        "optimizer": asdict(snap.optimizer),
        "precision": snap.precision,
        "num_blocks": snap.num_blocks,
        "stages": stages,
        "replicas": len(split),
        "replica_micro_batches": list(split),
        "step": step,
        "data_cursor": step,
        "seed": snap.seed,
        "batch_size": snap.batch_size,
        "micro_batches": snap.micro_batches,
        "schedule": snap.schedule,
        "attempt": snap.attempt,
    }
    info = store.write(snap.job_id, step, blocks, manifest)
    deleted = store.retain(snap.job_id, snap.checkpoint_keep) if snap.checkpoint_keep else []
    return RunnerEvent(
        "checkpoint",
        step,
        f"checkpoint at step {step} ({info.nbytes} bytes)",
        {"step": step, "path": info.path, "bytes": info.nbytes, "deleted": list(deleted)},
    )
