"""A job submitted over the API and trained to its end in this process, stored as the
controller stores a runner's report: for the tests of what a user does with a trained job."""

from __future__ import annotations

from typing import Any

from shoal.service.db.models import Job
from shoal.service.reports import persist_report
from shoal.service.snapshots import build_snapshot
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.snapshot import RunStatus
from tests.api.conftest import Api
from tests.factories import device, even_ranges, job_spec

JOBS = "/api/v1/jobs"


def trained(api: Api, user: str = "alice") -> tuple[str, dict[str, Any]]:
    """A job submitted over the API and trained to its end by a two-stage pipeline in this
    process, its metrics, events and checkpoints (steps 10 and 20) stored as the controller
    stores a runner's report."""
    spec = job_spec()
    submitted = api.client.post(JOBS, json=spec, headers=api.token(user))
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    root = api.settings.resolved_checkpoint_root
    with api.factory() as session, session.begin():
        job = session.get(Job, job_id)
        assert job is not None
        devices = [device(index=i) for i in range(2)]
        snap = build_snapshot(
            job, devices, even_ranges(job.num_blocks, 2), checkpoint_root=root, allowed_factories=()
        )
        trainer = Trainer(snap, LocalGroup)
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        persist_report(session, job, trainer.report(0))  # as the controller stores it
    return job_id, spec
