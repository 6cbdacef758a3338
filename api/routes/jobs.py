"""``/api/v1/jobs``: submit, list, inspect, cancel and restart jobs; their metrics and events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

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
from shoal.api.schemas import (
    CheckpointList,
    CheckpointOut,
    EventList,
    EventOut,
    JobOut,
    JobPage,
    MetricList,
    MetricOut,
    ScheduleOut,
)
from shoal.api.spec_checks import SpecChecksDep
from shoal.service import jobs
from shoal.service.auth import Principal
from shoal.service.db.session import SessionFactory
from shoal.service.exports import export_model
from shoal.service.layouts import pipeline_schedule
from shoal.service.lifecycle import JobState
from shoal.service.specs import AcceptedSpec, JobSpec, check_memory, complete_job_spec
from shoal.service.traces import CodeRunner

router = APIRouter(prefix="/jobs", tags=["jobs"])

_READ = documented(401, 404, 422, 503)
_MAY_CONFLICT = documented(401, 404, 409, 422, 503)
JobId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="job id")]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobOut, "description": "the job a request with this Idempotency-Key made"},
        **documented(400, 401, 403, 409, 413, 422, 503),
    },
)
async def submit_job(
    spec: JobSpec,
    response: Response,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    checks: SpecChecksDep,
    code_checks: CodeChecksDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    """Queue a job. A retry with the same ``Idempotency-Key`` returns the same job (200).
    The spec is checked on a spec-check thread (503 with Retry-After when all are taken);
    one with uploaded ``code`` needs the code permission (403) and is checked in a Ray
    worker process."""
    if spec.code is not None:
        require_code_permission(principal)
    accepted = await checks.run(_accept_job, spec, settings.allowed_factories, factory, code_checks)
    job, created = await run_in_threadpool(
        jobs.submit_job, factory, principal, accepted, idempotency_key
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return await run_in_threadpool(_show_job, factory, principal, job.id)


def _accept_job(
    spec: JobSpec, allowed: list[str], factory: SessionFactory, code_runner: CodeRunner
) -> AcceptedSpec:
    """The job checked whole (its model traced) and against the largest device known."""
    accepted = complete_job_spec(spec, allowed, code_runner)
    check_memory(accepted, jobs.largest_device_mb(factory))
    return accepted


def _show_job(factory: SessionFactory, principal: Principal, job_id: str) -> JobOut:
    with factory() as session:
        return JobOut.of(jobs.show_job(session, principal, job_id))


@router.get("", response_model=JobPage, responses=documented(401, 422, 503))
def list_jobs(
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    state: Annotated[list[JobState] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_QUERY_INT)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_QUERY_INT)] = 0,
) -> ModelJSON:
    limit = min(limit, settings.max_page_size)
    with factory() as session:
        page = jobs.list_jobs(session, principal, states=state or (), limit=limit, offset=offset)
        items = [JobOut.of(j) for j in page.items]
    return ModelJSON(JobPage(items=items, total=page.total, limit=limit, offset=offset))


@router.get("/{job_id}", response_model=JobOut, responses=_READ)
def get_job(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> ModelJSON:
    with factory() as session:
        return ModelJSON(JobOut.of(jobs.show_job(session, principal, job_id)))


@router.post("/{job_id}/cancel", responses=_MAY_CONFLICT)
def cancel_job(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> JobOut:
    """Cancel: a queued job at once, a running one at its next step boundary."""
    jobs.request_cancel(factory, principal, job_id)
    with factory() as session:
        return JobOut.of(jobs.show_job(session, principal, job_id))


@router.post("/{job_id}/restart", responses=_MAY_CONFLICT)
def restart_job(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> JobOut:
    """Requeue a FAILED or CANCELLED job; it resumes from its latest checkpoint."""
    jobs.restart_job(factory, principal, job_id)
    with factory() as session:
        return JobOut.of(jobs.show_job(session, principal, job_id))


@router.get("/{job_id}/metrics", response_model=MetricList, responses=_READ)
def job_metrics(
    job_id: JobId,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    since_step: Annotated[int, Query(ge=-1, le=MAX_QUERY_INT)] = -1,
    limit: Annotated[int, Query(ge=1, le=MAX_QUERY_INT)] = 1000,
) -> ModelJSON:
    """Per-step loss, samples/s and per-stage compute/idle seconds after ``since_step``."""
    with factory() as session:
        rows = jobs.list_metrics(
            session, principal, job_id, since_step, min(limit, settings.max_page_size * 20)
        )
        return ModelJSON(MetricList(items=[MetricOut.of(r) for r in rows]))


@router.get("/{job_id}/events", response_model=EventList, responses=_READ)
def job_events(
    job_id: JobId,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    since_id: Annotated[int, Query(ge=0, le=MAX_QUERY_INT)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_QUERY_INT)] = 500,
) -> ModelJSON:
    """State changes, placements, checkpoints, ... with ids after ``since_id``."""
    with factory() as session:
        rows = jobs.list_events(
            session, principal, job_id, since_id, min(limit, settings.max_page_size)
        )
        return ModelJSON(EventList(items=[EventOut.of(r) for r in rows]))


@router.get("/{job_id}/schedule", response_model=ScheduleOut, responses=_MAY_CONFLICT)
def job_schedule(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> ModelJSON:
    """The 1F1B or GPipe schedule the job's stages run each mini-batch on its current
    partition: what each stage does in each time slot, and the bubble (409 before it is
    placed, and for a sweep trial trained by shard alternation)."""
    with factory() as session:
        return ModelJSON(
            ScheduleOut.of(pipeline_schedule(jobs.get_job(session, principal, job_id)))
        )


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=_READ)
def job_checkpoints(job_id: JobId, principal: PrincipalDep, factory: FactoryDep) -> ModelJSON:
    with factory() as session:
        rows = jobs.list_checkpoints(session, principal, job_id)
        return ModelJSON(CheckpointList(items=[CheckpointOut.of(r) for r in rows]))


@router.get(
    "/{job_id}/model",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "the model as one safetensors file",
        },
        **_MAY_CONFLICT,
    },
)
def job_model(
    job_id: JobId,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
    step: Annotated[
        int | None,
        Query(ge=0, le=MAX_QUERY_INT, description="a checkpoint's step (default: the latest)"),
    ] = None,
) -> FileResponse:
    """The job's model at a checkpoint as one safetensors file in single-process layout:
    every block's parameters and buffers named ``{block}.{name}``, as an ``nn.Sequential``
    of the blocks names them; the metadata holds the job, the step and the spec's model and
    data sections. 404 for a step with no checkpoint (the message lists those there are),
    409 before the first checkpoint."""
    with factory() as session:
        export = export_model(session, principal, job_id, step, settings.resolved_checkpoint_root)
    return FileResponse(
        export.path,
        media_type="application/octet-stream",
        filename=export.filename,
        background=BackgroundTask(export.path.unlink, missing_ok=True),
    )
