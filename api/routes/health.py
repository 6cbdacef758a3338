"""``/healthz`` (the process is up) and ``/readyz`` (it can serve: database and controller)."""

from __future__ import annotations

import time

import sqlalchemy as sa
from fastapi import APIRouter, Request, status
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from shoal.api.deps import FactoryDep
from shoal.api.schemas import ReadyOut

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "not ready: see ``checks``"}},
)
def readyz(request: Request, factory: FactoryDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with factory() as session:
            session.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
    except SQLAlchemyError as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
    controller = request.app.state.controller
    if controller is not None:
        stale_after = max(10.0, 20 * request.app.state.settings.poll_interval_s)
        tick = controller.last_tick
        fresh = tick is not None and time.monotonic() - tick < stale_after
        checks["controller"] = "ok" if fresh else "no reconcile tick yet or stalled"
    ready = all(v == "ok" for v in checks.values())
    code = status.HTTP_200_OK if ready else status.HTTP_503_SERVICE_UNAVAILABLE
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks}, code)
