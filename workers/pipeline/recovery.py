"""Surviving a lost device inside the runner, from in-memory copies: no restart, no
checkpoint read, at most the steps between two copies replayed.

At a step boundary every few steps (as often as the copies' measured cost allows:
``scheduler.copies``) each worker keeps a snapshot of its blocks (parameters and optimizer
state, in host memory; its last three) and sends it to its *buddy*, a worker on another
node where there is one, which holds it (its last two: ``Copies``). When a worker is lost
mid-step:

1. The others are asked what they hold (``saved_steps``); a worker that does not answer is
   lost too.
2. The restore step is the latest step for which every survivor has its own snapshot and
   every block is in some survivor's snapshot or in a copy held for a lost worker (the
   latest copies may not have arrived: then an earlier one, at the earliest the latest the
   runner confirmed held, ``Copies.most_replayed``). A replica of a sharded stage copies
   only its slice of each block's parameters and optimizer state: a block is held when one
   slice of every rank is (``scheduler.pieces``).
3. The blocks are re-cut over the surviving devices (``scheduler.layout``: the partitioner
   picks stages and replicas); survivors roll back to the restore step (a sharded replica
   given the other replicas' slices: its blocks are whole again, and the next step shards
   them over the replicas left) and keep their worker, adopting their new blocks; lost
   blocks come from the copies, actor to actor.

The result is the same model state a single process would have after the restore step, so
the run continues exactly.

Why a worker keeps three copies of its own: a copy handed out ahead (with the next step
call, before the last is collected) may run on a worker while its buddy's copy of the
boundary before is still on its way to it; with two kept, both could then be younger than
anything it holds for that buddy, and a loss there would find no restore step. The runner
confirms each copy held before it hands out the one two boundaries later, so the oldest of
three is held everywhere (``Copies.confirm``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.scheduler.copies import CopyCadence, copy_seconds
from shoal.scheduler.layout import plan_layout
from shoal.scheduler.partition import PartitionError
from shoal.scheduler.pieces import Piece, fetch_plan, whole_blocks
from shoal.scheduler.profile import uniform_costs
from shoal.workers.pipeline.rebalance import Layout, settle
from shoal.workers.pipeline.stage_worker import MOOT, StageFailed
from shoal.workers.pipeline.worker_group import GroupTimeout, Handle, StageLost, WorkerGroup
from shoal.workers.snapshot import JobSnapshot, RunnerEvent, StepMetrics, stage_plans

MIN_PING_S = 30.0
"""The least a survivor is given to answer after a loss. Its calls of the broken step that
wait on the lost worker's outputs hold its queue until Ray declares that worker dead (node
health checks: ``service.localray.HEALTH_CHECKS`` sets them for a local cluster)."""


def buddies(layout: Layout) -> list[int | None]:
    """Where each worker's copy goes: the next worker, cyclically, on another node if any
    is (else the next one); None for a lone worker."""
    count = len(layout.plans)
    if count == 1:
        return [None]
    out: list[int | None] = []
    for w, plan in enumerate(layout.plans):
        others = [(w + k) % count for k in range(1, count)]
        elsewhere = [b for b in others if layout.plans[b].device.node_id != plan.device.node_id]
        out.append((elsewhere or others)[0])
    return out


class Copies:
    """At each step boundary where a copy is due, every worker starts copying its blocks
    (``snapshot``, a training call that returns at once: the copy is made during the next
    step) and ships the copy once made to its buddy, which holds it (``shipment`` and
    ``hold``, calls beside training). Not waited for; ``confirm`` surfaces its errors at
    the next boundary. How often: ``scheduler.copies.CopyCadence``, from the copies' and
    steps' measured times (``observe``)."""

    def __init__(self, budget: float, wait_s: float) -> None:
        self._wait_s = wait_s
        """How long a worker's shipment waits for its copy to start."""
        self._pending: list[tuple[int, list[Handle]]] = []
        """The calls of each copy asked for and not confirmed yet, with its step."""
        self.cadence = CopyCadence(budget)
        self.taken: int | None = None
        """The step of the latest copy."""
        self._floor: int | None = None
        """The step of the latest copy confirmed held, or of the first copy of the workers
        formed last until one is: the earliest a recovery restores."""
        self._number = 0
        """Copies asked for so far (each worker's ``snapshot`` and ``shipment`` name one)."""
        self._unmeasured: int | None = None

    def due(self, step: int) -> bool:
        """Whether a copy is due after ``step`` steps."""
        return self.steps_to_next(step) == 0

    def steps_to_next(self, step: int) -> int:
        """Steps after ``step`` until the next copy is due (0: now)."""
        return self.cadence.steps_to_next(self.taken, step)

    def most_replayed(self, step: int) -> int:
        """The most steps a worker lost during step ``step + 1`` replays: back to the
        latest copy confirmed held (later ones may still be on their way; every survivor
        still keeps its own copy of it, ``workers.pipeline.stage``). With copies every k
        steps, at most k: by a boundary, the copy k steps before it is confirmed."""
        return step - (self._floor if self._floor is not None else step)

    def observe(self, metrics: StepMetrics, *, cores_shared: bool = False) -> None:
        """Take a recorded step's time and the seconds its workers spent on the copy just
        before it (``scheduler.copies.copy_seconds``: ``cores_shared``, whether the workers'
        CPU devices take every core of the machine)."""
        copy_s = copy_seconds([t.copy_s for t in metrics.stages], cores_shared=cores_shared)
        if metrics.step - 1 == self._unmeasured:
            return  # its time holds the links' forming too
        self.cadence.observe(metrics.step_time_s, copy_s)

    def refresh(
        self, group: WorkerGroup, layout: Layout, step: int, *, fresh: bool = False
    ) -> None:
        """Take the copy of ``step`` now. ``fresh``: the workers or their links were just
        formed, and the next step's time would hold that too: it does not measure the copy."""
        self.taken = step
        if self._floor is None:
            self._floor = step
        self._unmeasured = step if fresh else None
        self._number += 1
        holders = buddies(layout)
        pending = [group.submit(w, "snapshot", step, self._number) for w in range(len(holders))]
        # Every shipment before any hold: a hold waits for its buddy's shipment, and no
        # worker's own shipment queues behind that (calls beside training run in order).
        shipped = [
            (w, buddy, group.submit(w, "shipment", self._number, self._wait_s))
            for w, buddy in enumerate(holders)
            if buddy is not None  # a lone worker's copy stays with it
        ]
        for w, buddy, handle in shipped:
            owner = layout.plans[w].device.id
            pending += [handle, group.submit(buddy, "hold", owner, step, handle)]
        self._pending.append((step, pending))

    def confirm(self, group: WorkerGroup, step: int, timeout: float) -> None:
        """Surface the errors of the copies of steps before ``step`` (one of ``step`` itself
        may have been asked for ahead of the steps up to it: it is confirmed later)."""
        due = [(at, handles) for at, handles in self._pending if at < step]
        self._pending = [(at, handles) for at, handles in self._pending if at >= step]
        group.get([h for _, handles in due for h in handles], timeout)
        if due:
            self._floor = max(at for at, _ in due)

    def drop(self) -> None:
        """Forget the copies under way: the workers are formed again (a recovery); the
        next ``refresh`` is the first of the new ones."""
        self._pending = []
        self._floor = None


