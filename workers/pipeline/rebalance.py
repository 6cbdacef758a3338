"""Runtime repartitioning in the runner: the running layout, when to ask the elastic policy,
moving blocks between workers, and the events that tell the story.

The decision is ``scheduler.elastic`` (pure); this module feeds it the measured times of
the layout now running and carries out a ``Repartition`` at a step boundary: every worker
whose block range changes ``adopt``s its new range, built from the ``export``ed states of
the blocks' current holders in its own replica, actor to actor (the handles of the exports
are the adopts' arguments, so the states never pass through the runner). Moving a block
moves its parameters and optimizer state bit for bit, so the math is unchanged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shoal.scheduler.elastic import Decision, Repartition, StageSample, current_plan, decide
from shoal.scheduler.partition import PartitionPlan
from shoal.scheduler.profile import uniform_costs
from shoal.scheduler.tensor import per_device
from shoal.scheduler.workload import DeviceCapacity
from shoal.workers.pipeline.worker_group import Handle, WorkerGroup
from shoal.workers.snapshot import (
    JobSnapshot,
    RunnerEvent,
    StagePlan,
    StepMetrics,
    partition_rows,
    row_devices,
)

Policy = Callable[["Layout", Sequence[Sequence[StageSample]]], Decision]
"""Asked after a step: the running layout and the samples measured since it began."""


@dataclass(frozen=True)
class Layout:
    """What runs now: the workers' plans, replica-major, and each replica's micro-batches."""

    plans: tuple[StagePlan, ...]
    split: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.plans) // len(self.split)

    def plan(self) -> PartitionPlan:
        depth = self.depth
        return current_plan(
            [
                (
                    [self.plans[r * depth + s].device.id for r in range(len(self.split))],
                    self.plans[s].blocks,
                )
                for s in range(depth)
            ],
            self.split,
        )

    def rows(self) -> list[dict[str, Any]]:
        """The partition as the API shows it (``partition_rows``)."""
        return partition_rows(self.plans)

    def with_plan(self, plan: PartitionPlan) -> Layout:
        """This layout's workers holding ``plan``'s cut and micro-batch shares."""
        if plan.device_ids != self.plan().device_ids:
            raise ValueError(
                f"the new plan uses devices {list(plan.device_ids)}, the workers are on"
                f" {list(self.plan().device_ids)}; only a re-cut over the same devices moves"
                " blocks between running workers"
            )
        plans = tuple(replace(p, blocks=plan.stages[p.index].blocks) for p in self.plans)
        return Layout(plans, tuple(plan.micro_batches))

    def holder(self, block: int, replica: int) -> int:
        """The worker holding ``block`` in ``replica`` (replica 0 if there is no such one)."""
        r = replica if replica < len(self.split) else 0
        depth = self.depth
        return next(
            r * depth + s
            for s in range(depth)
            if self.plans[r * depth + s].blocks[0] <= block < self.plans[r * depth + s].blocks[1]
        )

    def samples(self, metrics: StepMetrics) -> list[StageSample]:
        return [
            StageSample(p.device.id, p.blocks, self.split[p.replica], t.compute_s)
            for p, t in zip(self.plans, metrics.stages, strict=True)
        ]

    def describe(self) -> str:
        return ", ".join(f"{p.blocks[0]}-{p.blocks[1] - 1}@{p.device.id}" for p in self.plans)

    def not_moved(self, step: int, why: str, device_id: str | None = None) -> RunnerEvent:
        """The ``relayout_failed`` event of a move to this layout that did not happen
        (``why``; ``device_id``: the device whose worker could not start): the controller's
        move is over, and it may ask again."""
        data: dict[str, Any] = {"to": self.rows(), "reason": why}
        if device_id is not None:
            data["device_id"] = device_id
        message = f"the move to {self.describe()} did not happen: {why}"
        return RunnerEvent("relayout_failed", step, message, data)


@dataclass(frozen=True)
class MoveRequest:
    """A relayout asked of the runner: to ``layout``, planned while the job was on the
    devices ``since`` (None: whatever it is on)."""

    layout: Layout
    since: frozenset[str] | None = None

    def stale(self, now: Layout) -> bool:
        """Whether the job is on other devices than it was planned from (it recovered from
        a loss meanwhile): the move is dropped then, and the controller asks again."""
        return self.since is not None and self.since != frozenset(row_devices(now.rows()))


def snapshot_policy(snapshot: JobSnapshot) -> Policy | None:
    """The job's elastic policy: ``scheduler.elastic.decide`` on the job's block costs and
    its devices' memory (asked every ``window_steps`` steps: ``policy_every``); None if off."""
    conf = snapshot.elastic
    if conf is None:
        return None
    workload = snapshot.workload()
    costs = per_device(snapshot.block_costs or uniform_costs(snapshot.num_blocks), workload.tensor)

    def policy(layout: Layout, history: Sequence[Sequence[StageSample]]) -> Decision:
        devices = [
            DeviceCapacity(p.device.id, 1.0, min(d.usable_bytes for d in p.group))
            for p in layout.plans
        ]
        return decide(
            layout.plan(),
            costs,
            devices,
            workload,
            history,
            conf,
            sync_s_per_byte=1 / conf.transfer_bytes_per_s,
        )

    return policy


