"""The job runner: trains one job through a worker group, step by step, and reports progress.

``Trainer`` is the engine, plain Python: it starts the job on its workers
(``workers.pipeline.job_start``: placement, device speeds, the latest checkpoint), then for
every step links the stages (only links that are missing) and drives the step
(``workers.pipeline.step_driver``: each stage runs its whole step and exchanges activations
with its neighbours, or, where they cannot link, the runner relays them), records
``StepMetrics`` and ``RunnerEvent``s in its ``workers.run_log.RunLog``, and hands
checkpoints to a writer thread (``workers.pipeline.checkpoint_writer``). Where the boundary
after a step needs nothing of the workers (no checkpoint, copy, move or request due) and
the runner's work cannot take a worker's core (``scheduler.overlap``), the next step is
handed out before this one is collected, so the workers go from one step to the next
without waiting for a round trip through the runner; a request that comes in meanwhile
waits one more step. ``JobRunner`` (``workers.pipeline.job_runner``) is what
``workers.actors`` runs as the job's detached Ray actor.

Steps are counted as completed optimizer updates: step k's metrics and a checkpoint at step
k describe the model after k updates, which consumed data batches 0..k-1 (the data cursor is
the step). Only the thread in ``run`` submits to the stages; that single submitter is what
keeps each stage's calls in schedule order (see ``workers.pipeline.group``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from shoal.scheduler.overlap import leaves_a_core, steps_per_call
from shoal.workers.checkpoint_events import write_checkpoint
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.error_text import one_line
from shoal.workers.pipeline.checkpoint_writer import CheckpointWriter
from shoal.workers.pipeline.job_start import PlanError, announce, check_plans, restore
from shoal.workers.pipeline.rebalance import (
    Layout,
    MoveRequest,
    Policy,
    Rebalancer,
    move_blocks,
    policy_every,
    unshard,
)
from shoal.workers.pipeline.recovery import Copies, copies_event, recover
from shoal.workers.pipeline.replicas import shard_event
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import StageFailed
from shoal.workers.pipeline.step_driver import Flight, finish_step, in_one_call, start_step
from shoal.workers.pipeline.transport import LINK_TIMEOUT_S
from shoal.workers.pipeline.worker_group import GroupFactory, StageLost, WorkerGroup
from shoal.workers.run_log import RunLog
from shoal.workers.snapshot import (
    JobSnapshot,
    RunnerEvent,
    RunnerReport,
    RunStatus,
    StagePlan,
)
from shoal.workers.zoo.data import DataSource, make_data

DEFAULT_STEP_TIMEOUT_S = 600.0
"""How long one step may take before the runner gives up on its stages."""


class Trainer:
    """Trains ``snapshot`` on the group ``make_group`` builds; thread-safe ``report``/``cancel``."""

    def __init__(
        self,
        snapshot: JobSnapshot,
        make_group: GroupFactory,
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        clock: Callable[[], float] = time.perf_counter,
        policy: Policy | None = None,
        cores: int | None = None,
        copies: Callable[[float, float], Copies] = Copies,
    ) -> None:
        """``cores``: of the machine the runner runs on (default: this one's); how many CPU
        devices it can serve while overlapping steps (``scheduler.overlap``). ``copies``:
        makes the job's in-memory copies from its budget and step timeout (a bench's
        measures them in alternate windows)."""
        self.snapshot = snapshot
        self._policy = policy
        self._make_copies = copies
        self._make_group = make_group
        self._timeout = step_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._suspending = threading.Event()
        self._run = RunLog()
        self._relayout: MoveRequest | None = None
        self._gflops: dict[str, float] = {}
        self._writer = CheckpointWriter(self._run.record)
        self._relay_reason: str | None = ""  # none said yet: "" is never a reason
        self._cores = cores or os.cpu_count() or 1
        self._ahead: Flight | None = None
        """The next step, handed out before the last one was collected."""
        self._ended = float("-inf")
        """When the last step was collected."""
        self._timed: Layout | None = None
        """The layout the last recorded step ran on: a step on another one does not say how
        long this one's take, so a new layout's first step is handed out alone."""

    # ------------------------------------------------------------------ thread-safe API

    def cancel(self) -> None:
        """Stop at the next step boundary."""
        self._cancelled.set()

    def suspend(self) -> None:
        """Checkpoint at the next step boundary and stop there (``RunStatus.SUSPENDED``)."""
        self._suspending.set()

    def relayout(
        self,
        plans: Sequence[StagePlan],
        split: Sequence[int],
        since: Collection[str] | None = None,
    ) -> None:
        """Move to ``plans`` (replica-major, on any devices, any number of stages and
        replicas) with ``split`` micro-batches per replica at the first step boundary once
        the workers it adds are started (the job trains on meanwhile); a later request
        replaces one not yet carried out. ``since``: the devices the job was on when the
        move was planned; one on others by then (a recovery) drops it, saying so."""
        request = MoveRequest(
            Layout(tuple(plans), tuple(split)), None if since is None else frozenset(since)
        )
        with self._lock:
            self._relayout = request

    @property
    def status(self) -> RunStatus:
        return self._run.status

    def report(self, cursor: int) -> RunnerReport:
        """Metrics and events recorded after ``cursor`` (0 = from the start), and the status."""
        return self._run.report(cursor)

    # ------------------------------------------------------------------------- training

    def run(self) -> RunStatus:
        """Train to ``snapshot.steps``; never raises: failures become FAILED with a reason."""
        group: WorkerGroup | None = None
        self._writer = CheckpointWriter(self._run.record)
        try:
            snap = self.snapshot
            plans = check_plans(snap.stages, snap.num_blocks, snap.replicas)
            layout = Layout(tuple(plans), snap.micro_batch_split())
            data = make_data(snap.data, snap.seed, snap.allowed_factories)
            store = CheckpointStore(snap.checkpoint_root)
            group = self._make_group(plans, StageSetup.of(snap, data.meta))
            restorable = store.restorable(snap.job_id)
            at = restorable.info.step if restorable.info else 0
            self._gflops = announce(group, plans, snap.replicas, at, self._run, self._timeout)
            if snap.shard != "none":
                self._run.record(shard_event(snap.shard, group.groups_replicas, at))
            start = restore(group, plans, restorable, snap.num_blocks, self._run, self._timeout)
            rebalancer = (
                Rebalancer(self._policy, policy_every(snap), self._timeout, self._run.record)
                if self._policy
                else None
            )
            copies = (
                self._make_copies(snap.copy_budget, self._timeout) if snap.keep_copies else None
            )
            if copies is not None:
                copies.refresh(group, layout, start, fresh=True)
            step = start
            while step < snap.steps:
                # A request is carried out between steps: once a step handed out ahead is in.
                if self._cancelled.is_set() and self._ahead is None:
                    self._writer.flush()
                    return self._run.end(RunStatus.CANCELLED)
                if self._suspending.is_set() and self._ahead is None:
                    return self._suspend(group, layout, store, step)
                try:
                    layout, step = self._boundary(
                        group, layout, data, store, step, rebalancer, copies
                    )
                except StageLost as exc:
                    if copies is None:
                        raise
                    layout, step = self._recover(group, layout, exc, self._run.step, copies)
                    if rebalancer is not None:
                        rebalancer.restart()
            self._writer.flush()  # SUCCEEDED once the last checkpoint is complete
            return self._run.end(RunStatus.SUCCEEDED)
        except StageLost as exc:  # the message names the stage and device
            self._writer.close()  # a restart resumes from the checkpoints under way
            if (said := exc.event(self._run.step)) is not None:
                self._run.record(said)
            return self._run.end(RunStatus.LOST, str(exc), (exc.device_id,))
        except StageFailed as exc:
            self._writer.close()
            return self._run.end(RunStatus.FAILED, str(exc))
        except Exception as exc:  # the run's boundary: whatever broke, the job reports why
            self._writer.close()
            return self._run.end(RunStatus.FAILED, one_line(exc))
        finally:
            self._writer.close()
            if group is not None:
                group.shutdown()

    def _boundary(
        self,
        group: WorkerGroup,
        layout: Layout,
        data: DataSource,
        store: CheckpointStore,
        step: int,
        rebalancer: Rebalancer | None,
        copies: Copies | None,
    ) -> tuple[Layout, int]:
        """Train the steps after ``step`` handed out in one call (one step, or several where
        the boundaries between them need nothing: ``scheduler.overlap``) and do what follows
        the last: checkpoint, rebalance, relayout, copy. The layout the next step runs on,
        and the steps done."""
        snap = self.snapshot
        ready = self._relayout_ready(group)
        flight = self._ahead or self._start(group, layout, data, step, rebalancer, copies)
        quiet = self._quiet(flight, rebalancer, ready)
        self._ahead = None
        if quiet:
            if copies is not None and copies.due(flight.end):
                # Each worker runs its calls in order: the copy falls between the two.
                self._plan_copies(copies, flight.end)
                copies.refresh(group, layout, flight.end)
            self._ahead = self._start(
                group, layout, data, flight.end, rebalancer, copies, flight.count
            )
        steps, self._ended = finish_step(
            snap, group, flight, timeout=self._timeout, clock=self._clock, since=self._ended
        )
        if copies is not None:
            copies.confirm(group, flight.end, self._timeout)  # earlier boundaries' copies
        *inside, last = steps
        for metrics in inside:  # boundaries within the call: the policy is not asked there
            self._run.record(metrics)
            if rebalancer is not None:
                rebalancer.after_step(group, layout, metrics)
        self._run.record(last)
        self._timed = flight.layout
        if copies is not None:
            shared = not leaves_a_core([p.device for p in flight.layout.plans], self._cores)
            for metrics in steps:
                copies.observe(metrics, cores_shared=shared)
        done = flight.end
        if done == snap.steps or self._checkpoint_due(done):
            self._checkpoint(group, layout, store, done)
        if done == snap.steps:
            return layout, done
        before = layout
        if rebalancer is not None:
            layout = rebalancer.after_step(group, layout, last)  # quiet: never moves
        if quiet:  # a relayout requested meanwhile waits for the next boundary
            return layout, done
        request = self._take_relayout(group)
        if request is not None and request.stale(layout):
            self._run.record(request.layout.not_moved(done, "the job is on other devices now"))
        elif request is not None:
            layout = self._move(group, layout, request.layout, done)
            if rebalancer is not None:
                rebalancer.restart()
        # Blocks that moved dropped their workers' copies: copy the new layout at once.
        moved = layout is not before
        if copies is not None and (copies.due(done) or moved):
            self._plan_copies(copies, done)
            copies.refresh(group, layout, done, fresh=moved)
        return layout, done

    def _relayout_ready(self, group: WorkerGroup) -> bool:
        """Whether a relayout is requested and the workers it adds are started (or failed
        to: the move reports it); else they are being started while the job trains on its
        layout (a worker takes seconds to start)."""
        with self._lock:
            request = self._relayout
        return request is not None and group.prepare(request.layout.plans)

    def _take_relayout(self, group: WorkerGroup) -> MoveRequest | None:
        """The requested relayout, taken, if it is ready (``_relayout_ready``)."""
        with self._lock:
            request = self._relayout
        if request is None or not group.prepare(request.layout.plans):
            return None
        with self._lock:
            if self._relayout != request:  # replaced meanwhile: prepared at the next boundary
                return None
            self._relayout = None
        return request

    def _plan_copies(self, copies: Copies, step: int) -> None:
        """Re-decide how often the copies are taken; say so when that is news."""
        if copies.cadence.plan():
            self._run.record(copies_event(copies.cadence, step))

    def _suspend(
        self, group: WorkerGroup, layout: Layout, store: CheckpointStore, step: int
    ) -> RunStatus:
        self._writer.flush()
        latest = store.latest(self.snapshot.job_id)
        if latest is None or latest.step != step:
            self._checkpoint(group, layout, store, step)
            self._writer.flush()
        self._run.record(
            RunnerEvent(
                "suspended",
                step,
                f"suspended at step {step}, checkpointed: resumes from there",
                {"step": step},
            )
        )
        return self._run.end(RunStatus.SUSPENDED)

    def _recover(
        self, group: WorkerGroup, layout: Layout, cause: StageLost, step: int, copies: Copies
    ) -> tuple[Layout, int]:
        """A worker was lost once ``step``, the last step recorded, was trained (during the
        next step, or in the work at the boundary after ``step``: a relayout's move, say):
        re-form the job from the survivors' in-memory copies (``workers.pipeline.recovery``);
        the layout and the step to run next, where the run stands again."""
        most = copies.most_replayed(step)
        copies.drop()
        with self._lock:  # asked for the layout before the loss: the controller may ask anew
            dropped, self._relayout = self._relayout, None
        if dropped is not None:
            self._run.record(dropped.layout.not_moved(step, f"the job lost {cause.device_id}"))
        if (said := cause.event(step)) is not None:  # set aside, or a worker not started
            self._run.record(said)
        # A call handed out ahead ran (or failed) on the survivors before they answer the
        # survey (calls run in order): the rollback undoes it, and the run goes on from the
        # restore step.
        self._ahead = None
        started = time.perf_counter()
        last = self._run.last_metrics()
        # A survivor busy with a long micro-batch still answers within a few step times;
        # one waiting on a silently lost neighbour, once its link times out.
        ping = max(3 * last.step_time_s if last is not None else 0.0, LINK_TIMEOUT_S + 5)
        found = recover(
            group, layout, self.snapshot, self._gflops, self._timeout, ping_timeout=ping
        )
        seconds = time.perf_counter() - started
        lost = (cause.device_id, *found.lost)
        for event in found.events(layout, step, lost, cause.reason, most, copies, seconds):
            self._run.record(event)
        copies.refresh(group, found.layout, found.restore_step, fresh=True)
        self._run.resumed_at(found.restore_step)
        return found.layout, found.restore_step

    def _move(self, group: WorkerGroup, old: Layout, new: Layout, step: int) -> Layout:
        """Carry out a relayout: workers on devices of both layouts stay (their blocks move
        as needed), the others start or stop; the blocks' state moves actor to actor."""
        snap = self.snapshot
        checked = Layout(tuple(check_plans(new.plans, snap.num_blocks, len(new.split))), new.split)
        if sum(checked.split) != snap.micro_batches or min(checked.split) < 1:
            raise PlanError(
                f"replica micro-batches {list(checked.split)} must each be >= 1 and sum to"
                f" {snap.micro_batches}"
            )
        where = {p.device.id: w for w, p in enumerate(old.plans)}
        keep = {w: where[p.device.id] for w, p in enumerate(checked.plans) if p.device.id in where}
        started = time.perf_counter()
        try:
            move_blocks(group, old, checked, self._timeout, keep)
        except StageLost as exc:  # the job recovers where it was: this move is over
            self._run.record(checked.not_moved(step, str(exc), exc.device_id))
            raise
        seconds = time.perf_counter() - started
        before = {p.device.id for p in old.plans}
        after = {p.device.id for p in checked.plans}
        self._run.record(
            RunnerEvent(
                "relayout",
                step,
                f"{old.describe()} -> {checked.describe()} in {seconds:.2f} s",
                {
                    "from": old.rows(),
                    "to": checked.rows(),
                    "micro_batches": list(checked.split),
                    "added": sorted(after - before),
                    "removed": sorted(before - after),
                    "seconds": seconds,
                },
            )
        )
        return checked

    def _start(
        self,
        group: WorkerGroup,
        layout: Layout,
        data: DataSource,
        step: int,
        rebalancer: Rebalancer | None,
        copies: Copies | None,
        unrecorded: int = 0,
    ) -> Flight:
        """Hand out the steps after ``step``: as many in one call as ``_span`` allows;
        ``unrecorded`` steps before them are still in flight."""
        relay = self._connect(group, layout, step)
        one_call = in_one_call(self.snapshot, relay=relay)
        fresh = layout != self._timed  # its first step goes alone (``_timed``)
        count = self._span(step, rebalancer, copies, unrecorded) if one_call and not fresh else 1
        return start_step(
            self.snapshot,
            group,
            layout,
            data,
            step,
            count,
            relay=relay,
            timeout=self._timeout,
            clock=self._clock,
        )

    def _span(
        self, step: int, rebalancer: Rebalancer | None, copies: Copies | None, unrecorded: int
    ) -> int:
        """How many steps after ``step`` to hand out in one call (``scheduler.overlap``):
        up to the next boundary with work for the runner (a checkpoint, an in-memory copy,
        the policy's ask, the run's end; every boundary while a request waits)."""
        snap = self.snapshot
        with self._lock:
            waiting = self._relayout is not None
        if waiting or self._cancelled.is_set() or self._suspending.is_set():
            return 1
        every = snap.checkpoint_every
        until = snap.steps - step
        if every > 0:
            until = min(until, every - step % every)
        if copies is not None:
            until = min(until, max(1, copies.steps_to_next(step)))
        if rebalancer is not None:
            until = min(until, rebalancer.steps_to_ask(unrecorded))
        last = self._run.last_metrics()
        step_s = last.step_time_s if last is not None else None
        return steps_per_call(step_s, until)

    def _quiet(self, flight: Flight, rebalancer: Rebalancer | None, relayout: bool) -> bool:
        """Whether the boundary after ``flight`` needs nothing of the workers but calls
        that can be queued behind it (an in-memory copy), so the next call can be handed
        out before ``flight`` is collected: the steps are one call per worker, the runner's
        work leaves the workers their cores (``scheduler.overlap``), and no checkpoint,
        move, ``relayout`` (one whose workers are started), cancel or suspend is due there.
        A request that comes in later waits one more call."""
        done = flight.end
        return (
            flight.one_call
            and leaves_a_core([p.device for p in flight.layout.plans], self._cores)
            and done < self.snapshot.steps
            and not self._checkpoint_due(done)
            and (rebalancer is None or not rebalancer.asks_after(flight.count))
            and not (relayout or self._cancelled.is_set() or self._suspending.is_set())
        )

    def _checkpoint_due(self, done: int) -> bool:
        every = self.snapshot.checkpoint_every
        return every > 0 and done % every == 0

    def _connect(self, group: WorkerGroup, layout: Layout, step: int) -> bool:
        """Link the stages before a step (only links that are missing are formed); whether
        the step is relayed through the runner instead, said in an event when it changes."""
        reason = group.connect()
        if reason != self._relay_reason and layout.depth > 1:
            how = (
                "activations go peer to peer between neighbouring stages"
                if reason is None
                else f"activations are relayed through the runner: {reason}"
            )
            self._run.record(RunnerEvent("transport", step, how, {"relayed": reason}))
        self._relay_reason = reason
        return reason is not None

    def _checkpoint(
        self, group: WorkerGroup, layout: Layout, store: CheckpointStore, step: int
    ) -> None:
        # Replicas are identical after every step: replica 0 (workers 0..p-1) speaks for all,
        # once every replica has its blocks' whole state back (sharded replicas).
        if self.snapshot.shard != "none" and len(layout.split) > 1:
            unshard(group, layout, self._timeout)
        blocks: dict[int, Any] = {}
        states = group.get([group.submit(w, "state") for w in range(layout.depth)], self._timeout)
        for part in states:
            blocks.update(part)
        stages = [
            {
                "index": p.index,
                "replica": p.replica,
                "blocks": list(p.blocks),
                "device_id": p.device.id,
            }
            for p in layout.plans
        ]
        split, snap = layout.split, self.snapshot
        self._writer.submit(lambda: write_checkpoint(store, snap, step, blocks, stages, split))
