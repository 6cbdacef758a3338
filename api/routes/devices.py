"""``/api/v1/devices``: the device pool as the controller last saw it."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter

from api.deps import PrincipalDep, SessionDep
from api.schemas import DeviceList, DeviceOut
from service.db.models import DeviceRow, Job

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
