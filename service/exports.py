"""A job's trained model out of its checkpoints (``GET /api/v1/jobs/{id}/model``, ``shoal
export``): one checkpoint's blocks written as a single safetensors file in single-process
layout (``workers.model_file``), read from the store the control plane writes to."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.auth import Principal
from shoal.service.db.models import Checkpoint
from shoal.service.jobs import JobConflict, get_job
from shoal.service.specs import JobSpec
from shoal.workers.checkpoints import CheckpointError, CheckpointStore
from shoal.workers.model_file import write_model_file


class CheckpointNotFound(LookupError):
    """The job has no checkpoint at the step asked for (HTTP 404)."""


@dataclass(frozen=True)
class ModelExport:
    """A model file written for one request: ``path`` (the caller removes it once sent)
    and the name to offer it as."""

    path: Path
    filename: str
    step: int


def export_model(
    session: Session,
    principal: Principal,
    job_id: str,
    step: int | None,
    checkpoint_root: str,
    workdir: str | None = None,
) -> ModelExport:
    """Job ``job_id``'s model at its checkpoint of ``step`` (None: the latest) as a file in
    ``workdir`` (the system's temporary directory by default)."""
    job = get_job(session, principal, job_id)
    steps = list(
        session.scalars(
            sa.select(Checkpoint.step).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)
        )
    )
    if not steps:
        raise JobConflict(
            f"job {job.id} has no checkpoint yet; a model is exported from a checkpoint"
            " (spec checkpoint.every_steps, and always at the last step)"
        )
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise CheckpointNotFound(
            f"job {job.id} has no checkpoint at step {chosen}; its checkpoints: {steps}"
        )
    try:
        _, blocks = CheckpointStore(checkpoint_root).read(job.id, chosen)
    except CheckpointError as exc:
        raise JobConflict(
            f"the checkpoint of job {job.id} at step {chosen} cannot be read ({exc}); export"
            " another step"
        ) from None
    spec = JobSpec.model_validate(job.spec)
    handle, name = tempfile.mkstemp(prefix="shoal-model-", suffix=".safetensors", dir=workdir)
    path = Path(name)
    try:
        os.close(handle)  # the writer replaces the file whole
        write_model_file(
            path,
            blocks,
            job_id=job.id,
            step=chosen,
            model=spec.model.model_dump(mode="json", exclude_none=True),
            data=spec.data.model_dump(mode="json", exclude_none=True),
        )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return ModelExport(path, f"{job.id}-step-{chosen}.safetensors", chosen)
