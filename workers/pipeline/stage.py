"""One pipeline stage: a contiguous range of blocks on one device, run one micro-batch at a time.

A ``Stage`` is plain Python, run in-process (``LocalGroup``) or as the StageWorker Ray actor
(``RayGroup``) unchanged. Per micro-batch it keeps what its backward needs
(``workers.pipeline.micro_batches``): the autograd graph, or with rematerialization (as in
GPipe) only the input, the forward recomputed in ``backward``. Gradients accumulate over a
mini-batch's micro-batches and ``apply_step`` applies them once: one process's math. With
gradient-norm clipping, ``grad_norms`` and ``apply_step``'s coefficient are this stage's part
of the cross-stage reduction (``workers.pipeline.clipping``); with mixed precision every
forward runs under the job's autocast (``workers.precision``). Every compute call is timed;
a device's ``emulate_slowdown`` f > 1 makes it sleep (f - 1) x its time, counted as compute
(a straggler shows only in measured times); wire conversions are timed as transfer.

Blocks move between stages at step boundaries: ``export`` hands out held blocks' states,
``adopt`` takes a new block range. In-memory copies (``workers.pipeline.recovery``):
``snapshot`` starts copying the blocks beside training (``workers.pipeline.copier``);
``shipment`` hands the finished copy to the worker's buddy and ``hold`` keeps a neighbour's,
both beside the training calls (``COPIES``, ``workers.pipeline.stage_worker``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from shoal.scheduler.programs import programs_for
from shoal.scheduler.types import BlockRange
from shoal.workers.device_memory import Overhead, measure_overhead
from shoal.workers.device_speed import measure_gflops
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.pipeline.batch_rows import Draws, Rows
from shoal.workers.pipeline.clipping import grad_norms, scale_grads
from shoal.workers.pipeline.copier import Copier, Held
from shoal.workers.pipeline.micro_batches import InFlight, RngStates
from shoal.workers.pipeline.pieces import whole_states
from shoal.workers.pipeline.replicas import Replicas
from shoal.workers.pipeline.stage_blocks import build_stage_blocks, stage_devices
from shoal.workers.pipeline.stage_types import (
    StageSetup,
    StageStateError,
    StepOutcome,
    torch_device,
)
from shoal.workers.pipeline.step_program import run_program
from shoal.workers.pipeline.timing import StepClock, StepTimer
from shoal.workers.pipeline.transport import Links
from shoal.workers.precision import autocast, autocast_dtype
from shoal.workers.snapshot import StagePlan
from shoal.workers.wire import Wire, receive, receive_tree, send, send_tree
from shoal.workers.zoo.data import loss_fn

OWN_COPIES, _HELD_COPIES = 3, 2
"""In-memory copies kept: a worker's own, the one being made among them, and those it holds
for each other worker (why: ``workers.pipeline.recovery``)."""


class Stage:
    """The blocks ``plan.blocks`` of a model, on ``plan.device``."""

    def __init__(self, plan: StagePlan, setup: StageSetup) -> None:
        start, stop = plan.blocks
        if not 0 <= start < stop <= setup.num_blocks:
            raise ValueError(
                f"stage {plan.index} holds blocks [{start}, {stop}), not a non-empty range"
                f" of the model's {setup.num_blocks} blocks"
            )
        self.index = plan.index
        self.device_id = plan.device.id
        self.first = start == 0
        self.last = stop == setup.num_blocks
        self.device = torch_device(plan.device)
        self._setup = setup
        retain_freed_memory()  # each step's tensors reuse the last step's pages
        if not plan.device.gpu:
            # Virtual CPU devices share a machine's cores: one thread each keeps them apart.
            torch.set_num_threads(1)
        self._setup_slowdown = plan.device.emulate_slowdown
        self._slowdowns = [d.emulate_slowdown for d in plan.group]
        self._timer = StepTimer(self.device, self._setup_slowdown)
        self._overhead = measure_overhead(self.device)  # before the worker's own tensors
        if plan.tensor_devices and setup.shard != "none":
            raise ValueError(
                "parallelism.shard with tensor parallelism is not built; use one of them"
            )
        self._devices = stage_devices(plan)
        self.blocks = build_stage_blocks(setup, range(start, stop), self._devices)
        self._loss = loss_fn(setup.meta.task)
        self._amp_dtype = autocast_dtype(setup.precision)
        self.in_flight = InFlight(plan.index, setup.recompute)
        self._replicas = Replicas(self.device, setup.shard, self._timer.span)
        self._links = Links(self.device)
        self._draws = Draws(setup)
        self._own = Copier(self.device, OWN_COPIES)
        self._held = Held(_HELD_COPIES)
        self._failed_step = False
        """A step failed since the blocks were last loaded or rolled back: their state is
        no step's, and no copy of it is taken."""

    # ----------------------------------------------------------------------- timing

    def _compute(self) -> AbstractContextManager[None]:
        return self._timer.span("compute")

    def _receive(self, x: Wire) -> Tensor:
        with self._timer.span("transfer"):
            return receive(x, self.device)

    def _send(self, x: Tensor) -> Wire:
        with self._timer.span("transfer"):
            return send(x)

    # ---------------------------------------------------------------- forward/backward

    def _head(self, target: Tensor | None, scale: float) -> Callable[[Tensor], Tensor]:
        """Its blocks, then the scaled loss if given, under the job's autocast."""

        def run(y: Tensor) -> Tensor:
            with autocast(self._amp_dtype, self.device):
                for block in self.blocks:
                    y = block.module(y)
                return y if target is None else self._loss(y, target) * scale

        return run

    def _keep(self, mb: int, inp: Tensor, target: Tensor | None, scale: float) -> Tensor:
        run, loss = self._head(target, scale), target is not None
        return self.in_flight.forward(mb, inp, run, is_loss=loss, input_grad=not self.first)

    def hold_tensor(
        self, mb: int, inp: Tensor, target: Tensor | None, scale: float, ran: RngStates
    ) -> None:
        """Keep micro-batch ``mb`` for its backward, its forward having run in another
        process under ``ran`` (a SHARP shard handed over or rebuilt): with recomputation
        only its input, else its graph, the forward run again here under ``ran``."""
        run, loss = self._head(target, scale), target is not None
        with self._compute():
            self.in_flight.hold(mb, inp, run, ran, is_loss=loss, input_grad=not self.first)

    def forward(self, mb: int, x: Wire) -> Wire:
        """Run micro-batch ``mb`` through the stage; the output goes to the next stage."""
        return self._send(self.forward_tensor(mb, self._receive(x)))

    def forward_loss(self, mb: int, x: Wire, target: Wire, scale: float) -> float:
        """Last stage: the forward and the loss ``loss_fn(out, target) * scale``, kept for
        backward. ``scale`` is the micro-batch's share of the mini-batch, so accumulated
        gradients are those of the mini-batch mean."""
        loss = self.loss_tensor(mb, self._receive(x), self._receive(target), scale)
        with self._compute():
            return float(loss.item())

    def backward(self, mb: int, grad: Wire | None) -> Wire | None:
        """Backpropagate micro-batch ``mb`` (from its loss when ``grad`` is None), accumulating
        parameter gradients; return the gradient w.r.t. the stage input (None on stage 0)."""
        upstream = None if grad is None else self._receive(grad)
        out = self.backward_tensor(mb, upstream)
        return None if out is None else self._send(out)

    def forward_tensor(self, mb: int, inp: Tensor) -> Tensor:
        """``forward`` on the device: the output tensor, for the next stage."""
        with self._compute():
            return self._keep(mb, inp, None, 1.0)

    def loss_tensor(self, mb: int, inp: Tensor, target: Tensor, scale: float) -> Tensor:
        """``forward_loss`` on the device: the scaled loss, detached, still on the device
        (read it once per step: reading it synchronizes a GPU)."""
        with self._compute():
            loss = self._keep(mb, inp, target, scale)
        return loss.detach()

    def backward_tensor(self, mb: int, upstream: Tensor | None) -> Tensor | None:
        """``backward`` on the device: the input's gradient tensor (None on stage 0)."""
        kept = self.in_flight.take(mb, upstream=upstream is not None)
        with self._compute():
            torch.autograd.backward(kept.graph(), upstream)
        if self.first or kept.input.grad is None:
            return None
        return kept.input.grad

    def grad_norms(self) -> Wire:
        """The L2 norm of each accumulated gradient, block and parameter order: this stage's
        part of the gradient-norm reduction (``workers.pipeline.clipping``); with gradients
        sharded, each summed over the replicas' slices (every replica asks at once)."""
        if self._replicas.scattered:
            with self._timer.span("allreduce"):
                return send(self._replicas.scattered_norms())
        with self._compute():
            return grad_norms(self.blocks)

    def apply_step(self, clip: float | None = None) -> StepClock:
        """Apply the accumulated gradients to every block, multiplied first by ``clip`` (the
        clipping coefficient) when given; return the compute and transfer seconds spent
        since the last step (this step's) and restart the counts."""
        self._update(clip)
        return self.lap()

    def _update(self, clip: float | None) -> None:
        self.in_flight.require_none("every forward needs its backward before the step")
        shares = self._replicas.shares(self.blocks)
        copied = self._replicas.copyable(self.blocks)
        stateless = [part for part in copied if not part.optimizer.state]
        if shares is not None:
            for block in self.blocks:  # one update changes them all: every copy first
                self._guard(block.index)
            with self._compute():
                shares.update(clip)
            with self._timer.span("allreduce"):
                self._replicas.gather()
        else:
            with self._compute():
                if clip is not None:
                    scale_grads(self.blocks, clip)
            for block in self.blocks:
                self._guard(block.index)
                with self._compute():
                    block.step()
        if self._own.copying and any(part.optimizer.state for part in stateless):
            # The optimizer's first step made its state (Adam's moments): the host memory
            # copies of it need is made ready now, in this step, not in the next copy.
            self._own.reserve(copied)

    def _guard(self, index: int) -> None:
        """Before block ``index`` changes: the boundary's copy of it first."""
        if self._own.pending(index):
            with self._timer.span("copy"):
                self._own.guard(index)

    def moved(self, device: torch.device) -> None:
        """Its blocks are on ``device`` now (a SHARP shard's): it computes and is timed there."""
        self.device = device
        self._timer.moved(device)

    def lap(self) -> StepClock:
        """The seconds spent since the last step or lap, by part; restart them."""
        if self.device.type == "cpu":  # the copying thread ran on this device's cores
            self._timer.add("copy", self._own.take_busy())
        return self._timer.lap()

    # ------------------------------------------------------ a whole step, peer to peer

    def step(
        self,
        schedule: str,
        depth: int,
        micro_batches: int,
        rows: Rows,
        scale: float,
        update: bool,
    ) -> StepOutcome:
        """Run this stage's program of one step over ``micro_batches`` micro-batches of a
        ``depth``-stage ``schedule`` (stage 0 draws their inputs, the last stage their
        targets: ``rows`` of the step's batch, in micro-batch order), exchanging
        activations and gradients with the neighbours over its links; then sum the
        gradients over the replicas, and (``update``) apply them. Any failure closes the
        links and the replicas' group first, so neighbours and replicas fail at once, not
        after their timeouts."""
        started = time.perf_counter()
        program = programs_for(schedule, depth, micro_batches)[self.index]
        try:
            self._replicas.prepare(self.blocks)
            with self._timer.span("transfer"):  # booked as receiving the batch was
                batch, expected = self._draws.take(
                    rows, self.device, inputs=self.first, targets=self.last
                )
            size = (rows.stop - rows.start) // micro_batches
            losses = run_program(
                self, self._links, self._timer, program, batch, expected, size, scale
            )
            if self._replicas.grouped:
                with self._timer.span("allreduce"):
                    self._replicas.reduce(self.blocks)
        except BaseException:
            self._failed_step = True
            self._links.close()
            self._replicas.abort()
            raise
        norms = self.grad_norms()
        if update:
            self._update(None)
        values = torch.stack(losses).tolist() if losses else []  # the step's one read
        clock = self.lap()
        seconds = time.perf_counter() - started
        return StepOutcome(tuple(float(v) for v in values), norms, clock, seconds)

    def steps(
        self,
        schedule: str,
        depth: int,
        micro_batches: int,
        steps: Sequence[Rows],
        scale: float,
    ) -> list[StepOutcome]:
        """``len(steps)`` steps back to back, each as ``step`` with its own rows and applying
        its gradients (``scheduler.overlap``); a failed step ends the call."""
        return [self.step(schedule, depth, micro_batches, r, scale, True) for r in steps]

    def link_keep(self, names: dict[int, str | None]) -> None:
        """Keep only the links named in ``names`` (by neighbour offset, -1 or +1)."""
        self._links.keep(names)

    def link_host(self, peer: int, name: str) -> tuple[str, int]:
        """Start the rendezvous of link ``name`` to the neighbour at ``peer`` (+1)."""
        return self._links.host(peer, name)

    def link_join(self, peer: int, name: str, address: str, port: int) -> None:
        """Form link ``name`` to the neighbour at ``peer`` (blocks until it joins too)."""
        self._links.join(peer, name, address, port)

    def link_names(self) -> dict[int, str]:
        """This stage's links, by neighbour offset (operators and tests)."""
        return self._links.names()

    def device_key(self) -> str:
        """What identifies the physical device: its UUID on a GPU (two workers on one GPU
        cannot link over NCCL), ``cpu`` otherwise."""
        if self.device.type != "cuda":
            return "cpu"
        return str(torch.cuda.get_device_properties(self.device).uuid)

    # ------------------------------------------------------- data parallelism (collective)

    def collective_host(self) -> tuple[str, int]:
        """Replica 0: start this stage's rendezvous; the address the replicas join at."""
        return self._replicas.host()

    def collective_join(self, address: str, port: int, rank: int, world: int, stage: int) -> None:
        """Join the process group of stage ``stage`` (the one this worker is becoming, during
        a relayout) as replica ``rank`` of ``world``."""
        self._replicas.join(address, port, rank, world, f"stage-{stage}")

    def collective_leave(self) -> None:
        """Leave this stage's data-parallel group: the stage is no longer replicated."""
        self._replicas.leave()

    def unshard(self) -> None:
        """Give every block its whole state back (every replica of the stage at once), before
        the state is read or the layout changes (``workers.pipeline.replicas``)."""
        if self._replicas.sharded:
            with self._timer.span("allreduce"):
                self._replicas.unshard()

    def all_reduce(self) -> float:
        """Sum the accumulated gradients over this stage's replicas (a no-op without a
        group); return the seconds it took. Not compute: it is reported on its own."""
        start = time.perf_counter()
        self._replicas.reduce(self.blocks, scatter=False)
        return time.perf_counter() - start

    # ------------------------------------------------------------------------- state

    def state(self) -> dict[int, Any]:
        """Every block's state (parameters and optimizer), by block index."""
        self._replicas.require_whole("reading its state")
        return {block.index: block.state() for block in self.blocks}

    def load(self, *parts: Mapping[int, Any]) -> None:
        """Load this stage's blocks from ``parts`` (block states by index, such as ``state``
        or ``export`` answers; they may hold other blocks too)."""
        self._forget()
        self._load(whole_states(parts))

    def _load(self, states: Mapping[int, Any]) -> None:
        missing = [b.index for b in self.blocks if b.index not in states]
        if missing:
            raise KeyError(f"stage {self.index} got no state for blocks {missing}")
        self._replicas.forget()
        for block in self.blocks:
            block.load(states[block.index])
        self._failed_step = False

    def _forget(self) -> None:
        """Drop the in-memory copies: they are of a layout that no longer runs."""
        self._own.clear()
        self._held.clear()

    def export(self, indices: Sequence[int]) -> dict[int, Any]:
        """The state of the given blocks, which this stage holds (for ``adopt`` elsewhere)."""
        self._replicas.require_whole("exporting blocks")
        held = {block.index: block for block in self.blocks}
        missing = [i for i in indices if i not in held]
        if missing:
            raise StageStateError(f"stage {self.index} does not hold blocks {missing}")
        return {i: held[i].state() for i in indices}

    def adopt(self, index: int, blocks: BlockRange, *parts: Mapping[int, Any]) -> int:
        """Be stage ``index`` holding blocks ``[start, stop)`` from now on, between two steps:
        keep the held blocks, build the others from their states in ``parts`` (``export``s of
        their holders), drop the rest. The stage's bytes after the move."""
        self.in_flight.require_none("blocks move only between steps")
        self._replicas.require_whole("moving blocks")
        start, stop = blocks
        if not 0 <= start < stop <= self._setup.num_blocks:
            raise ValueError(f"stage {self.index} cannot hold blocks [{start}, {stop})")
        states = whole_states(parts)
        held = {block.index: block for block in self.blocks}
        new = [i for i in range(start, stop) if i not in held]
        missing = [i for i in new if i not in states]
        if missing:
            raise StageStateError(f"stage {self.index} got no state for blocks {missing}")
        s = self._setup
        for block in build_stage_blocks(s, new, self._devices):
            block.load(states[block.index])
            held[block.index] = block
        self.blocks = [held[i] for i in range(start, stop)]
        self._forget()
        self.index = self.in_flight.stage = index
        self.first, self.last = start == 0, stop == s.num_blocks
        return self.nbytes()

    # ------------------------------------------------- in-memory copies (lost devices)

    def snapshot(self, step: int, number: int) -> None:
        """Start copy ``number`` (rising with each copy) of the blocks' state after ``step``
        steps, made while the next step runs (``copier``); a sharded replica copies its
        shares. Host memory it needs first (pinned, once) is not timed."""
        if self._failed_step:  # a copy handed out ahead, after a step that then failed
            self._own.skip(number)
            raise StageStateError(
                f"stage {self.index} failed a step since its blocks were restored: they hold"
                f" no step's state, so copy {number} (of step {step}) is not taken"
            )
        copied = self._replicas.copyable(self.blocks)
        self._own.reserve(copied)
        self._timer.copying()
        self._own.start(step, number, copied)

    @property
    def copier(self) -> Copier:
        return self._own

    def shipment(self, number: int, timeout: float) -> dict[int, Any]:
        """Copy ``number`` in wire form, for the worker's buddy to ``hold``, once it is
        complete (a call beside training: it may come before the ``snapshot`` it follows,
        and waits up to ``timeout`` seconds for it)."""
        self._own.count_thread()
        _, states = self._own.wait_for(number, timeout)
        shipped: dict[int, Any] = send_tree(states)
        return shipped

    def hold(self, owner: str, step: int, states: Mapping[int, Any]) -> None:
        """Keep another worker's ``shipment`` as it came: in wire form, read if used."""
        self._own.count_thread()
        self._held.keep(owner, step, dict(states))

    def saved_steps(self) -> dict[str, Any]:
        """The steps this worker can restore: its own blocks, and each held owner's, as
        pieces (``scheduler.pieces``)."""
        return {"own": dict(self._own.steps()), "copies": self._held.steps()}

    def rollback(self, step: int, *parts: Mapping[int, Any]) -> None:
        """Back to the blocks' state after ``step`` steps, as if the step after it never
        began: micro-batches in flight and accumulated gradients are dropped. A sharded
        replica's copy holds its slices only: ``parts`` bring the other replicas' (their
        ``export_copy``s) and the slices are made whole."""
        self._own.settle()
        states = self._own.result(step)
        if states is None:
            raise StageStateError(f"stage {self.index} kept no state of step {step}")
        self.in_flight.clear()
        for block in self.blocks:
            block.optimizer.zero_grad(set_to_none=True)
        self._load(whole_states([states, *parts]))
        self._timer.reset()

    def export_copy(self, owner: str | None, step: int, indices: Sequence[int]) -> dict[int, Any]:
        """The given blocks' states after ``step`` from the copy held for ``owner``, or from
        this worker's own (None: a sharded replica's slices, for another's ``rollback``)."""
        states = self._own.result(step) if owner is None else self._held.get(owner, step)
        if states is None or any(i not in states for i in indices):
            raise StageStateError(
                f"stage {self.index} holds no copy of blocks {list(indices)} of"
                f" {owner or 'its own'} at step {step}"
            )
        return {i: receive_tree(states[i], torch.device("cpu")) for i in indices}

    def device_overhead(self) -> Overhead:
        """What the device held for this worker before its blocks (``workers.device_memory``)."""
        return self._overhead

    def nbytes(self) -> int:
        """Bytes of the blocks' parameters and optimizer state, this replica's shares of it
        while sharded (memory accounting)."""
        return self._replicas.held_bytes(self.blocks)

    def pid(self) -> int:
        """The worker's process id (shown in the placement event, for operators)."""
        return os.getpid()

    def measure_speed(self) -> list[float]:
        """GFLOP/s of a fixed matmul on each device of the stage (its own, then its tensor
        group's, one after another), slowed like compute (not counted as it)."""
        return [
            measure_gflops(device, slowdown)
            for device, slowdown in zip(self._devices, self._slowdowns, strict=True)
        ]
