"""Each reported step's model FLOPs utilization (``scheduler.mfu``), from what the control
plane knows: the job's traced block costs, its precision and micro-batches, and the devices
the step ran on as the inventory and the workers' speed measurements describe them.

A step ran on its stages' devices (a tensor-parallel stage on its whole group); a SHARP
trial's step reports no stages and ran on its sweep's shared devices (the job's), so a sweep's
trials' MFUs add up to its executor's. A model that did not trace (a factory's that needs real
data) has no FLOP count and reports no MFU.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.scheduler.mfu import DevicePeak, mfu, peak_flops, step_flops
from shoal.scheduler.profile import BlockCost
from shoal.service.db.models import DeviceRow, Job
from shoal.workers.snapshot import StepMetrics


def _step_devices(job: Job, metric: StepMetrics) -> list[str]:
    ids = [d for s in metric.stages for d in (s.device_id, *s.tensor_devices)]
    ids = ids or [str(d) for d in job.devices]
    return list(dict.fromkeys(ids))


def step_mfus(session: Session, job: Job, metrics: Sequence[StepMetrics]) -> list[float | None]:
    """The MFU of each of ``metrics`` (None where it cannot be known), in their order."""
    if job.block_costs is None or not metrics:
        return [None] * len(metrics)
    costs = [BlockCost(**cost) for cost in job.block_costs]
    flops = step_flops(costs, int(job.spec.get("micro_batches", 1)))
    precision = str(job.spec.get("precision", "fp32"))
    wanted = {d for m in metrics for d in _step_devices(job, m)}
    rows = session.scalars(sa.select(DeviceRow).where(DeviceRow.id.in_(wanted))).all()
    peaks = {
        row.id: peak_flops(DevicePeak(row.kind, row.gpu, row.speed_gflops), precision)
        for row in rows
    }
    return [
        mfu(flops, m.step_time_s, [peaks.get(d) for d in _step_devices(job, m)]) for m in metrics
    ]