def copies_event(cadence: CopyCadence, step: int) -> RunnerEvent:
    """The event that says how often a job copies its state, what that costs, and the most
    a lost device replays (``CopyCadence.plan`` said it is news)."""
    every, copy_s, step_s = cadence.interval, cadence.copy_s or 0.0, cadence.step_s or 0.0
    steps = f"{every} step{'s' if every > 1 else ''}"
    return RunnerEvent(
        "copies",
        step,
        f"in-memory copies every {steps}: a copy takes {copy_s:.3f} s, a step {step_s:.3f} s,"
        f" so they cost {cadence.overhead or 0.0:.1%} of the training time (budget"
        f" {cadence.budget:.0%}); a lost device replays at most {steps}",
        {
            "interval": every,
            "copy_s": copy_s,
            "step_s": step_s,
            "overhead": cadence.overhead,
            "budget": cadence.budget,
        },
    )


@dataclass(frozen=True)
class Recovery:
    layout: Layout
    restore_step: int
    lost: tuple[str, ...]

    def events(
        self,
        before: Layout,
        step: int,
        lost: Sequence[str],
        reason: str,
        most: int,
        copies: Copies,
        seconds: float,
    ) -> tuple[RunnerEvent, RunnerEvent]:
        """The ``device_lost`` and ``recovered`` events of a loss of ``lost`` (``reason``)
        once ``step`` was trained, ``most`` steps the most it could replay, re-formed from
        ``before`` in ``seconds``."""
        devices = sorted(set(lost))
        replayed = step - self.restore_step
        return (
            RunnerEvent(
                "device_lost",
                step,
                f"lost {', '.join(devices)} ({reason}) during step {step + 1}; restoring"
                f" step {self.restore_step} from in-memory copies ({replayed} steps replayed)",
                {
                    "devices": devices,
                    "step": step,
                    "resume_step": self.restore_step,
                    "steps_replayed": replayed,
                    "copy_interval": copies.cadence.interval,
                    "most_replayed": most,
                },
            ),
            RunnerEvent(
                "recovered",
                self.restore_step,
                f"{before.describe()} -> {self.layout.describe()} in {seconds:.2f} s",
                {
                    "from": before.rows(),
                    "to": self.layout.rows(),
                    "micro_batches": list(self.layout.split),
                    "seconds": seconds,
                    "steps_replayed": replayed,
                },
            ),
        )


