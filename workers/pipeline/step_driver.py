"""The runner's side of one training step: hand each worker its step, collect the results.

A mini-batch: replica r runs its own pipeline schedule over its micro-batches (those after
replicas 0..r-1's), then each stage's gradients are summed over its replicas, then the
gradient norm is reduced over replica 0's stages (the replicas now hold the same
gradients) and every worker steps, clipping first if the job asks (``workers.pipeline.clipping``).
The loss scale is the micro-batch's share of the whole mini-batch, so the replicas' summed
gradients are the reference's.

Two ways to drive it, the same arithmetic in the same order (bitwise equal results):

* **Peer to peer** (``RayGroup`` with linked neighbours): one ``steps`` call per worker
  (``step`` and ``apply_step`` with clipping: the coefficient needs every stage's norms
  first); each stage runs its own program (``workers.pipeline.step_program``) and exchanges
  activations with its neighbours directly. The runner moves no data: it names each
  replica's rows of the step's batch (its first and last stages draw them themselves:
  ``workers.pipeline.batch_rows``), and reads back losses, norms and timings. One call may
  carry several steps, run back to back, where the boundaries between them need nothing
  of the runner (``scheduler.overlap``). A call is handed out (``start_step``) and collected
  (``finish_step``) separately, so the runner can hand out the next call before collecting
  this one when nothing has to happen between them (``workers.pipeline.runner``): each worker then
  starts it as soon as it ends this one, instead of after a round trip through the runner.
* **Relayed** (``LocalGroup``, the reference; and wherever neighbours cannot link): every
  forward and backward is its own call, and each activation goes stage -> runner -> stage
  as a handle passed from one call to the next; the runner draws the batch and sends it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from shoal.scheduler.schedules import Action, Op, build, submission_order
from shoal.workers.pipeline.batch_rows import Rows
from shoal.workers.pipeline.clipping import clip_coefficient
from shoal.workers.pipeline.rebalance import Layout
from shoal.workers.pipeline.stage_worker import StageFailed
from shoal.workers.pipeline.timing import StepClock
from shoal.workers.pipeline.worker_group import GroupTimeout, Handle, StageLost, WorkerGroup
from shoal.workers.snapshot import JobSnapshot, StageTiming, StepMetrics
from shoal.workers.wire import Wire, send
from shoal.workers.zoo.data import DataSource


@dataclass(frozen=True)
class _Done:
    """What a step left: its losses in micro-batch order, the gradient norm, each worker's
    time, and its slowest worker's wall seconds (0: not measured, a relayed step)."""

    losses: list[float]
    grad_norm: float
    clocks: list[StepClock]
    seconds: float = 0.0


@dataclass(frozen=True)
class Flight:
    """Steps handed out to their workers and not yet collected (``finish_step``)."""

    step: int
    """The first step's batch: it trains steps ``step + 1`` to ``end``."""
    count: int
    layout: Layout
    started: float
    handles: tuple[Handle, ...] = ()
    relayed: _Done | None = None
    """A relayed step runs while it is handed out: its result."""
    one_call: bool = False
    """Whether the steps are one call per worker (peer to peer, no clipping): a worker runs
    its calls in order, so the next call, handed out before this one is collected, starts
    on each worker right after this one."""

    @property
    def end(self) -> int:
        """The step the workers have trained once the flight is in."""
        return self.step + self.count


def in_one_call(snap: JobSnapshot, *, relay: bool) -> bool:
    """Whether a step is one call per worker: peer to peer and without clipping (which needs
    a second call), so several steps may share a call."""
    return not relay and snap.optimizer.clip_grad_norm is None


def start_step(
    snap: JobSnapshot,
    group: WorkerGroup,
    layout: Layout,
    data: DataSource,
    step: int,
    count: int,
    *,
    relay: bool,
    timeout: float,
    clock: Callable[[], float],
) -> Flight:
    """Hand out steps ``step + 1`` to ``step + count`` (on batches ``step`` onwards) to the
    workers of ``layout``: in one call per worker, back to back. A relayed step, or one
    that clips its gradients, is handed out alone (``count`` must be 1)."""
    one_call = in_one_call(snap, relay=relay)
    if count != 1 and not one_call:
        raise ValueError(f"{count} steps in one call: only unclipped peer-to-peer steps can be")
    started = clock()
    if relay:
        done = _relayed(snap, group, layout, *data.batch(step, snap.batch_size), timeout)
        return Flight(step, 1, layout, started, relayed=done)
    handles = _hand_out(snap, group, layout, step, count)
    return Flight(step, count, layout, started, tuple(handles), one_call=one_call)


