"""What a simulated run reports: its makespan against the lower bound, and how busy devices were.

Both engines (SHARP's in ``scheduler.simsharp``, the baselines' in ``scheduler.simgang``)
count into one ``Tally`` and turn it into a ``SimResult``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from shoal.scheduler.sharp import ModelId, ModelPlan
from shoal.scheduler.simcluster import Cluster, lower_bound
from shoal.scheduler.types import DeviceId


class SimulationError(ValueError):
    """The modelled cluster cannot finish the work; the message says which model and why."""


@dataclass(frozen=True)
class TaskRecord:
    """One task as it ran: dispatched at ``start_s`` (copy-in first, then compute), over at
    ``end_s``; ``completed`` False when its device was lost first (its work is redone)."""

    device: DeviceId
    model: ModelId
    position: int
    start_s: float
    end_s: float
    completed: bool
    device_bytes: int
    """Bytes on the device while it ran: its shard and any shard copied in beside it."""


@dataclass(frozen=True)
class SimResult:
    """One strategy's run. ``utilization`` is each device's useful compute over the
    makespan (copies, idle time and lost work excluded)."""

    strategy: str
    prefetch: bool
    makespan_s: float
    lower_bound_s: float
    utilization: tuple[tuple[DeviceId, float], ...]
    mean_utilization: float
    tasks: int
    lost_tasks: int
    exposed_transfer_s: float
    peak_bytes: tuple[tuple[DeviceId, int], ...]
    records: tuple[TaskRecord, ...] = ()
    trades: int = 0
    """Times a model took the place of one on a faster device (``trade_target``)."""

    @property
    def ratio(self) -> float:
        """Makespan over the lower bound (1.0 is ideal)."""
        return self.makespan_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0


@dataclass
class Tally:
    """A run's counters while it goes (mutable; private to the engines)."""

    devices: Sequence[DeviceId]
    record: bool = False
    makespan_s: float = 0.0
    tasks: int = 0
    lost_tasks: int = 0
    exposed_transfer_s: float = 0.0
    busy: dict[DeviceId, float] = field(default_factory=dict)
    peaks: dict[DeviceId, int] = field(default_factory=dict)
    records: list[TaskRecord] = field(default_factory=list)
    count: int = 0
    trades: int = 0

    def ran(self, task: TaskRecord, compute_s: float, copy_s: float) -> int:
        """A task ended: completed (its compute counts) or lost with its device. Its
        number, for ``undo``."""
        if task.completed:
            self.tasks += 1
            self.busy[task.device] = self.busy.get(task.device, 0.0) + compute_s
            self.exposed_transfer_s += copy_s
            self.makespan_s = max(self.makespan_s, task.end_s)
        else:
            self.lost_tasks += 1
        self.peaks[task.device] = max(self.peaks.get(task.device, 0), task.device_bytes)
        self.count += 1
        if self.record:
            self.records.append(task)
        return self.count - 1

    def undo(self, number: int, device: DeviceId, compute_s: float, copy_s: float) -> None:
        """A completed task's work was lost after all (its model rolled back past it)."""
        self.tasks -= 1
        self.lost_tasks += 1
        self.busy[device] -= compute_s
        self.exposed_transfer_s -= copy_s
        if self.record:
            self.records[number] = replace(self.records[number], completed=False)

    def result(
        self,
        strategy: str,
        prefetch: bool,
        cluster: Cluster,
        plans: Sequence[ModelPlan],
        truth: Mapping[ModelId, float] | None,
    ) -> SimResult:
        span = self.makespan_s
        use = tuple((d, self.busy.get(d, 0.0) / span if span > 0 else 0.0) for d in self.devices)
        return SimResult(
            strategy=strategy,
            prefetch=prefetch,
            makespan_s=span,
            lower_bound_s=lower_bound(cluster, plans, truth),
            utilization=use,
            mean_utilization=sum(u for _, u in use) / len(use) if use else 0.0,
            tasks=self.tasks,
            lost_tasks=self.lost_tasks,
            exposed_transfer_s=self.exposed_transfer_s,
            peak_bytes=tuple((d, self.peaks.get(d, 0)) for d in self.devices),
            records=tuple(self.records),
            trades=self.trades,
        )