def survey(group: WorkerGroup, layout: Layout, timeout: float) -> dict[int, dict[str, Any]]:
    """What each worker answering within ``timeout`` holds (``saved_steps``), by position;
    a live worker answers once the calls of the broken step have failed. Told first that
    the loss is surveyed (``MOOT``), a worker's calls still waiting for a result the loss
    may have cut off (a lost worker's activation, or its copy) give up at once."""
    for w in range(len(layout.plans)):
        group.submit(w, MOOT)
    handles = {w: group.submit(w, "saved_steps") for w in range(len(layout.plans))}
    deadline = time.monotonic() + timeout
    answers: dict[int, dict[str, Any]] = {}
    for w, handle in handles.items():
        try:
            (answers[w],) = group.get([handle], max(0.0, deadline - time.monotonic()))
        except (StageLost, GroupTimeout, StageFailed):
            continue
    return answers


Source = tuple[int, str | None]
"""Where a saved piece is: a survivor's position and None for its own copy, or the lost
worker's device id whose copy it holds."""


def _lost(layout: Layout, answers: Mapping[int, Any]) -> tuple[str, ...]:
    """The devices of the workers that did not answer, in layout order."""
    return tuple(p.device.id for w, p in enumerate(layout.plans) if w not in answers)


def saved_pieces(
    layout: Layout, answers: Mapping[int, Mapping[str, Any]], step: int
) -> list[tuple[Source, Piece]]:
    """Every piece of ``step`` the survivors can give: their own copies' and those they
    hold for lost workers."""
    lost = _lost(layout, answers)
    found: list[tuple[Source, Piece]] = []
    for w, answer in answers.items():
        found += [((w, None), tuple(piece)) for piece in answer["own"].get(step, ())]
        for owner, copies in answer["copies"].items():
            if owner in lost:
                found += [((w, owner), tuple(piece)) for piece in copies.get(step, ())]
    return found