def finish_step(
    snap: JobSnapshot,
    group: WorkerGroup,
    flight: Flight,
    *,
    timeout: float,
    clock: Callable[[], float],
    since: float,
) -> tuple[list[StepMetrics], float]:
    """Collect ``flight`` and measure each of its steps; and when it ended. A call handed
    out before the previous one ended (``since``) is timed from there: its workers were busy
    until then. The call's time is shared among its steps as their workers measured them
    (a step's time: its slowest worker's)."""
    dones = (
        [flight.relayed]
        if flight.relayed is not None
        else _collect(snap, group, flight.layout, flight.handles, flight.count, timeout)
    )
    ended = clock()
    elapsed = ended - max(flight.started, since)
    weights = [done.seconds for done in dones]
    total = sum(weights)
    metrics = [
        _metrics(
            snap,
            flight.layout,
            flight.step + 1 + i,
            done,
            elapsed * weight / total if total > 0 else elapsed / len(dones),
        )
        for i, (done, weight) in enumerate(zip(dones, weights, strict=True))
    ]
    return metrics, ended


def _metrics(
    snap: JobSnapshot, layout: Layout, step: int, done: _Done, elapsed: float
) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=float(sum(done.losses)),
        samples_per_s=snap.batch_size / elapsed if elapsed > 0 else 0.0,
        step_time_s=elapsed,
        stages=tuple(
            StageTiming(
                p.index,
                p.device.id,
                c.compute_s,
                max(0.0, elapsed - c.compute_s - c.transfer_s - c.allreduce_s - c.copy_s),
                replica=p.replica,
                allreduce_s=c.allreduce_s,
                transfer_s=c.transfer_s,
                copy_s=c.copy_s,
                tensor_devices=tuple(d.id for d in p.tensor_devices),
            )
            for p, c in zip(layout.plans, done.clocks, strict=True)
        ),
        grad_norm=done.grad_norm,
    )


def _hand_out(
    snap: JobSnapshot, group: WorkerGroup, layout: Layout, step: int, count: int
) -> list[Handle]:
    """One call per worker of the peer-to-peer path: ``steps`` over the batches ``step``
    to ``step + count - 1`` (``step`` without the update where the gradients are clipped
    first), each replica's workers given its rows of them."""
    depth = layout.depth
    rows = snap.batch_size // snap.micro_batches
    scale = rows / snap.batch_size
    clipped = snap.optimizer.clip_grad_norm is not None
    handles: list[Handle] = []
    offset = 0
    for r, split in enumerate(layout.split):
        ranges = [Rows(step + i, offset * rows, (offset + split) * rows) for i in range(count)]
        for w in range(r * depth, (r + 1) * depth):
            if clipped:
                call = group.submit(w, "step", snap.schedule, depth, split, ranges[0], scale, False)
            else:
                call = group.submit(w, "steps", snap.schedule, depth, split, ranges, scale)
            handles.append(call)
        offset += split
    return handles


def _collect(
    snap: JobSnapshot,
    group: WorkerGroup,
    layout: Layout,
    handles: Sequence[Handle],
    count: int,
    timeout: float,
) -> list[_Done]:
    """The peer-to-peer call's results, step by step; with clipping (one step), its second
    call (the coefficient needs every stage's norms first)."""
    depth = layout.depth
    max_norm = snap.optimizer.clip_grad_norm
    try:
        outcomes = group.get(handles, timeout)
    except (StageFailed, StageLost, GroupTimeout):
        group.disconnect()  # a failed step's stages closed their links
        raise
    by_step = [[o] for o in outcomes] if max_norm is not None else outcomes
    dones = []
    for i in range(count):
        step = [worker[i] for worker in by_step]
        losses = [value for outcome in step for value in outcome.losses]  # replica order
        grad_norm, clip = clip_coefficient([o.norms for o in step[:depth]], max_norm)
        clocks = [o.clock for o in step]
        if clip is not None:
            updates = [group.submit(w, "apply_step", clip) for w in range(len(step))]
            clocks = [_add(a, b) for a, b in zip(clocks, group.get(updates, timeout), strict=True)]
        dones.append(_Done(losses, grad_norm, clocks, max(o.seconds for o in step)))
    return dones


