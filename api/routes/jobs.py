"""``/api/v1/jobs``: submit, list, inspect, cancel and restart jobs; their metrics and events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status

from api.deps import FactoryDep, PrincipalDep, SessionDep, SettingsDep
from api.schemas import (
    CheckpointList,
    CheckpointOut,
    ErrorOut,
    EventList,
    EventOut,
    JobOut,
    JobPage,
    MetricList,
    MetricOut,
)
from service import jobs
from service.lifecycle import JobState
from service.specs import JobSpec, check_memory, complete_job_spec

router = APIRouter(prefix="/jobs", tags=["jobs"])

_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorOut},
    404: {"model": ErrorOut},
    409: {"model": ErrorOut},
    422: {"model": ErrorOut},
}
JobId = Annotated[str, Path(max_length=64, description="job id")]


@router.post("", status_code=status.HTTP_201_CREATED, responses=_ERRORS)
def submit_job(
    spec: JobSpec,
    response: Response,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    """Queue a job. A retry with the same ``Idempotency-Key`` returns the same job (200)."""
    accepted = complete_job_spec(spec, settings.allowed_factories)
    check_memory(accepted, jobs.largest_device_mb(factory))
    job, created = jobs.submit_job(factory, principal, accepted, idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    with factory() as session:
        return JobOut.of(jobs.get_job(session, principal, job.id))


@router.get("", responses=_ERRORS)
def list_jobs(
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    state: Annotated[list[JobState] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobPage:
    limit = min(limit, settings.max_page_size)
    page = jobs.list_jobs(session, principal, states=state or (), limit=limit, offset=offset)
    return JobPage(
        items=[JobOut.of(j) for j in page.items], total=page.total, limit=limit, offset=offset
    )


@router.get("/{job_id}", responses=_ERRORS)
def get_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> JobOut:
    return JobOut.of(jobs.get_job(session, principal, job_id))


@router.post("/{job_id}/cancel", responses=_ERRORS)
def cancel_job(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> JobOut:
    """Cancel: a queued job at once, a running one at its next step boundary."""
    jobs.request_cancel(factory, principal, job_id)
    with factory() as session:
        return JobOut.of(jobs.get_job(session, principal, job_id))


@router.post("/{job_id}/restart", responses=_ERRORS)
def restart_job(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> JobOut:
    """Requeue a FAILED or CANCELLED job; it resumes from its latest checkpoint."""
    jobs.restart_job(factory, principal, job_id)
    with factory() as session:
        return JobOut.of(jobs.get_job(session, principal, job_id))


@router.get("/{job_id}/metrics", responses=_ERRORS)
def job_metrics(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    since_step: Annotated[int, Query(ge=-1)] = -1,
    limit: Annotated[int, Query(ge=1)] = 1000,
) -> MetricList:
    """Per-step loss, samples/s and per-stage compute/idle seconds after ``since_step``."""
    rows = jobs.list_metrics(
        session, principal, job_id, since_step, min(limit, settings.max_page_size * 20)
    )
    return MetricList(items=[MetricOut.of(r) for r in rows])


@router.get("/{job_id}/events", responses=_ERRORS)
def job_events(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    since_id: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1)] = 500,
) -> EventList:
    """State changes, placements, checkpoints, ... with ids after ``since_id``."""
    rows = jobs.list_events(
        session, principal, job_id, since_id, min(limit, settings.max_page_size)
    )
    return EventList(items=[EventOut.of(r) for r in rows])


@router.get("/{job_id}/checkpoints", responses=_ERRORS)
def job_checkpoints(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> CheckpointList:
    rows = jobs.list_checkpoints(session, principal, job_id)
    return CheckpointList(items=[CheckpointOut.of(r) for r in rows])
