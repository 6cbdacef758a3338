"""The job runner: trains one job through a worker group, step by step, and reports progress.

``Trainer`` is the engine, plain Python: it restores the job's latest checkpoint, then for
every step submits each stage's schedule actions (GPipe or 1F1B, ``scheduler.schedules``)
to the group, applies the step on every stage, records ``StepMetrics`` and ``RunnerEvent``s,
and writes checkpoints. ``JobRunner`` is what ``workers.launch`` runs as the job's detached
Ray actor: ``run`` trains (one thread), ``poll`` and ``cancel`` answer from the others.

Steps are counted as completed optimizer updates: step k's metrics and a checkpoint at step
k describe the model after k updates, which consumed data batches 0..k-1 (the data cursor is
the step). Only the thread in ``run`` submits to the stages; that single submitter is what
keeps each stage's calls in schedule order (see ``workers.group``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from itertools import pairwise
from typing import Any

from torch import Tensor

from scheduler.schedules import Action, Op, build, submission_order
from workers.checkpoints import CheckpointInfo, CheckpointStore
from workers.group import GroupFactory, RayGroup, StageFailed, StageLost, WorkerGroup
from workers.snapshot import (
    JobSnapshot,
    RunnerEvent,
    RunnerReport,
    RunStatus,
    StagePlan,
    StageTiming,
    StepMetrics,
)
from workers.stage import StageSetup
from workers.zoo.data import DataSource, make_data

DEFAULT_STEP_TIMEOUT_S = 600.0
"""How long one step may take before the runner gives up on its stages."""


class PlanError(ValueError):
    """The snapshot's stages do not form a pipeline over the model's blocks."""


def check_plans(stages: Sequence[StagePlan], num_blocks: int) -> list[StagePlan]:
    """The stage plans in order, if they cover blocks [0, num_blocks) contiguously."""
    plans = sorted(stages, key=lambda p: p.index)
    if [p.index for p in plans] != list(range(len(plans))) or not plans:
        raise PlanError(f"stage indices must be 0..p-1, got {[p.index for p in stages]}")
    bounds = [p.blocks for p in plans]
    contiguous = all(a[1] == b[0] for a, b in pairwise(bounds))
    if bounds[0][0] != 0 or bounds[-1][1] != num_blocks or not contiguous:
        raise PlanError(f"stage block ranges {bounds} must cover [0, {num_blocks}) in order")
    return plans


class Trainer:
    """Trains ``snapshot`` on the group ``make_group`` builds; thread-safe ``report``/``cancel``."""

    def __init__(
        self,
        snapshot: JobSnapshot,
        make_group: GroupFactory,
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.snapshot = snapshot
        self._make_group = make_group
        self._timeout = step_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._log: list[StepMetrics | RunnerEvent] = []
        self._status = RunStatus.RUNNING
        self._error: str | None = None
        self._step = 0

    # ------------------------------------------------------------------ thread-safe API

    def cancel(self) -> None:
        """Stop at the next step boundary."""
        self._cancelled.set()

    @property
    def status(self) -> RunStatus:
        return self._status

    def report(self, cursor: int) -> RunnerReport:
        """Metrics and events recorded after ``cursor`` (0 = from the start), and the status."""
        with self._lock:
            news = self._log[max(0, cursor) :]
            return RunnerReport(
                status=self._status,
                cursor=len(self._log),
                step=self._step,
                metrics=tuple(m for m in news if isinstance(m, StepMetrics)),
                events=tuple(e for e in news if isinstance(e, RunnerEvent)),
                error=self._error,
            )

    def _record(self, item: StepMetrics | RunnerEvent) -> None:
        with self._lock:
            self._log.append(item)
            if isinstance(item, StepMetrics):
                self._step = item.step

    def _finish(self, status: RunStatus, error: str | None = None) -> RunStatus:
        with self._lock:
            self._status, self._error = status, error
        return status

    # ------------------------------------------------------------------------- training

    def run(self) -> RunStatus:
        """Train to ``snapshot.steps``; never raises: failures become FAILED with a reason."""
        group: WorkerGroup | None = None
        try:
            snap = self.snapshot
            plans = check_plans(snap.stages, snap.num_blocks)
            order = submission_order(build(snap.schedule, len(plans), snap.micro_batches))
            data = make_data(snap.data, snap.seed, snap.allowed_factories)
            store = CheckpointStore(snap.checkpoint_root)
            group = self._make_group(plans, StageSetup.of(snap, data.meta))
            latest = store.latest(snap.job_id)
            self._announce(group, plans, latest.step if latest else 0)
            start = self._restore(group, plans, store, latest) if latest else 0
            for step in range(start, snap.steps):
                if self._cancelled.is_set():
                    return self._finish(RunStatus.CANCELLED)
                self._record(self._train_step(group, plans, order, data, step))
                done = step + 1
                if done == snap.steps or (
                    snap.checkpoint_every > 0 and done % snap.checkpoint_every == 0
                ):
                    self._checkpoint(group, plans, store, done)
            return self._finish(RunStatus.SUCCEEDED)
        except (StageLost, StageFailed) as exc:  # their message names the stage and device
            return self._finish(RunStatus.FAILED, str(exc))
        except Exception as exc:  # the run's boundary: whatever broke, the job reports why
            text = " ".join(str(exc).split())
            return self._finish(RunStatus.FAILED, f"{type(exc).__name__}: {text}")
        finally:
            if group is not None:
                group.shutdown()

    def _call_all(self, group: WorkerGroup, method: str, *args: Any) -> list[Any]:
        count = len(self.snapshot.stages)
        return group.get([group.submit(s, method, *args) for s in range(count)], self._timeout)

    def _announce(self, group: WorkerGroup, plans: list[StagePlan], step: int) -> None:
        sizes = self._call_all(group, "nbytes")
        stages = [
            {
                "stage": p.index,
                "device_id": p.device.id,
                "kind": p.device.kind,
                "node_id": p.device.node_id,
                "blocks": list(p.blocks),
                "bytes": size,
            }
            for p, size in zip(plans, sizes, strict=True)
        ]
        ranges = ", ".join(f"{p.blocks[0]}-{p.blocks[1] - 1}@{p.device.id}" for p in plans)
        self._record(
            RunnerEvent("placement", step, f"{len(plans)} stages: {ranges}", {"stages": stages})
        )
        # One device at a time: concurrent benchmarks on shared cores would measure contention.
        for p in plans:
            (gflops,) = group.get([group.submit(p.index, "measure_speed")], self._timeout)
            self._record(
                RunnerEvent(
                    "device_speed",
                    step,
                    f"device {p.device.id} ({p.device.kind}): {gflops:.2f} GFLOP/s",
                    {"device_id": p.device.id, "stage": p.index, "gflops": gflops},
                )
            )

    def _restore(
        self,
        group: WorkerGroup,
        plans: list[StagePlan],
        store: CheckpointStore,
        latest: CheckpointInfo,
    ) -> int:
        snap = self.snapshot
        _, states = store.read(snap.job_id, latest.step)
        missing = sorted(set(range(snap.num_blocks)) - set(states))
        if missing:
            raise PlanError(
                f"the checkpoint at step {latest.step} has no state for blocks {missing};"
                " it was written for another model"
            )
        loads = [
            group.submit(p.index, "load", {i: states[i] for i in range(*p.blocks)}) for p in plans
        ]
        group.get(loads, self._timeout)
        self._record(
            RunnerEvent(
                "resumed",
                latest.step,
                f"resumed from the checkpoint at step {latest.step}",
                {"step": latest.step, "path": latest.path},
            )
        )
        with self._lock:
            self._step = latest.step
        return latest.step

    def _train_step(
        self,
        group: WorkerGroup,
        plans: list[StagePlan],
        order: tuple[Action, ...],
        data: DataSource,
        step: int,
    ) -> StepMetrics:
        snap = self.snapshot
        started = self._clock()
        inputs, targets = data.batch(step, snap.batch_size)
        rows = snap.batch_size // snap.micro_batches
        scale = rows / snap.batch_size
        last = len(plans) - 1
        # Handles waiting for their one consumer, dropped once passed on, so Ray frees each
        # activation as soon as the next stage has it (1F1B's memory bound holds).
        pending: dict[tuple[Op, int, int], Any] = {}
        losses, firsts = [], []
        for action in order:
            s, j = action.stage, action.microbatch
            if action.op is Op.F:
                x = _rows(inputs, j, rows) if s == 0 else pending.pop((Op.F, s - 1, j))
                if s == last:
                    y = _rows(targets, j, rows)
                    losses.append(group.submit(s, "forward_loss", j, x, y, scale))
                else:
                    pending[(Op.F, s, j)] = group.submit(s, "forward", j, x)
            else:
                grad = None if s == last else pending.pop((Op.B, s + 1, j))
                handle = group.submit(s, "backward", j, grad)
                if s == 0:
                    firsts.append(handle)
                else:
                    pending[(Op.B, s, j)] = handle
        updates = [group.submit(p.index, "apply_step") for p in plans]
        # Stage 0's backwards end every dependency chain: waiting on them surfaces any error.
        values = group.get([*losses, *firsts, *updates], self._timeout)
        elapsed = self._clock() - started
        computes = values[-len(plans) :]
        return StepMetrics(
            step=step + 1,
            loss=float(sum(values[: len(losses)])),
            samples_per_s=snap.batch_size / elapsed if elapsed > 0 else 0.0,
            step_time_s=elapsed,
            stages=tuple(
                StageTiming(p.index, p.device.id, c, max(0.0, elapsed - c))
                for p, c in zip(plans, computes, strict=True)
            ),
        )

    def _checkpoint(
        self, group: WorkerGroup, plans: list[StagePlan], store: CheckpointStore, step: int
    ) -> None:
        snap = self.snapshot
        blocks: dict[int, Any] = {}
        for states in self._call_all(group, "state"):
            blocks.update(states)
        layout = {
            "model": asdict(snap.model),
            "data": asdict(snap.data),
            "optimizer": asdict(snap.optimizer),
            "num_blocks": snap.num_blocks,
            "stages": [
                {"index": p.index, "blocks": list(p.blocks), "device_id": p.device.id}
                for p in plans
            ],
            "step": step,
            "data_cursor": step,
            "seed": snap.seed,
            "batch_size": snap.batch_size,
            "micro_batches": snap.micro_batches,
            "schedule": snap.schedule,
            "attempt": snap.attempt,
        }
        info = store.write(snap.job_id, step, blocks, layout)
        deleted = store.retain(snap.job_id, snap.checkpoint_keep) if snap.checkpoint_keep else []
        self._record(
            RunnerEvent(
                "checkpoint",
                step,
                f"checkpoint at step {step} ({info.nbytes} bytes)",
                {"step": step, "path": info.path, "bytes": info.nbytes, "deleted": list(deleted)},
            )
        )


def _rows(batch: Tensor, j: int, rows: int) -> Tensor:
    # A copy, not a view: pickling a view ships its whole base storage to the stage.
    return batch[j * rows : (j + 1) * rows].clone()


class JobRunner:
    """One job's runner; ``workers.launch`` runs it as a detached, threaded Ray actor."""

    def __init__(
        self,
        snapshot: JobSnapshot,
        make_group: GroupFactory = RayGroup,
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        self._trainer = Trainer(snapshot, make_group, step_timeout_s=step_timeout_s)
        self._started = False
        self._lock = threading.Lock()

    def run(self) -> RunStatus:
        """Train (blocking until the job ends); a second call returns the status at once."""
        with self._lock:
            if self._started:
                return self._trainer.status
            self._started = True
        return self._trainer.run()

    def poll(self, cursor: int) -> RunnerReport:
        return self._trainer.report(cursor)

    def cancel(self) -> None:
        self._trainer.cancel()