def _relayed(
    snap: JobSnapshot,
    group: WorkerGroup,
    layout: Layout,
    inputs: Tensor,
    targets: Tensor,
    timeout: float,
) -> _Done:
    rows = snap.batch_size // snap.micro_batches
    scale = rows / snap.batch_size
    depth = layout.depth
    losses, firsts = [], []
    offset = 0
    for r, count in enumerate(layout.split):
        order = _order(snap.schedule, depth, count)
        part = _submit_pipeline(
            group, order, r * depth, depth, offset, inputs, targets, rows, scale
        )
        losses += part[0]
        firsts += part[1]
        offset += count
    replicas = len(layout.split)
    reduces: list[Any] = []
    if replicas > 1:
        for s in range(depth):
            reduces += group.all_reduce([r * depth + s for r in range(replicas)])
    norms = [group.submit(w, "grad_norms") for w in range(depth)]
    # Stage 0's backwards end every dependency chain: waiting on them surfaces any error.
    waits = [*losses, *firsts, *reduces]
    max_norm = snap.optimizer.clip_grad_norm
    workers = len(layout.plans)
    if max_norm is None:
        updates = [group.submit(w, "apply_step") for w in range(workers)]
        values = group.get([*waits, *norms, *updates], timeout)
        grad_norm, _ = clip_coefficient(values[len(waits) : -workers], None)
        clocks = values[-workers:]
    else:
        values = group.get([*waits, *norms], timeout)
        grad_norm, clip = clip_coefficient(values[len(waits) :], max_norm)
        updates = [group.submit(w, "apply_step", clip) for w in range(workers)]
        clocks = group.get(updates, timeout)
    if reduces:
        times = values[len(losses) + len(firsts) : len(waits)]
        for i, seconds in enumerate(times):  # reduces are stage-major
            s, r = divmod(i, replicas)
            clocks[r * depth + s] = replace(clocks[r * depth + s], allreduce_s=seconds)
    return _Done(values[: len(losses)], grad_norm, clocks)


def _submit_pipeline(
    group: WorkerGroup,
    order: tuple[Action, ...],
    base: int,
    depth: int,
    offset: int,
    inputs: Tensor,
    targets: Tensor,
    rows: int,
    scale: float,
) -> tuple[list[Any], list[Any]]:
    """Submit one replica's schedule (workers ``base .. base + depth - 1``) over the
    micro-batches ``offset + j``; the loss handles and stage 0's backward handles."""
    last = depth - 1
    # Handles waiting for their one consumer, dropped once passed on, so Ray frees each
    # activation as soon as the next stage has it (1F1B's memory bound holds).
    pending: dict[tuple[Op, int, int], Any] = {}
    losses, firsts = [], []
    for action in order:
        s, j = action.stage, action.microbatch
        w = base + s
        if action.op is Op.F:
            x = _rows(inputs, offset + j, rows) if s == 0 else pending.pop((Op.F, s - 1, j))
            if s == last:
                y = _rows(targets, offset + j, rows)
                losses.append(group.submit(w, "forward_loss", j, x, y, scale))
            else:
                pending[(Op.F, s, j)] = group.submit(w, "forward", j, x)
        else:
            grad = None if s == last else pending.pop((Op.B, s + 1, j))
            handle = group.submit(w, "backward", j, grad)
            if s == 0:
                firsts.append(handle)
            else:
                pending[(Op.B, s, j)] = handle
    return losses, firsts


@functools.cache
def _order(schedule: str, stages: int, micro_batches: int) -> tuple[Action, ...]:
    """The submission order of one replica's schedule (``workers.pipeline.group``: ordering)."""
    return submission_order(build(schedule, stages, micro_batches))


def _rows(batch: Tensor, j: int, rows: int) -> Wire:
    # A view's array pickles only its own rows, not the batch's storage.
    return send(batch[j * rows : (j + 1) * rows])


def _add(a: StepClock, b: StepClock) -> StepClock:
    return StepClock(
        a.compute_s + b.compute_s,
        a.transfer_s + b.transfer_s,
        a.wait_s + b.wait_s,
        a.allreduce_s + b.allreduce_s,
        a.copy_s + b.copy_s,
    )
