"""The database schema, in one place. The control plane is the only writer."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite drops the zone)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime; use service.db.models.utcnow()")
        return value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: sa.JSON, list[Any]: sa.JSON}


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    max_jobs: Mapped[int | None] = mapped_column(default=None)
    """Jobs the user may run at once; None: the installation's default."""
    max_devices: Mapped[int | None] = mapped_column(default=None)
    """Devices the user's jobs may hold at once; None: the installation's default."""
    max_priority: Mapped[int | None] = mapped_column(default=None)
    """The highest priority the user may give a job; None: the default priority (0), so a
    priority above the default is an admin's grant."""
    may_upload_code: Mapped[bool] = mapped_column(default=False)
    """Whether the user may send code of their own with a job (it runs on the cluster's
    nodes); an admin's grant, off by default. Admins always may."""


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(sa.ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    prefix: Mapped[str] = mapped_column(sa.String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        sa.UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency"),
        sa.Index("ix_jobs_state_priority", "state", "priority", "created_at"),
        # Listings, newest first: everyone's (an admin's) and one owner's.
        sa.Index("ix_jobs_created", "created_at", "id"),
        sa.Index("ix_jobs_owner_created", "owner_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("users.id"), index=True)
    owner: Mapped[User] = relationship(lazy="joined")
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(sa.String(16))
    priority: Mapped[int] = mapped_column(default=0)
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    step: Mapped[int] = mapped_column(default=0)
    steps: Mapped[int]
    num_blocks: Mapped[int]
    last_loss: Mapped[float | None] = mapped_column(default=None)
    last_samples_per_s: Mapped[float | None] = mapped_column(default=None)
    last_mfu: Mapped[float | None] = mapped_column(default=None)
    """The latest step's model FLOPs utilization (``service.utilization``); None: unknown."""
    devices: Mapped[list[Any]] = mapped_column(default=list)
    partition: Mapped[list[Any]] = mapped_column(default=list)
    # Per block, the traced cost at submission (scheduler.profile.BlockCost fields); None when
    # the model does not trace, and blocks then cost the same.
    block_costs: Mapped[list[Any] | None] = mapped_column(default=None)
    # The latest step's per-stage timings (the job_metrics row's ``stages``); None before it.
    stage_times: Mapped[list[Any] | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(sa.Text, default=None)
    attempt: Mapped[int] = mapped_column(default=0)
    pool: Mapped[str | None] = mapped_column(sa.String(32), default=None)
    """The sweep whose SHARP executor trains this job (a trial); None: a runner of its own."""
    runner_cursor: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(sa.String(32))
    message: Mapped[str] = mapped_column(sa.Text)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class JobMetric(Base):
    __tablename__ = "job_metrics"

    job_id: Mapped[str] = mapped_column(
        sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(primary_key=True)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    loss: Mapped[float]
    samples_per_s: Mapped[float]
    step_time_s: Mapped[float]
    stages: Mapped[list[Any]] = mapped_column(default=list)
    grad_norm: Mapped[float | None] = mapped_column(default=None)
    """The L2 norm of the step's whole-model gradient before clipping (None in rows written
    before the runner reported it)."""
    mfu: Mapped[float | None] = mapped_column(default=None)
    """The step's model FLOPs utilization (``service.utilization``); None: unknown."""


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(
        sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(sa.Text)
    nbytes: Mapped[int] = mapped_column(sa.BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeviceRow(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    node_id: Mapped[str] = mapped_column(sa.String(64))
    kind: Mapped[str] = mapped_column(sa.String(64))
    memory_mb: Mapped[int]
    gpu: Mapped[bool]
    spot: Mapped[bool]
    state: Mapped[str] = mapped_column(sa.String(16))
    speed_gflops: Mapped[float | None] = mapped_column(default=None)
    overhead_mb: Mapped[int | None] = mapped_column(default=None)
    """What the device held for a worker before its stage, as the last worker measured it
    (``workers.device_memory``); stages are planned in the rest."""
    job_id: Mapped[str | None] = mapped_column(sa.String(32), default=None)
    draining: Mapped[bool] = mapped_column(default=False, server_default=sa.false())
    """Jobs must leave it and none is placed on it (cleared by an admin, or when the device
    comes back after being lost: a new node)."""
    drain_reason: Mapped[str | None] = mapped_column(sa.String(500), default=None)
    """Why it is draining: an admin drained it, its node had a preemption notice, or a
    worker failed on it (``holdings.DRAIN_REASON_CHARS`` at most)."""
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Sweep(Base):
    """A hyperparameter sweep: its spec, its state (the job states' names) and progress."""

    __tablename__ = "sweeps"
    __table_args__ = (
        sa.Index("uq_sweeps_owner_idempotency", "owner_id", "idempotency_key", unique=True),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("users.id"), index=True)
    owner: Mapped[User] = relationship(lazy="joined")
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    max_trials: Mapped[int]
    """How many trials the sweep runs (``max_trials``, or a smaller grid's size)."""
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    devices: Mapped[list[Any]] = mapped_column(default=list)
    """The devices its SHARP executor holds (none before it is placed and after it ends)."""
    error: Mapped[str | None] = mapped_column(sa.Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class Trial(Base):
    """One trial of a sweep: the parameters it was given and the job that trains them."""

    __tablename__ = "trials"

    sweep_id: Mapped[str] = mapped_column(
        sa.ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("jobs.id"), unique=True)
    job: Mapped[Job] = relationship(lazy="joined")
    params: Mapped[dict[str, Any]]
    intermediate: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """The objective at every reported step (keys are steps, as strings)."""
    objective: Mapped[float | None] = mapped_column(default=None)
    pruned: Mapped[bool] = mapped_column(default=False)
    told: Mapped[bool] = mapped_column(default=False)
    """Its outcome has been given to the sampler (it is finished for the sweep)."""
    checkpoints_dropped: Mapped[bool] = mapped_column(default=False)
