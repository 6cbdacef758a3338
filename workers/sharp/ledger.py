"""A model's step kept task by task off its devices, so a lost device costs the SHARP
executor only the tasks in flight (Hydra's promise) instead of the step under way.

While a model's copies are taken at every step (``scheduler.copies``: they fit its budget),
each of its tasks copies off its device what the step so far depends on (``Record``): a
forward's outputs and the RNG states its micro-batches ran under, a backward's output
gradients; and its shard's states after the step, copied beside the tasks after it
(``ShardHost.copied``), arrive apart. With the copy of the step's start
(``ModelRun.saved``), that is every shard as the tasks done have left it: those whose
backward ran as it stepped them, the others as the step found them, each holding the
micro-batches it ran forward and not yet backward (their inputs, the outputs of the
forward before, and RNG states: ``Handover``). A model then picks up at its next task on
whichever devices are left, and its math is the same. At the step's end every shard's
states are in, or on their way: they are the step's copy, and no other copy is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.scheduler.sharp import ModelPlan, Op, Shard
from shoal.workers.sharp.shard_types import Handover, Outputs, Record, Replays
from shoal.workers.wire import Wire

if TYPE_CHECKING:
    from shoal.workers.sharp.shard_pool import Call


def part(shard: Shard, blocks: Mapping[int, Any] | None) -> dict[int, Any] | None:
    """``shard``'s blocks' states out of ``blocks`` (by block index); None when there are
    none."""
    return {i: blocks[i] for i in range(*shard.blocks)} if blocks else None


@dataclass
class Ledger:
    """What the tasks of one step of a model have copied off its devices so far."""

    step: int
    batch: Callable[[], list[Wire | None]]
    """Draws the step's micro-batches, its first forward's inputs (the hosts draw their own:
    only a first shard rebuilt mid-step is given them)."""
    outputs: dict[int, Outputs] = field(default_factory=dict)
    """Each task's outputs for the task after it, by chain position."""
    replays: dict[int, Replays] = field(default_factory=dict)
    """The RNG states of each shard's forwards, by shard index."""
    states: dict[int, dict[int, Any]] = field(default_factory=dict)
    """Each shard's block states once its backward stepped it, by shard index."""
    seconds: float = 0.0
    """What the copies cost: the seconds taking them held the devices and their way to
    the executor took (as a copy's, ``ModelRun.took_part``)."""
    waiting: dict[Call, int] = field(default_factory=dict)
    """The calls that bring a stepped shard's states (``ShardHost.copied``), and the shard."""
    reopened: bool = False
    """Its step ended and was recorded, then ran again from a part of its copy a loss cut
    short (``reopen``)."""

    def add(self, plan: ModelPlan, position: int, record: Record, arrived: float) -> None:
        """The task at ``position`` ended with ``record``, here at wall time ``arrived``."""
        task = plan.task(position)
        if task.step != self.step:
            raise ValueError(f"task {position} is of step {task.step}, not {self.step}")
        self.outputs[position] = record.outputs
        if task.op is Op.FORWARD:
            self.replays[task.shard] = record.replays
        self._cost(record.seconds, record.finished, arrived)

    def expect(self, call: Call, shard: int) -> None:
        """``call`` brings ``shard``'s states as its backward's step leaves them."""
        self.waiting[call] = shard

    def arrived(
        self, call: Call, states: dict[int, Any], seconds: float, finished: float, now: float
    ) -> bool:
        """``call`` answered with ``states``, taken in ``seconds`` and sent at wall time
        ``finished``; whether it was one this ledger waits for."""
        shard = self.waiting.pop(call, None)
        if shard is None:
            return False
        self.states[shard] = states
        self._cost(seconds, finished, now)
        return True

    def _cost(self, seconds: float, finished: float, arrived: float) -> None:
        # Its taking, and its way here: on a node whose cores train too, both cost them.
        self.seconds += seconds + max(0.0, arrived - finished)

    def blocks(self) -> dict[int, Any]:
        """Every block's states the stepped shards' copies have brought so far."""
        return {i: s for states in self.states.values() for i, s in states.items()}

    def copy(self, plan: ModelPlan) -> dict[int, Any] | None:
        """Every block's states after the step, once every shard's backward is in."""
        return self.blocks() if len(self.states) == len(plan.shards) else None

    def covers(self, plan: ModelPlan, done: int, saved: tuple[int, Any] | None) -> bool:
        """The model can pick up at task ``done`` of this step from here, with ``saved``
        (its last copy) of the step's start: every task before it is recorded, and the
        states of the shards it stepped are in."""
        n = len(plan.shards)
        first = self.step * 2 * n
        stepped = range(max(0, 2 * n - (done - first)), n)  # their backwards are done
        return (
            saved is not None
            and saved[0] == self.step
            and first < done < first + 2 * n
            and all(p in self.outputs for p in range(first, done))
            and all(shard in self.states for shard in stepped)
        )

    def reopen(
        self,
        plan: ModelPlan,
        blocks: Mapping[int, Any],
        missing: set[int],
        saved: tuple[int, Any],
    ) -> int | None:
        """This step's tasks all ended, but the copies of the shards ``missing`` were lost
        on their way (with their device): the task to pick up at again, the first backward
        that stepped one of them, with ``saved`` the copy of the step's start; None where
        it is not. The other shards' states are those in ``blocks`` (the parts that came)."""
        n = len(plan.shards)
        for shard in plan.shards:
            if shard.index not in missing:
                self.states.setdefault(shard.index, part(shard, blocks) or {})
        at = (self.step + 1) * 2 * n - 1 - max(missing)
        self.reopened = self.covers(plan, at, saved)
        return at if self.reopened else None

    def handover(
        self, plan: ModelPlan, done: int, shard: Shard, start: Mapping[int, Any]
    ) -> Handover:
        """``shard`` as the model's first ``done`` tasks left it (``start``: every block's
        states at the step's start), with the inputs and RNG states of the micro-batches it
        holds between its forward and its backward."""
        n, first = len(plan.shards), self.step * 2 * len(plan.shards)
        at = done - first
        forward, backward = shard.index, 2 * n - 1 - shard.index
        state = self.states[shard.index] if backward < at else (part(shard, start) or {})
        if not forward < at <= backward:
            return Handover(state, {}, False, None, {})
        xs = self.batch() if shard.index == 0 else self.outputs[first + forward - 1]
        inputs = {mb: x for mb, x in enumerate(xs) if x is not None}
        return Handover(state, inputs, shard.index == n - 1, None, self.replays[shard.index])

    def carry(self, plan: ModelPlan, done: int) -> Outputs | None:
        """The inputs of the model's task at ``done``: the outputs of the one before (none
        for the last shard's backward, which starts from the losses)."""
        before = plan.task(done - 1)
        if before.op is Op.FORWARD and before.shard == len(plan.shards) - 1:
            return None
        return self.outputs[done - 1]
