"""Sweeps in the database: submit, read, list, cancel; and each trial's state as users see it.

A sweep's state uses the job states' names. The API creates sweeps QUEUED and cancels QUEUED
ones at once (RUNNING ones only get ``cancel_requested``); the controller's sweeper moves
QUEUED -> RUNNING when it starts the first trial and on to SUCCEEDED, FAILED or CANCELLED
(``SWEEP_TRANSITIONS``). A trial's state is its job's, or PRUNED when early stopping ended it.
"""

from __future__ import annotations

import math
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy.orm import Session

from shoal.service.auth import Principal
from shoal.service.db.models import Sweep, Trial, utcnow
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.holdings import check_priority
from shoal.service.idempotency import create_once
from shoal.service.jobs import JobConflict
from shoal.service.lifecycle import JobState
from shoal.service.sweepspec import AcceptedSweep

PRUNED = "PRUNED"
_PRIORITY = TypeAdapter(int)
"""A searched priority as a trial's job spec reads it (``5.0`` and ``"5"`` are 5)."""
SWEEP_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
}
"""A sweep runs once, and is never restarted (submit it again)."""


class SweepNotFound(LookupError):
    def __init__(self, sweep_id: str) -> None:
        super().__init__(f"no sweep {sweep_id!r}")


@dataclass(frozen=True)
class SweepPage:
    items: list[Sweep]
    total: int


def trial_state(trial: Trial) -> str:
    """What a trial is now: PRUNED once early stopping chose it, else its job's state."""
    return PRUNED if trial.pruned else trial.job.state


def move_sweep(sweep: Sweep, target: JobState, *, error: str | None = None) -> None:
    """Change a sweep's state, checked against ``SWEEP_TRANSITIONS``."""
    current = JobState(sweep.state)
    if target not in SWEEP_TRANSITIONS.get(current, frozenset()):
        raise JobConflict(f"a {current} sweep cannot become {target}")
    sweep.state = target.value
    if target.is_terminal:
        sweep.finished_at = utcnow()
        sweep.error = error


def submit_sweep(
    factory: SessionFactory,
    principal: Principal,
    accepted: AcceptedSweep,
    idempotency_key: str | None = None,
) -> tuple[Sweep, bool]:
    """Persist a new QUEUED sweep (the controller asks its trials and starts their jobs);
    returns (sweep, created). A retried key returns the first sweep."""
    spec = accepted.spec.model_dump(mode="json")

    def add(session: Session) -> Sweep:
        check_priority(session, principal, _priorities(accepted))
        sweep = Sweep(
            id=uuid.uuid4().hex,
            name=accepted.spec.name,
            owner_id=principal.user_id,
            spec=spec,
            state=JobState.QUEUED.value,
            max_trials=accepted.trials,
            idempotency_key=idempotency_key,
        )
        session.add(sweep)
        session.flush()
        return sweep

    def find(session: Session, key: str) -> Sweep | None:
        return session.scalar(
            sa.select(Sweep).where(
                Sweep.owner_id == principal.user_id, Sweep.idempotency_key == key
            )
        )

    return create_once(factory, idempotency_key, find, add, spec, "sweep")


def _priorities(accepted: AcceptedSweep) -> list[tuple[str, int]]:
    """The priorities the sweep's trials may get, by the field that gives them: the base
    job's, and the extremes of a search over ``priority`` (each already validated as one)."""
    found = [("base.priority", accepted.base.spec.priority)]
    searched = accepted.spec.space.get("priority")
    if searched is not None:
        found += [("space.priority", _PRIORITY.validate_python(v)) for v in searched.extremes()]
    return found


def _visible(principal: Principal) -> sa.ColumnElement[bool]:
    return sa.true() if principal.is_admin else Sweep.owner_id == principal.user_id


def get_sweep(session: Session, principal: Principal, sweep_id: str) -> Sweep:
    """The sweep, if the principal may see it; others' sweeps are as absent as unknown ones."""
    sweep = session.scalar(sa.select(Sweep).where(Sweep.id == sweep_id, _visible(principal)))
    if sweep is None:
        raise SweepNotFound(sweep_id)
    return sweep


def list_trials(session: Session, sweep_id: str) -> Sequence[Trial]:
    return session.scalars(
        sa.select(Trial).where(Trial.sweep_id == sweep_id).order_by(Trial.number)
    ).all()


def trials_of(session: Session, sweep_ids: Sequence[str]) -> dict[str, list[Trial]]:
    """The trials of several sweeps in one query, by sweep, in number order."""
    found: dict[str, list[Trial]] = defaultdict(list)
    query = sa.select(Trial).where(Trial.sweep_id.in_(sweep_ids)).order_by(Trial.number)
    for trial in session.scalars(query):
        found[trial.sweep_id].append(trial)
    return found


def ranked(trials: Iterable[Trial], direction: str) -> list[Trial]:
    """The completed trials (not pruned, a finite objective), best first (the earlier trial
    on a tie): what the API shows as best and what checkpoint retention keeps."""
    done = [
        t for t in trials if not t.pruned and t.objective is not None and math.isfinite(t.objective)
    ]
    sign = 1.0 if direction == "minimize" else -1.0
    return sorted(done, key=lambda t: (sign * (t.objective or 0.0), t.number))


def list_sweeps(session: Session, principal: Principal, *, limit: int, offset: int) -> SweepPage:
    query = sa.select(Sweep).where(_visible(principal))
    total = session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0
    items = session.scalars(
        query.order_by(Sweep.created_at.desc(), Sweep.id).limit(limit).offset(offset)
    ).all()
    return SweepPage(list(items), total)


def request_cancel(factory: SessionFactory, principal: Principal, sweep_id: str) -> Sweep:
    """Cancel a queued sweep at once; a running one's trials are cancelled by the controller."""
    with transaction(factory) as session:
        sweep = get_sweep(session, principal, sweep_id)
        state = JobState(sweep.state)
        if state.is_terminal:
            raise JobConflict(f"sweep {sweep_id} is already {state}; there is nothing to cancel")
        if state is JobState.QUEUED:
            move_sweep(sweep, JobState.CANCELLED, error=f"cancelled by {principal.name}")
        sweep.cancel_requested = True
        return sweep
