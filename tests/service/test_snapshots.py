"""A job's snapshot carries what its spec asked for to the runner and the stages."""

from __future__ import annotations

import pytest

from shoal.service.db.models import Job
from shoal.service.snapshots import build_snapshot
from shoal.service.specs import validate_job_spec
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.snapshot import JobSnapshot
from shoal.workers.zoo.data import make_data
from tests.factories import device, job_spec

pytestmark = pytest.mark.unit


def snapshot_of(**overrides: object) -> JobSnapshot:
    accepted = validate_job_spec(job_spec(**overrides), [])
    job = Job(id="job-1", spec=accepted.spec.model_dump(mode="json"), attempt=1, num_blocks=3)
    return build_snapshot(
        job, [device(index=0), device(index=1)], [(0, 1), (1, 3)], checkpoint_root="/tmp/x",
        allowed_factories=(),
    )  # fmt: skip


def test_clipping_and_precision_reach_the_stages() -> None:
    snap = snapshot_of(
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9, "clip_grad_norm": 1.5},
        precision="bf16",
    )
    assert snap.optimizer.clip_grad_norm == 1.5
    assert snap.optimizer.params == {"momentum": 0.9, "weight_decay": 0.0}
    assert snap.precision == "bf16"
    setup = StageSetup.of(snap, make_data(snap.data, 0).meta)
    assert (setup.optimizer.clip_grad_norm, setup.precision) == (1.5, "bf16")


def test_by_default_nothing_is_clipped_and_all_is_fp32() -> None:
    snap = snapshot_of()
    assert (snap.optimizer.clip_grad_norm, snap.precision) == (None, "fp32")
