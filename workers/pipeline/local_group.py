"""Every stage of a job in this process, each call run when submitted: the worker group of
unit tests, and the reference the Ray group's peer-to-peer steps are tested against (it
has no links: its runner relays every activation)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.workers.error_text import one_line
from shoal.workers.pipeline.collective import sum_in_process
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import StageFailed, StageWorker
from shoal.workers.pipeline.worker_group import Handle, StageLost, own, wait_ready
from shoal.workers.snapshot import StagePlan


@dataclass(frozen=True, eq=False)
class _Done(Handle):
    value: Any = None
    error: Exception | None = None


class LocalGroup:
    """Every stage in this process, each call run when submitted (unit tests, no Ray)."""

    groups_replicas = False

    def __init__(self, plans: Sequence[StagePlan], setup: StageSetup) -> None:
        self._plans = list(plans)
        self._setup = setup
        self._workers: list[StageWorker] | None = [StageWorker(p, setup) for p in plans]
        wait_ready(self, self._plans, timeout=0.0)

    def regroup(self, plans: Sequence[StagePlan], keep: Mapping[int, int]) -> None:
        if self._workers is None:
            raise StageLost(plans[0].index, plans[0].device.id, "the group was shut down")
        old = self._workers
        self._workers = [
            old[keep[w]] if w in keep else StageWorker(p, self._setup) for w, p in enumerate(plans)
        ]
        self._plans = list(plans)
        wait_ready(self, self._plans, timeout=0.0)

    def prepare(self, plans: Sequence[StagePlan]) -> bool:
        """Nothing to start ahead: an in-process worker is built when ``regroup`` needs it."""
        return True

    def retire(self) -> None:
        """Nothing to stop: left-out in-process workers are dropped by ``regroup``."""

    def connect(self) -> str | None:
        return "an in-process group relays activations through its runner"

    def disconnect(self) -> None:
        """Nothing to forget: an in-process group has no links."""

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        if self._workers is None:
            plan = self._plans[stage]
            lost = StageLost(plan.index, plan.device.id, "the group was shut down")
            return _Done(stage, method, error=lost)
        failed = next((a.error for a in args if isinstance(a, _Done) and a.error), None)
        if failed is not None:
            return _Done(stage, method, error=failed)
        values = [a.value if isinstance(a, _Done) else a for a in args]
        try:
            return _Done(stage, method, value=self._workers[stage].call(method, *values))
        except (StageFailed, StageLost) as exc:
            return _Done(stage, method, error=exc)

    def all_reduce(self, workers: Sequence[int]) -> list[Handle]:
        first = self._plans[workers[0]]
        if self._workers is None:
            lost = StageLost(first.index, first.device.id, "the group was shut down")
            return [_Done(w, "all_reduce", error=lost) for w in workers]
        try:
            sum_in_process([self._workers[w].stage for w in workers])
        except StageFailed as exc:
            return [_Done(w, "all_reduce", error=exc) for w in workers]
        except Exception as exc:  # a boundary, as in StageWorker.call
            failed = StageFailed(first.index, "all_reduce", one_line(exc))
            return [_Done(w, "all_reduce", error=failed) for w in workers]
        return [_Done(w, "all_reduce", value=0.0) for w in workers]

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        done = [own(h, _Done) for h in handles]
        for handle in done:
            if handle.error is not None:
                raise handle.error
        return [h.value for h in done]

    def shutdown(self) -> None:
        self._workers = None
