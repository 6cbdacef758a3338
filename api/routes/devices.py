"""``/api/v1/devices``: the device pool as the controller last saw it."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, status

from api.deps import FactoryDep, PrincipalDep, SessionDep
from api.schemas import DeviceList, DeviceOut
from service.db.models import DeviceRow, Job
from service.db.session import transaction

router = APIRouter(prefix="/devices", tags=["devices"])


@router.get("")
def list_devices(principal: PrincipalDep, session: SessionDep) -> DeviceList:
    """Every known device; the job on it is shown to its owner and to admins only."""
    rows = session.scalars(sa.select(DeviceRow).order_by(DeviceRow.node_id, DeviceRow.id)).all()
    own: set[str] = set()
    if not principal.is_admin:
        own = set(session.scalars(sa.select(Job.id).where(Job.owner_id == principal.user_id)))
    items = []
    for row in rows:
        out = DeviceOut.of(row)
        if not principal.is_admin and out.job_id not in own:
            out = out.model_copy(update={"job_id": "(another user's job)" if out.job_id else None})
        items.append(out)
    return DeviceList(items=items)


@router.post(
    "/{device_id}/drain",
    responses={403: {"description": "not an admin"}, 404: {"description": "no such device"}},
)
def drain_device(device_id: str, principal: PrincipalDep, factory: FactoryDep) -> DeviceOut:
    """Ask the job on the device to leave it (its blocks move to other devices at the next
    step boundary, no step lost) and place nothing more on it. Admins only; idempotent."""
    if not principal.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "draining a device needs an admin token")
    with transaction(factory) as session:
        row = session.get(DeviceRow, device_id)
        if row is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                f"no device {device_id!r}; GET /api/v1/devices lists them",
            )
        row.draining = True
        return DeviceOut.of(row)