def policy_every(snapshot: JobSnapshot) -> int:
    """After how many steps of a layout its policy is asked again: the job's measuring
    window (``ElasticConfig.window_steps``), else after every step."""
    return snapshot.elastic.window_steps if snapshot.elastic is not None else 1


def move_blocks(
    group: WorkerGroup,
    old: Layout,
    new: Layout,
    timeout: float,
    keep: Mapping[int, int] | None = None,
) -> None:
    """Make the group run ``new``, every block's state carried over from ``old``.

    ``keep[w]``: the old worker that becomes worker ``w`` (by default each worker stays
    where it is and only block ranges change). Every block a worker lacks is ``export``ed by
    its holder in the same replica (replica 0 for a replica the old layout did not have:
    replicas are identical after a step), all exports submitted before anything else, so a
    worker hands its blocks out before it drops or leaves them; kept workers ``adopt`` their
    new range, new ones ``load``. Workers left out are stopped once all is loaded.
    """
    unshard(group, old, timeout)
    kept = dict(keep) if keep is not None else {w: w for w in range(len(new.plans))}
    sources: dict[int, list[Handle]] = {}
    for w, plan in enumerate(new.plans):
        held = set(range(*old.plans[kept[w]].blocks)) if w in kept else set()
        wanted: dict[int, list[int]] = {}
        for block in range(*plan.blocks):
            if block not in held:
                wanted.setdefault(old.holder(block, plan.replica), []).append(block)
        sources[w] = [group.submit(u, "export", blocks) for u, blocks in wanted.items()]
    same_workers = kept == {w: w for w in range(len(old.plans))} and len(new.plans) == len(
        old.plans
    )
    unchanged = {
        w
        for w, plan in enumerate(new.plans)
        if w in kept
        and (plan.index, plan.blocks) == (old.plans[kept[w]].index, old.plans[kept[w]].blocks)
    }
    regroup = not same_workers or len(new.split) != len(old.split)
    settle(group, new, kept, sources, timeout, regroup=regroup, skip=unchanged)


def unshard(group: WorkerGroup, layout: Layout, timeout: float) -> None:
    """Give sharded replicas their blocks' whole state back (``workers.pipeline.sharding``),
    every worker at once: before the state is read or moved. A no-op for whole replicas."""
    group.get([group.submit(w, "unshard") for w in range(len(layout.plans))], timeout)


def settle(
    group: WorkerGroup,
    new: Layout,
    keep: Mapping[int, int],
    sources: Mapping[int, Sequence[Handle]],
    timeout: float,
    *,
    regroup: bool,
    skip: Collection[int] = (),
) -> None:
    """The second half of a move, once the ``sources`` (exports) are submitted: the group
    becomes ``new`` (``regroup``), kept workers adopt their range and new ones load theirs
    from their sources (workers in ``skip`` have nothing to do), then the left-out ones stop."""
    if regroup:
        group.regroup(new.plans, keep)
    calls = [
        group.submit(w, "adopt", plan.index, plan.blocks, *sources[w])
        if w in keep
        else group.submit(w, "load", *sources[w])
        for w, plan in enumerate(new.plans)
        if w not in skip
    ]
    group.get(calls, timeout)
    group.retire()


