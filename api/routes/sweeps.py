"""``/api/v1/sweeps``: submit, list, inspect and cancel hyperparameter sweeps and their trials."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from shoal.api.deps import (
    ID_PATTERN,
    MAX_QUERY_INT,
    CodeChecksDep,
    FactoryDep,
    PrincipalDep,
    SettingsDep,
    require_code_permission,
)
from shoal.api.errors import documented
from shoal.api.responses import ModelJSON
from shoal.api.schemas import SweepOut, SweepPage, SweepSummaryOut
from shoal.api.spec_checks import SpecChecksDep
from shoal.service import jobs, sweeps
from shoal.service.auth import Principal
from shoal.service.db.session import SessionFactory
from shoal.service.sweepspec import AcceptedSweep, SweepSpec, complete_sweep_spec
from shoal.service.traces import CodeRunner

router = APIRouter(prefix="/sweeps", tags=["sweeps"])

SweepId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="sweep id")]


def _read(session: Session, principal: Principal, sweep_id: str) -> SweepOut:
    sweep = sweeps.get_sweep(session, principal, sweep_id)
    return SweepOut.of(sweep, sweeps.list_trials(session, sweep.id))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {
            "model": SweepOut,
            "description": "the sweep a request with this Idempotency-Key made",
        },
        **documented(400, 401, 403, 409, 413, 422, 503),
    },
)
async def submit_sweep(
    spec: SweepSpec,
    response: Response,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    checks: SpecChecksDep,
    code_checks: CodeChecksDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> SweepOut:
    """Queue a sweep. Every value the space can give is checked against the base job first,
    so a space that could make an invalid trial is refused (422, naming ``space.<path>``);
    the check runs on a spec-check thread (503 with Retry-After when all are taken).
    A retry with the same ``Idempotency-Key`` returns the same sweep (200). A base job with
    uploaded ``code`` needs the code permission (403)."""
    if spec.base.code is not None:
        require_code_permission(principal)
    accepted = await checks.run(
        _accept_sweep, spec, settings.allowed_factories, factory, code_checks
    )
    sweep, created = await run_in_threadpool(
        sweeps.submit_sweep, factory, principal, accepted, idempotency_key
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return await run_in_threadpool(_show_sweep, factory, principal, sweep.id)


def _accept_sweep(
    spec: SweepSpec, allowed: list[str], factory: SessionFactory, code_runner: CodeRunner
) -> AcceptedSweep:
    """The sweep checked whole (every value of its space) against the largest device known."""
    return complete_sweep_spec(spec, allowed, jobs.largest_device_mb(factory), code_runner)


def _show_sweep(factory: SessionFactory, principal: Principal, sweep_id: str) -> SweepOut:
    with factory() as session:
        return _read(session, principal, sweep_id)


@router.get("", response_model=SweepPage, responses=documented(401, 422, 503))
def list_sweeps(
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=MAX_QUERY_INT)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_QUERY_INT)] = 0,
) -> ModelJSON:
    """The caller's sweeps (an admin's: everyone's), newest first, without specs or trials."""
    limit = min(limit, settings.max_page_size)
    with factory() as session:
        page = sweeps.list_sweeps(session, principal, limit=limit, offset=offset)
        trials = sweeps.trials_of(session, [s.id for s in page.items])
        items = [SweepSummaryOut.of(s, trials.get(s.id, [])) for s in page.items]
        return ModelJSON(SweepPage(items=items, total=page.total, limit=limit, offset=offset))


@router.get("/{sweep_id}", response_model=SweepOut, responses=documented(401, 404, 422, 503))
def get_sweep(sweep_id: SweepId, principal: PrincipalDep, factory: FactoryDep) -> ModelJSON:
    """The sweep with every trial started so far and the best completed one."""
    with factory() as session:
        return ModelJSON(_read(session, principal, sweep_id))


@router.post("/{sweep_id}/cancel", responses=documented(401, 404, 409, 422, 503))
def cancel_sweep(sweep_id: SweepId, principal: PrincipalDep, factory: FactoryDep) -> SweepOut:
    """Cancel: a queued sweep at once; a running one's trials are cancelled by the controller."""
    sweeps.request_cancel(factory, principal, sweep_id)
    with factory() as session:
        return _read(session, principal, sweep_id)