def restore_step(
    layout: Layout, answers: Mapping[int, Mapping[str, Any]], num_blocks: int
) -> int | None:
    """The latest step every survivor can roll back to and every block is held at."""
    common: set[int] = (
        set.intersection(*(set(a["own"]) for a in answers.values())) if answers else set()
    )
    for step in sorted(common, reverse=True):
        pieces = [piece for _, piece in saved_pieces(layout, answers, step)]
        if whole_blocks(pieces) >= set(range(num_blocks)):
            return step
    return None


def _fetch(group: WorkerGroup, step: int, wanted: Mapping[Source, list[int]]) -> list[Handle]:
    return [
        group.submit(w, "export_copy", owner, step, blocks) for (w, owner), blocks in wanted.items()
    ]


def plan_survivors(
    snapshot: JobSnapshot, layout: Layout, alive: Sequence[int], gflops: Mapping[str, float]
) -> tuple[Layout, dict[int, int]]:
    """The new layout over the survivors' devices and which survivor becomes which worker."""
    devices = [d for w in alive for d in layout.plans[w].group]
    planned = plan_layout(
        devices,
        gflops,
        costs=snapshot.block_costs or uniform_costs(snapshot.num_blocks),
        stages=None,
        replicas=None,
        workload=snapshot.workload(),
    )
    new = Layout(
        stage_plans(planned.devices, planned.ranges, planned.tensor),
        tuple(planned.plan.micro_batches),
    )
    # A survivor stays a worker where the new layout gives it the devices it holds.
    where = {layout.plans[w].group: w for w in alive}
    keep = {w: where[p.group] for w, p in enumerate(new.plans) if p.group in where}
    return new, keep


def recover(
    group: WorkerGroup,
    layout: Layout,
    snapshot: JobSnapshot,
    gflops: Mapping[str, float],
    timeout: float,
    *,
    ping_timeout: float = MIN_PING_S,
) -> Recovery:
    """Re-form the job on the workers that answer, from the restore step's state; raises
    ``StageLost`` when that cannot be done (too few devices left for ``min_devices``, no
    layout of the job fits them, or no step every block was kept at): the job then resumes
    from its checkpoint elsewhere."""
    answers = survey(group, layout, max(MIN_PING_S, ping_timeout))
    alive = sorted(answers)
    lost = _lost(layout, answers)
    first_lost = next(w for w in range(len(layout.plans)) if w not in answers) if lost else 0
    plan = layout.plans[first_lost]
    if len(alive) < max(1, snapshot.min_devices):
        raise StageLost(
            plan.index,
            plan.device.id,
            f"{len(alive)} devices left, min_devices is {snapshot.min_devices}",
        )
    step = restore_step(layout, answers, snapshot.num_blocks)
    if step is None:
        raise StageLost(plan.index, plan.device.id, "no step whose state every block kept")
    try:
        new, keep = plan_survivors(snapshot, layout, alive, gflops)
    except PartitionError as exc:
        raise StageLost(
            plan.index, plan.device.id, f"the {len(alive)} devices left cannot hold the job: {exc}"
        ) from exc
    saved = saved_pieces(layout, answers, step)
    # Every fetch of a survivor's own copy before any rollback (calls run in order).
    fetched = {
        w: _fetch(group, step, fetch_plan(saved, range(*layout.plans[w].blocks), (w, None)))
        for w in alive
    }
    group.get([group.submit(w, "rollback", step, *fetched[w]) for w in alive], timeout)
    holders = {block: w for w in alive for block in range(*layout.plans[w].blocks)}
    moved: dict[int, list[Handle]] = {}
    for w, p in enumerate(new.plans):
        held = set(range(*layout.plans[keep[w]].blocks)) if w in keep else set()
        live: dict[int, list[int]] = {}
        for block in range(*p.blocks):
            if block not in held and block in holders:
                live.setdefault(holders[block], []).append(block)
        gone = [b for b in range(*p.blocks) if b not in held and b not in holders]
        moved[w] = [group.submit(u, "export", blocks) for u, blocks in live.items()]
        moved[w] += _fetch(group, step, fetch_plan(saved, gone))
    settle(group, new, keep, moved, timeout, regroup=True)
    return Recovery(new, step, lost)
