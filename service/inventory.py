"""The device inventory: read from Ray's nodes, with each device's overhead as measured
(the devices table), and mirrored into the devices table (new devices, lost ones, the job
holding each, the devices of nodes Ray is draining)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import sqlalchemy as sa

from shoal.scheduler.devices import (
    Device,
    InventoryError,
    NodeInfo,
    node_devices,
    planned_overhead_mb,
)
from shoal.service.db.models import DeviceRow, Job
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.holdings import ACTIVE_JOBS, drain, undrain

log = logging.getLogger(__name__)


def inventory(factory: SessionFactory, nodes: Sequence[NodeInfo]) -> list[Device]:
    """The devices of ``nodes``, each with the overhead stages are planned around: what a
    worker last measured on it, else the estimate (``planned_overhead_mb``)."""
    devices: list[Device] = []
    for node in nodes:
        try:
            devices.extend(node_devices(node))
        except InventoryError as exc:
            log.warning("node %s ignored: %s", node.node_id[:8], exc)
    with factory() as session:
        rows = session.execute(
            sa.select(DeviceRow.id, DeviceRow.overhead_mb).where(
                DeviceRow.id.in_([d.id for d in devices])
            )
        )
        measured = {device_id: overhead for device_id, overhead in rows}
    return [replace(d, overhead_mb=planned_overhead_mb(measured.get(d.id), d.gpu)) for d in devices]


def _set_if_changed(row: DeviceRow, **values: object) -> None:
    for key, value in values.items():
        if getattr(row, key) != value:
            setattr(row, key, value)


def sync_devices(
    factory: SessionFactory, devices: Sequence[Device], draining_nodes: set[str]
) -> None:
    """Mirror the inventory into the devices table: new devices, lost ones, the job
    holding each, and the devices of nodes Ray is draining (a preemption notice), which
    then count as drained like an admin's ``POST /devices/{id}/drain``."""
    with transaction(factory) as session:
        holders = {
            device_id: job.id
            for job in session.scalars(sa.select(Job).where(Job.state.in_(ACTIVE_JOBS)))
            for device_id in job.devices
        }
        rows = {row.id: row for row in session.scalars(sa.select(DeviceRow))}
        for device in devices:
            row = rows.pop(device.id, None)
            if row is None:
                row = DeviceRow(
                    id=device.id,
                    node_id=device.node_id,
                    kind=device.kind,
                    memory_mb=device.memory_mb,
                    gpu=device.gpu,
                    spot=device.spot,
                    state="alive",
                )
                session.add(row)
            elif row.state == "lost" and row.draining:  # back after being lost: a new node
                undrain(row)
            _set_if_changed(row, state="alive", job_id=holders.get(device.id))
            if device.node_id in draining_nodes and not row.draining:
                log.info(
                    "device %s: its node is draining; jobs will leave it",
                    device.id,
                    extra={"device_id": device.id},
                )
                drain(row, "its node is draining (Ray's drain: a preemption notice or a stop)")
        for row in rows.values():  # known before, absent now
            _set_if_changed(row, state="lost", job_id=holders.get(row.id))
