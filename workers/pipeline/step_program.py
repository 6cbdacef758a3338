"""One stage's step program, run against its neighbours: receives, forwards, sends, backwards.

``scheduler.programs`` turns the pipeline schedule into one program per stage (the stage's
own GPipe or 1F1B order, with every transfer posted in the order its neighbour posts it);
``run_program`` carries one out on a ``Stage`` over its ``Links``. Sends are posted as soon
as their tensor is computed and waited only at the end of the step; a receive is posted
when the program says (possibly early, to keep the pair's order) and waited right before
the forward or backward that needs it. Nothing reads a value back from the device: the
losses stay tensors until the step's one read.

The forwards and backwards are the stage's own (``Stage.forward_tensor`` and the rest), in
the schedule's order, so the arithmetic and the RNG draws are those of the relayed path
(``workers.pipeline.step_driver``): the two are bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from shoal.scheduler.programs import Flow, Post, Program, Run, Transfer, Wait
from shoal.scheduler.schedules import Op
from shoal.workers.pipeline.timing import StepTimer
from shoal.workers.pipeline.transport import Links, Pending, Shape


class ProgramStage(Protocol):
    """What a step program runs on: a ``workers.pipeline.stage.Stage``'s forwards and backwards."""

    index: int
    first: bool
    last: bool

    def forward_tensor(self, mb: int, inp: Tensor) -> Tensor: ...

    def loss_tensor(self, mb: int, inp: Tensor, target: Tensor, scale: float) -> Tensor: ...

    def backward_tensor(self, mb: int, upstream: Tensor | None) -> Tensor | None: ...


@dataclass
class _Step:
    """The transfers of one step on one stage."""

    stage: ProgramStage
    links: Links
    timer: StepTimer
    inputs: Tensor | None
    targets: Tensor | None
    rows: int
    scale: float
    posted: dict[tuple[Flow, int], Pending] = field(default_factory=dict)
    ready: dict[tuple[Flow, int], Tensor] = field(default_factory=dict)
    produced: dict[tuple[Flow, int], Tensor] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    losses: list[Tensor] = field(default_factory=list)
    # This step's activation shapes: what arrives from the previous stage, what goes on.
    shape_in: Shape | None = None
    shape_out: Shape | None = None

    def post(self, transfer: Transfer) -> None:
        link = self.links[transfer.peer]
        key = (transfer.flow, transfer.microbatch)
        if transfer.send:
            tensor = self.produced.pop(key)
            if transfer.flow is Flow.ACT:
                self._check_out(tensor)
            self.sends.append(link.send(tensor))
        elif transfer.flow is Flow.ACT:
            if self.shape_in is None:  # the step's first activation: its header first
                with self.timer.span("wait"):
                    self.shape_in = link.recv_header()
            self.posted[key] = link.recv(self.shape_in)
        else:
            if self.shape_out is None:
                raise RuntimeError(f"gradient {key[1]} posted before any activation was sent")
            self.posted[key] = link.recv(self.shape_out)

    def _check_out(self, tensor: Tensor) -> None:
        shape = Shape.of(tensor)
        if self.shape_out is None:
            self.shape_out = shape
            self.sends.append(self.links[+1].send_header(shape))
        elif shape != self.shape_out:
            raise ValueError(
                f"stage {self.stage.index} produced an activation of {shape}, the step's"
                f" first was {self.shape_out}: every micro-batch's activation must have one"
                " shape and dtype"
            )

    def wait(self, transfer: Transfer) -> None:
        key = (transfer.flow, transfer.microbatch)
        with self.timer.span("wait"):
            self.ready[key] = self.posted.pop(key).wait()

    def run(self, op: Op, j: int) -> None:
        stage = self.stage
        if op is Op.F:
            inp = self._rows(self.inputs, j) if stage.first else self.ready.pop((Flow.ACT, j))
            if stage.last:
                target = self._rows(self.targets, j)
                self.losses.append(stage.loss_tensor(j, inp, target, self.scale))
            else:
                self.produced[(Flow.ACT, j)] = stage.forward_tensor(j, inp)
            return
        upstream = None if stage.last else self.ready.pop((Flow.GRAD, j))
        grad = stage.backward_tensor(j, upstream)
        if not stage.first:
            if grad is None:
                raise RuntimeError(
                    f"stage {stage.index}'s input got no gradient in micro-batch {j}: its"
                    " blocks' output does not depend on their input"
                )
            self.produced[(Flow.GRAD, j)] = grad

    def _rows(self, batch: Tensor | None, j: int) -> Tensor:
        if batch is None:
            raise RuntimeError(f"stage {self.stage.index} got no batch for its step")
        return batch[j * self.rows : (j + 1) * self.rows]

    def finish(self) -> None:
        with self.timer.span("wait"):
            for pending in self.sends:
                pending.wait()
        self.sends.clear()


def run_program(
    stage: ProgramStage,
    links: Links,
    timer: StepTimer,
    program: Program,
    inputs: Tensor | None,
    targets: Tensor | None,
    rows: int,
    scale: float,
) -> list[Tensor]:
    """Run ``program`` on ``stage``: micro-batch j's inputs (stage 0) and targets (the
    last stage) are rows ``j * rows`` onwards of ``inputs`` and ``targets``. The losses of
    the last stage's micro-batches, in order, as device tensors."""
    step = _Step(stage, links, timer, inputs, targets, rows, scale)
    for instruction in program:
        if isinstance(instruction, Post):
            for transfer in instruction.transfers:
                step.post(transfer)
        elif isinstance(instruction, Wait):
            step.wait(instruction.transfer)
        elif isinstance(instruction, Run):
            step.run(instruction.action.op, instruction.action.microbatch)
    step.finish()
    return step.losses
