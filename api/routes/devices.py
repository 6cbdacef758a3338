"""``/api/v1/devices``: the device pool as the controller last saw it."""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, status
from sqlalchemy.orm import Session

from shoal.api.deps import ID_PATTERN, FactoryDep, PrincipalDep
from shoal.api.errors import documented
from shoal.api.responses import ModelJSON
from shoal.api.schemas import DeviceList, DeviceOut
from shoal.service.auth import Principal
from shoal.service.db.models import DeviceRow, Job
from shoal.service.db.session import transaction
from shoal.service.holdings import ACTIVE_JOBS, drain, undrain
from shoal.service.layouts import planned_memory

router = APIRouter(prefix="/devices", tags=["devices"])


@router.get("", response_model=DeviceList, responses=documented(401, 503))
def list_devices(principal: PrincipalDep, factory: FactoryDep) -> ModelJSON:
    """Every known device; the job on it is shown to its owner and to admins only."""
    with factory() as session:
        rows = session.scalars(sa.select(DeviceRow).order_by(DeviceRow.node_id, DeviceRow.id)).all()
        holding = session.scalars(sa.select(Job).where(Job.state.in_(ACTIVE_JOBS))).all()
        memory = planned_memory(holding)
        own: set[str] = set()
        if not principal.is_admin:
            own = set(session.scalars(sa.select(Job.id).where(Job.owner_id == principal.user_id)))
    items = []
    for row in rows:
        out = DeviceOut.of(row, memory.get(row.id))
        if not principal.is_admin and out.job_id not in own:
            out = out.model_copy(update={"job_id": "(another user's job)" if out.job_id else None})
        items.append(out)
    return ModelJSON(DeviceList(items=items))


DeviceIdPath = Annotated[str, Path(pattern=ID_PATTERN, description="device id")]


@router.post(
    "/{device_id}/drain",
    responses=documented(401, 403, 404, 422, 503),
)
def drain_device(
    device_id: DeviceIdPath, principal: PrincipalDep, factory: FactoryDep
) -> DeviceOut:
    """Ask the job on the device to leave it (its blocks move to other devices at the next
    step boundary, no step lost) and place nothing more on it. Admins only; idempotent."""
    with transaction(factory) as session:
        row = _admins_device(session, device_id, principal, "draining")
        drain(row, f"drained by {principal.name}")
        return DeviceOut.of(row)


@router.delete(
    "/{device_id}/drain",
    responses=documented(401, 403, 404, 422, 503),
)
def undrain_device(
    device_id: DeviceIdPath, principal: PrincipalDep, factory: FactoryDep
) -> DeviceOut:
    """Place jobs on the device again: the end of a drain (an admin's, or one the control
    plane began because a worker failed on the device, once it is mended). A node Ray is
    still draining is drained again at the next look. Admins only; idempotent."""
    with transaction(factory) as session:
        row = _admins_device(session, device_id, principal, "undraining")
        undrain(row)
        return DeviceOut.of(row)


def _admins_device(session: Session, device_id: str, principal: Principal, what: str) -> DeviceRow:
    if not principal.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"{what} a device needs an admin token")
    row = session.get(DeviceRow, device_id)
    if row is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no device {device_id!r}; GET /api/v1/devices lists them",
        )
    return row
