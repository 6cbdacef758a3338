"""One model's state in the SHARP executor (``workers.sharp.runner``): where its shards
live, how far its chain of shard tasks has got, its copies and its log; and a shard task in
flight."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.scheduler.copies import CopyCadence
from shoal.scheduler.devices import Device
from shoal.scheduler.sharp import Assignment, ModelPlan, Op, Shard, ShardTask
from shoal.workers.pipeline.recovery import copies_event
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.run_log import RunLog
from shoal.workers.sharp.ledger import Ledger, part
from shoal.workers.sharp.shard_pool import Call, HostPool
from shoal.workers.sharp.shard_types import Drawn, ShardKey, Stashed
from shoal.workers.snapshot import JobSnapshot, RunnerEvent, RunStatus, StepMetrics
from shoal.workers.wire import Wire, send
from shoal.workers.zoo.data import DataSource

Blocks = Mapping[int, Any]
"""Block states by block index (in wire form), as gathered, copied or checkpointed."""

_LEAVING = object()
"""A task's outputs leave its device: its call's outputs, once it is submitted."""


@dataclass
class Copying:
    """A copy of a model's shards after ``step`` steps, taken by their hosts (``copy``
    calls); it replaces the model's ``saved`` copy once every call has answered."""

    step: int
    calls: set[Call]
    blocks: dict[int, Any] = field(default_factory=dict)
    seconds: float = 0.0
    """What it cost: the seconds the hosts spent taking it and its parts took to arrive."""
    ledger: Ledger | None = None
    """The step's ledger where its tasks took it: every part was started, its calls only
    hand them over, and a loss before all are in picks up at the first part it lost."""
    checkpoint: bool = False
    """It is the model's last checkpoint (of its last ``step``): written once every part is
    in, and the model ends (``SharpTrainer._copied``)."""


@dataclass
class Trade:
    """A trade of places a model takes part in (``workers.sharp.trading``): the device it
    goes to and the model living there, which comes to its device in turn. The model
    ``coming`` queues no task until the other hands its device over."""

    there: int
    partner: str
    coming: bool


