"""Scratch data for the control-plane benchmarks: one user's jobs in every state, fast.

Jobs are inserted straight through ``service.jobs.add_job`` in one transaction (no HTTP, no
controller), so seeding 500 jobs takes a fraction of a second; every job carries the spec
``SPEC``, validated once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from shoal.service.auth import Principal, issue_token
from shoal.service.db.models import User
from shoal.service.db.session import make_engine, make_session_factory, migrate, transaction
from shoal.service.jobs import add_job
from shoal.service.lifecycle import JobState
from shoal.service.specs import validate_job_spec

SPEC: dict[str, Any] = {
    "name": "bench-job",
    "model": {"builtin": "mlp", "config": {"hidden": 32, "layers": 2}},
    "data": {"builtin": "digits", "config": {}},
    "optimizer": {"name": "adam", "lr": 0.01},
    "batch_size": 32,
    "steps": 1000,
}
STATES = [s.value for s in JobState]
USER = "bench"


@dataclass(frozen=True)
class Seeded:
    """What ``fill`` wrote: the user's tokens and its jobs' ids, in insertion order."""

    tokens: list[str]
    job_ids: list[str]

    @property
    def token(self) -> str:
        return self.tokens[0]


def fill(database: str, jobs: int, *, admin: bool, tokens: int = 1) -> Seeded:
    """Migrate ``database`` and give the user ``bench`` (an admin if ``admin``) ``tokens``
    tokens and ``jobs`` jobs, cycling through every state, with steps, losses and throughputs
    past QUEUED. (The API rate-limits each token: a load test needs one per client.)"""
    migrate(database)
    engine = make_engine(database)
    try:
        factory = make_session_factory(engine)
        accepted = validate_job_spec(SPEC, [])
        rng = random.Random(0)
        ids = []
        with transaction(factory) as session:
            secrets = [issue_token(session, USER, admin=admin) for _ in range(tokens)]
            user = session.scalars(sa.select(User).where(User.name == USER)).one()
            who = Principal(user.id, user.name, user.is_admin)
            for i in range(jobs):
                job = add_job(session, who, accepted)
                job.name = f"bench-{i:04d}"
                job.state = STATES[i % len(STATES)]
                if job.state != JobState.QUEUED.value:
                    job.step = rng.randrange(1, job.steps)
                    job.last_loss = rng.uniform(0.05, 2.5)
                    job.last_samples_per_s = rng.uniform(100.0, 5000.0)
                ids.append(job.id)
        return Seeded(secrets, ids)
    finally:
        engine.dispose()