class Rebalancer:
    """Collects each step's samples for the layout running, asks the policy after every
    ``every``-th of them, and moves."""

    def __init__(
        self,
        policy: Policy,
        every: int,
        timeout: float,
        record: Callable[[RunnerEvent], None],
    ) -> None:
        self._policy = policy
        self._every = every
        self._timeout = timeout
        self._record = record
        self._history: list[list[StageSample]] = []
        self._step_times: list[float] = []
        self._pending: tuple[int, float, float] | None = None
        """After a move: its step, the median step seconds before it, the predicted gain."""

    def after_step(self, group: WorkerGroup, layout: Layout, metrics: StepMetrics) -> Layout:
        """The layout to run the next step on (``layout`` unless the policy moved blocks)."""
        self._history.append(layout.samples(metrics))
        self._step_times.append(metrics.step_time_s)
        if len(self._history) >= _RESULT_STEPS:
            self._report_result(metrics.step)
        if not self.asks(len(self._history)):
            return layout
        decision = self._policy(layout, self._history)
        if not isinstance(decision, Repartition):
            return layout
        self._report_result(metrics.step)  # a move before the result's steps: what there is
        new = layout.with_plan(decision.plan)
        started = time.perf_counter()
        move_blocks(group, layout, new, self._timeout)
        seconds = time.perf_counter() - started
        self._record(_moved_event(metrics.step, layout, new, decision, seconds))
        before = statistics.median(self._step_times)
        self._pending = (metrics.step, before, decision.predicted_gain)
        self._history, self._step_times = [], []
        return new

    def asks(self, samples: int) -> bool:
        """Whether the policy is asked (and may move blocks) once ``samples`` steps of the
        running layout are in."""
        return samples % self._every == 0

    def asks_after(self, steps: int) -> bool:
        """Whether the policy is asked after the next ``steps`` steps."""
        return self.asks(len(self._history) + steps)

    def steps_to_ask(self, unrecorded: int = 0) -> int:
        """How many steps from now until the policy is next asked, ``unrecorded`` steps
        (trained, not yet passed to ``after_step``) counted as done."""
        return self._every - (len(self._history) + unrecorded) % self._every

    def restart(self) -> None:
        """The layout changed by other means (a relayout): measure it from scratch."""
        self._history, self._step_times, self._pending = [], [], None

    def _report_result(self, step: int) -> None:
        if self._pending is None or not self._step_times:
            return
        moved_at, before, predicted = self._pending
        after = statistics.median(self._step_times)
        measured = 1.0 - after / before if before > 0 else 0.0
        self._record(
            RunnerEvent(
                "repartition_result",
                step,
                f"the re-cut at step {moved_at}: step {before:.3g} s -> {after:.3g} s"
                f" ({measured:.0%} faster measured, {predicted:.0%} predicted)",
                {
                    "moved_at": moved_at,
                    "step_s_before": before,
                    "step_s_after": after,
                    "measured_gain": measured,
                    "predicted_gain": predicted,
                },
            )
        )
        self._pending = None


_RESULT_STEPS = 3
"""Steps on a new layout whose median step time is its measured result."""


def _moved_event(
    step: int, old: Layout, new: Layout, decision: Repartition, seconds: float
) -> RunnerEvent:
    return RunnerEvent(
        "repartition",
        step,
        f"re-cut {old.describe()} -> {new.describe()} in {seconds:.2f} s: {decision.reason}",
        {
            "from": old.rows(),
            "to": new.rows(),
            "micro_batches": list(new.split),
            "moved_blocks": list(decision.moved_blocks),
            "moved_bytes": decision.moved_bytes,
            "current_step_s": decision.current_step_s,
            "predicted_step_s": decision.predicted_step_s,
            "predicted_gain": decision.predicted_gain,
            "estimated_migration_s": decision.migration_s,
            "migration_s": seconds,
            "speeds": dict(decision.speeds),
        },
    )