@dataclass
class ModelRun:
    """One model's training state in the executor."""

    snap: JobSnapshot
    plan: ModelPlan
    data: DataSource
    homes: list[int]
    """The pool position of the device holding each shard."""
    done: int = 0
    """Tasks finished, in chain order (``ModelPlan.task`` positions)."""
    submitted: int = 0
    """Tasks handed to a device: those from ``done`` on are in flight, each queued behind
    the one before it in the chain (``_dispatch``)."""
    last_host: int = -1
    """The device of its last submitted task."""
    ratio: float = 1.0
    """Its tasks' measured seconds over their reference seconds (``refine_ratio``)."""
    timed: bool = False
    """Whether ``ratio`` was measured: before, its work to go is not known in seconds."""
    last_run: int = -1
    carry: Any = None
    """The inputs of the model's next task to submit: the step's batch (``Drawn``), a
    ``HostPool.outputs`` handle (made on another device) or ``Stashed`` (kept on its own
    device)."""
    targets: Drawn | None = None
    losses: list[float] = field(default_factory=list)
    step_started: float = 0.0
    run: RunLog = field(default_factory=RunLog)
    """Its metrics, events and status, as ``SharpTrainer.report`` reads them from other
    threads."""
    saved: tuple[int, dict[int, Any]] | None = None
    """Every block's state at the last copy (``keep_copies``), in this process: what the
    model rolls back to when a device holding one of its shards is lost."""
    copying: Copying | None = None
    """The copy under way: its shards' hosts take it while the executor dispatches on."""
    copies_started: int = 0
    """Copies its hosts were asked for (each ``ShardHost.copy`` names one)."""
    step_compute_s: float = 0.0
    """The device seconds of the step under way's tasks: the copies' yardstick."""
    cadence: CopyCadence = field(init=False)
    """How often the copy is taken (``scheduler.copies``, at the model's budget)."""
    task_copies: bool = False
    """With copies due at every step, its tasks copy the step off the devices as they go
    (``workers.sharp.ledger``): a lost device costs the tasks in flight, not the step."""
    ledger: Ledger | None = None
    """What the step under way's tasks copied off (``task_copies``), until its end."""
    lost: str | None = None
    """Why the model must roll back (a device holding a shard was lost), until it does."""
    placed: int = 0
    """Tasks done when it was placed; while ``done`` is still that, a lost shard is built
    again from ``origin`` (its checkpoint's block states, or None: from its seed)."""
    origin: dict[int, Any] | None = None
    leaving: bool = False
    """It trains no more here: its shards are dropped, and the writer thread ends it
    (SUSPENDED with the checkpoint of the step it stopped at, or LOST) once the checkpoints
    it has under way are written."""

    trade: Trade | None = None
    """The trade of places it takes part in, until the hand-over or a call-off."""
    left: set[int] = field(default_factory=set)
    """Devices it was handed over from in the step under way: one lost before giving
    its shards is one it lost."""

    def __post_init__(self) -> None:
        self.cadence = CopyCadence(self.snap.copy_budget)

    @property
    def scale(self) -> float:
        """A micro-batch's share of the mini-batch: its loss's factor."""
        return (self.snap.batch_size // self.snap.micro_batches) / self.snap.batch_size

    @property
    def active(self) -> bool:
        running = self.status is RunStatus.RUNNING and not self.leaving
        return running and self.done < self.plan.tasks

    @property
    def runnable(self) -> bool:
        return self.active and self.lost is None

    def can_submit(self, host: int) -> bool:
        """Its next task may be queued on ``host``: it has one, its shard lives there, it
        is not the first of a step whose last task's end (its copy, checkpoint,
        suspension) is still to be seen, and its input will be there when ``host`` gets
        to it: the task before it has ended, or runs on ``host`` first (a task waiting
        for a producer elsewhere would hold up the tasks queued behind it); and it is
        not waiting for the other half of a trade (``Trade.coming``)."""
        at = self.submitted
        coming = self.trade is not None and self.trade.coming
        if not (self.runnable and at < self.plan.tasks) or coming:
            return False
        new_step = at % (2 * len(self.plan.shards)) == 0
        ready = self.done == at or (not new_step and self.last_host == host)
        return self.homes[self.plan.shard_at(at).index] == host and ready

    def restart(self, step: int) -> None:
        """Train on from the end of ``step`` (placed from a checkpoint, or rolled back)."""
        self.done = self.submitted = step * 2 * len(self.plan.shards)
        self.carry, self.losses, self.ledger = None, [], None

    def submit(
        self,
        pool: HostPool,
        host: int,
        tasks: Sequence[Assignment],
        clock: Callable[[], float],
        timeout: float,
    ) -> tuple[list[Call], list[Call]]:
        """Queue ``tasks`` (its next, from ``submitted`` on, each with the task whose shard
        to prefetch after it) on ``host`` one after another, as one call of its worker where
        the pool can (``HostPool.submit_run``), and note where the task after them takes
        its inputs from. A step's first task starts the step (``clock``: its start), its
        host drawing the batch. Only the first ``next_call`` of them are queued: where its
        tasks are recorded each must come back as it ends, not with a run's last (a device
        lost mid-run would take the records of the tasks it had done with it). The calls of
        the tasks queued, and where recorded, the calls beside that bring the stepped
        shards' copies once their backwards end (waiting up to ``timeout`` s for a copy's
        making)."""
        runs: list[tuple[str, tuple[Any, ...]]] = []
        copies: list[tuple[ShardKey, int]] = []
        for task, after in ((a.task, a.prefetch) for a in tasks[: self.next_call()]):
            if task.op is Op.FORWARD and task.shard == 0:
                self._begin_step(task.step, clock())
            prefetch = None if after is None else (after.model, after.shard)
            runs.append(self._task_call(host, task, prefetch, copies))
            self.submitted += 1
        calls = pool.submit_run(host, runs)
        # A call whose task takes a copy is that task alone (``next_call``): its backward.
        copied = [pool.submit_after(host, calls[-1], "copied", *c, timeout) for c in copies]
        for call, (key, _) in zip(copied, copies, strict=True):
            assert self.ledger is not None  # the tasks that take copies have one
            self.ledger.expect(call, key[1])
        if self.carry is _LEAVING:  # only a run's last task's may: the others' next is here
            self.carry = pool.outputs(calls[-1])
        self.last_host = host
        return calls, copied

    def _task_call(
        self,
        host: int,
        task: ShardTask,
        prefetch: ShardKey | None,
        copies: list[tuple[ShardKey, int]],
    ) -> tuple[str, tuple[Any, ...]]:
        """The call of ``task``, the next to submit (``submitted``), on ``host``: its
        method and arguments; the copy it starts, where it takes one, goes into
        ``copies``. Its outputs are the ``carry`` of the task after it: ``Stashed`` where
        that runs on ``host`` too, else a mark that they leave (the call's outputs, once
        submitted), or None where it takes none."""
        key = (self.snap.job_id, task.shard)
        plan, position = self.plan, self.submitted
        record = self.ledger is not None
        last = task.shard == len(plan.shards) - 1
        # A forward's activations go to the next shard's forward, a backward's gradients
        # to the shard before's backward; the last forward and the first backward, one
        # shard's pair, pass nothing (the loss stays in the shard), nor does the last task.
        passes = (task.shard > 0) if task.op is Op.BACKWARD else not last
        after = plan.shard_at(position + 1).index if passes else None
        keep = position + 1 if after is not None and self.homes[after] == host else None
        inputs = self.carry
        self.carry = Stashed(keep) if keep is not None else (_LEAVING if passes else None)
        if task.op is Op.FORWARD:
            if last:
                return "forward", (key, inputs, self.targets, self.scale, prefetch, keep, record)
            return "forward", (key, inputs, None, 1.0, prefetch, keep, record)
        grads = [None] * self.snap.micro_batches if last else inputs
        copy = None
        if self.ledger is not None:
            self.copies_started += 1
            copy = (task.step + 1, self.copies_started)
            copies.append((key, self.copies_started))
        return "backward", (key, grads, prefetch, keep, copy)

    def next_call(self) -> int:
        """How many tasks its next call holds: the run from its next task on its device
        (``ModelPlan.run_at``), or that task alone where its step's tasks are recorded
        (``ledger``), each task's record and copy having to come back as it ends."""
        at = self.submitted
        new_step = at % (2 * len(self.plan.shards)) == 0
        recorded = self._records_step() if new_step else self.ledger is not None
        return 1 if recorded else self.plan.run_at(at, self.homes)

    def _records_step(self) -> bool:
        """Whether the step it starts next has its tasks copy it off as they go: copies due
        at every step (``task_copies``). Until a copy was measured its interval is a guess:
        no step's tasks take another while the first is still coming in (on a busy device,
        its cost is a step's share)."""
        measured = self.cadence.decided or self.copying is None
        every_step = self.snap.keep_copies and self.cadence.interval == 1 and measured
        return self.task_copies and every_step

    def _begin_step(self, step: int, now: float) -> None:
        """Step ``step`` starts: its first and last shards' hosts draw its batch (``Drawn``)."""
        self.carry = self.targets = Drawn(step, self.snap.micro_batches)
        recorded = self._records_step()
        self.ledger = Ledger(step, functools.partial(self.batch, step)) if recorded else None
        self.losses = []
        self.step_started = now
        self.step_compute_s = 0.0

    def batch(self, step: int) -> list[Wire | None]:
        """Step ``step``'s inputs, micro-batch by micro-batch in wire form, drawn here: what
        a recovery hands a first shard it rebuilds mid-step (the hosts draw their own)."""
        inputs, _ = self.data.batch(step, self.snap.batch_size)
        rows = self.snap.batch_size // self.snap.micro_batches
        return [send(inputs[j * rows : (j + 1) * rows]) for j in range(self.snap.micro_batches)]

    @property
    def status(self) -> RunStatus:
        return self.run.status

    @property
    def step(self) -> int:
        return self.run.step

    def record(self, item: StepMetrics | RunnerEvent) -> None:
        self.run.record(item)

    def end(self, status: RunStatus, error: str | None = None) -> None:
        self.run.end(status, error)

    def took_part(
        self, call: Call, states: dict[int, Any], seconds: float, finished: float
    ) -> Copying | None:
        """A host's part of the copy under way is in (``states``, taken in ``seconds``,
        sent at wall time ``finished``); once every part is, the copy replaces the last
        one (``keep_copies``), what it took is the copies' measured cost, and it is
        returned whole."""
        copying = self.copying
        if copying is None or call not in copying.calls:
            return None  # dropped meanwhile: the model rolled back, checkpointed or ended
        copying.calls.discard(call)
        copying.blocks.update(states)
        # Its taking, and its way here: on a node whose cores train too, both cost them.
        copying.seconds += seconds + max(0.0, time.time() - finished)
        if copying.calls:
            return None
        self.copying = None
        if self.snap.keep_copies:
            self.keep_copy(copying.step, copying.blocks, copying.seconds)
        return copying

    def keep_copy(self, step: int, blocks: dict[int, Any], seconds: float) -> None:
        """``blocks`` are every block's states after ``step`` steps, a copy that took
        ``seconds``: the model's copy now, and a measure of the copies' cost."""
        self.saved = (step, blocks)
        self.cadence.observe_copy(seconds)
        if self.cadence.plan():
            self.record(copies_event(self.cadence, self.step))

    def drop_copy(self, device_id: str, why: str, *, task_copied: bool) -> None:
        """The copy ``device_id`` was to make a part of was not made (the one the step's
        tasks take, ``task_copied``, or the one the hosts take after a step): the model
        trains on, and a loss rolls it back to the copy before, as the event says."""
        if task_copied:
            self.ledger = None
        else:
            self.copying = None
        kept = self.saved[0] if self.saved is not None else None
        then = (
            f"rolls it back to its copy after step {kept}"
            if kept is not None
            else "ends it lost (no copy is kept yet)"
        )
        self.record(
            RunnerEvent(
                "copy_dropped",
                self.step,
                f"a copy of this model's state was not made on {device_id} ({why}); until"
                f" the next copy is in, a lost device {then}",
                {"device_id": device_id, "kept_step": kept},
            )
        )

    def saved_at(self, step: int) -> dict[int, Any] | None:
        """Its copy in this process (``saved``), if that is of ``step``."""
        return self.saved[1] if self.saved is not None and self.saved[0] == step else None

    def start_copy(
        self, pool: HostPool, step: int, timeout: float, *, checkpoint: bool = False
    ) -> set[Call]:
        """Have its shards' hosts copy it as it is after ``step`` steps (each host takes
        its part after the task it runs, before any later task of the model there, and
        makes it beside the tasks after): the calls that hand the parts over, which it
        waits for (``copying``) while the executor dispatches on; with ``checkpoint``, it is
        the model's last checkpoint too."""
        calls = set(self.copy_calls(pool, step, timeout))
        self.copying = Copying(step, calls, checkpoint=checkpoint)
        return calls

    def copy_calls(self, pool: HostPool, step: int, timeout: float) -> list[Call]:
        """Have its shards' hosts start copying them as they are after the tasks queued
        there so far (``step`` steps; ``ShardHost.copy``) and hand the copies over
        (``ShardHost.copied``, beside the tasks once ``copy`` has ended; waiting up to
        ``timeout`` seconds for its copy to be made): the latter calls, each answering with
        its blocks' states in wire form."""
        self.copies_started += 1
        number, calls = self.copies_started, list[Call]()
        for shard in self.plan.shards:
            key, host = (self.snap.job_id, shard.index), self.homes[shard.index]
            start = pool.submit(host, "copy", key, step, number)
            calls.append(pool.submit_after(host, start, "copied", key, number, timeout))
        return calls

    def add(
        self, pool: HostPool, host: int, shard: Shard, blocks: Blocks | None, *, again: bool = False
    ) -> Call:
        """Load ``shard`` into ``host``'s memory with its blocks' states from ``blocks``
        (None or empty: built from the model's seed); ``again``: whatever ``host`` holds of
        it now is dropped first."""
        setup = StageSetup.of(self.snap, self.data.meta)
        key = (self.snap.job_id, shard.index)
        sizes = (shard.kept_bytes, shard.work_bytes)
        args = (shard.blocks, shard.bytes, part(shard, blocks), again, *sizes, time.time())
        return pool.submit(host, "add", key, setup, *args)

    def take(
        self, pool: HostPool, host: int, shard: Shard, handover: Any, *, again: bool = False
    ) -> Call:
        """Have ``host`` hold ``shard`` as ``handover`` (a ``Handover``, or a handle to one
        another host gives) has it (``again`` as in ``add``)."""
        setup = StageSetup.of(self.snap, self.data.meta)
        key, last = (self.snap.job_id, shard.index), shard.index == len(self.plan.shards) - 1
        targets = self.targets if last else None
        taken = (handover, targets, self.scale, again, shard.kept_bytes, shard.work_bytes)
        args = (setup, shard.blocks, shard.bytes, *taken, time.time())
        return pool.submit(host, "take", key, *args)

    def placement(self, devices: Sequence[Device]) -> RunnerEvent:
        """The event that says where its shards are."""
        where = ", ".join(
            f"{s.blocks[0]}-{s.blocks[1] - 1}@{devices[h].id}"
            for s, h in zip(self.plan.shards, self.homes, strict=True)
        )
        return RunnerEvent(
            "placement",
            self.step,
            f"SHARP: {len(self.plan.shards)} shards: {where}",
            {"executor": "sharp", "stages": self.rows(devices, sizes=True)},
        )

    def moved(
        self,
        devices: Sequence[Device],
        home: int,
        step: int,
        why: str = "at step {step}, where the two devices' models end sooner",
    ) -> None:
        """Record that it moved whole from ``home`` to where it lives now, at ``step``
        (``why``, formatted with it)."""
        old, new = devices[home].id, devices[self.homes[0]].id
        self.record(
            RunnerEvent(
                "relayout",
                step,
                f"SHARP: moved from {old} to {new} {why.format(step=step)}",
                {"to": self.rows(devices), "removed": [old], "added": [new]},
            ),
        )

    def recovered(
        self,
        devices: Sequence[Device],
        gone: Sequence[str],
        reason: str,
        step: int,
        replayed: int,
        bound: int,
        *,
        redone: int | None = None,
    ) -> None:
        """Record that it lost the devices ``gone`` (``reason``) and rolled back to ``step``,
        replaying ``replayed`` steps (at most ``bound`` by its copies' interval); or, with
        ``redone``, that it picked up at a task of step ``step + 1`` from what its tasks
        copied off (``workers.sharp.ledger``), ``redone`` tasks running again (those in
        flight, and of the ``replayed`` steps recorded after it)."""
        lost = ", ".join(gone)
        if redone is None:
            whence = f"restoring step {step} from the copy in host memory"
        else:
            task = self.plan.task(self.done)
            whence = (
                f"picking up at {task.op.value} {task.shard} of step {step + 1} from the"
                f" copies its tasks made ({redone} tasks run again)"
            )
        self.record(
            RunnerEvent(
                "device_lost",
                self.step,
                f"lost {lost} ({reason}); {whence} ({replayed} steps replayed)",
                {
                    "devices": list(gone),
                    "step": self.step,
                    "resume_step": step,
                    "steps_replayed": replayed,
                    "copy_interval": self.cadence.interval,
                    "most_replayed": bound,
                    **({} if redone is None else {"tasks_redone": redone}),
                },
            )
        )
        self.record(
            RunnerEvent(
                "recovered",
                step,
                f"shards re-homed off {lost}",
                {"to": self.rows(devices), "steps_replayed": replayed},
            )
        )

    def rows(self, devices: Sequence[Device], *, sizes: bool = False) -> list[dict[str, Any]]:
        """Its shards as stage rows (its layout, for the control plane), with their state's
        bytes when ``sizes``."""
        return [
            {
                "stage": s.index,
                "replica": 0,
                "device_id": devices[h].id,
                "blocks": list(s.blocks),
                **({"bytes": s.state_bytes} if sizes else {}),
            }
            for s, h in zip(self.plan.shards, self.homes, strict=True)
        ]


@dataclass(frozen=True)
class Task:
    """A shard task in flight: its model, device (pool position), chain position and
    dispatch number (a model's tasks finish in that order)."""

    model: ModelRun
    host: int
    position: int
    number: int
    run: int
    """The dispatch number of the first task of the call it runs in (``ModelRun.submit``)."""
    at: float = 0.0
    """When it was queued (the runner's clock)."""
