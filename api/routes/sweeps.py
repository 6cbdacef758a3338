"""``/api/v1/sweeps``: submit, list, inspect and cancel hyperparameter sweeps and their trials."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from sqlalchemy.orm import Session

from api.deps import FactoryDep, PrincipalDep, SessionDep, SettingsDep
from api.schemas import ErrorOut, SweepOut, SweepPage, SweepSummaryOut
from service import jobs, sweeps
from service.auth import Principal
from service.sweepspec import SweepSpec, complete_sweep_spec

router = APIRouter(prefix="/sweeps", tags=["sweeps"])

_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorOut},
    404: {"model": ErrorOut},
    409: {"model": ErrorOut},
    422: {"model": ErrorOut},
}
SweepId = Annotated[str, Path(max_length=64, description="sweep id")]


def _read(session: Session, principal: Principal, sweep_id: str) -> SweepOut:
    sweep = sweeps.get_sweep(session, principal, sweep_id)
    return SweepOut.of(sweep, sweeps.list_trials(session, sweep.id))


@router.post("", status_code=status.HTTP_201_CREATED, responses=_ERRORS)
def submit_sweep(
    spec: SweepSpec, principal: PrincipalDep, factory: FactoryDep, settings: SettingsDep
) -> SweepOut:
    """Queue a sweep. Every value the space can give is checked against the base job first,
    so a space that could make an invalid trial is refused (422, naming ``space.<path>``)."""
    accepted = complete_sweep_spec(
        spec, settings.allowed_factories, jobs.largest_device_mb(factory)
    )
    sweep = sweeps.submit_sweep(factory, principal, accepted)
    with factory() as session:
        return _read(session, principal, sweep.id)


@router.get("", responses=_ERRORS)
def list_sweeps(
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> SweepPage:
    """The caller's sweeps (an admin's: everyone's), newest first, without specs or trials."""
    limit = min(limit, settings.max_page_size)
    page = sweeps.list_sweeps(session, principal, limit=limit, offset=offset)
    trials = sweeps.trials_of(session, [s.id for s in page.items])
    items = [SweepSummaryOut.of(s, trials.get(s.id, [])) for s in page.items]
    return SweepPage(items=items, total=page.total, limit=limit, offset=offset)


@router.get("/{sweep_id}", responses=_ERRORS)
def get_sweep(sweep_id: SweepId, principal: PrincipalDep, session: SessionDep) -> SweepOut:
    """The sweep with every trial started so far and the best completed one."""
    return _read(session, principal, sweep_id)


@router.post("/{sweep_id}/cancel", responses=_ERRORS)
def cancel_sweep(sweep_id: SweepId, principal: PrincipalDep, factory: FactoryDep) -> SweepOut:
    """Cancel: a queued sweep at once; a running one's trials are cancelled by the controller."""
    sweeps.request_cancel(factory, principal, sweep_id)
    with factory() as session:
        return _read(session, principal, sweep_id)
