"""One device of the SHARP executor: many models' shards in host memory, a few on the device.

Hydra's shard alternator parallelism (Nagrecha & Kumar): every model is cut into shards
that fit a device; a device runs one shard task at a time — the forward of a shard over
every micro-batch of a mini-batch, or its backward — of whichever model the scheduler picks
(``scheduler.sharp``), while the shards it is not running wait in host memory. A
``ShardHost`` is that device: each shard it holds is a ``workers.pipeline.stage.Stage`` (the same
blocks, per-block optimizers and rematerialization as a pipeline stage) living in host
memory until a task *promotes* it onto the device; it is *demoted* back when room is needed.
The device holds at most ``budget_bytes`` of shards: by accounting on a CPU device, in CUDA
memory on a GPU, where promotion and demotion are copies to and from pinned host memory.

Double buffering: a task may name the shard expected next on this device; it is promoted
before the task computes (on a GPU, on a side stream, so the copy overlaps the compute).
A shard promoted and run again stays where it is. Between its forward and backward task a
shard keeps what its backward needs, so its backward runs on the host that ran its forward:
with the job's ``recompute`` on, its micro-batches' inputs (the boundary activations, which
its backward recomputes the forward from, as GPipe's rematerialization does); with it off,
the autograd graph, whose saved activations move with the shard when it is demoted and whose
saved parameters are read back from wherever they are by then (``workers.sharp.saved``), so no
forward runs twice.

After its backward a shard applies its optimizer step at once: its gradients are complete
(every micro-batch went through), and the shards before it already have the gradients they
need, so the math is one process's (gradient-norm clipping, a cross-shard reduction, is not
supported here).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from shoal.scheduler.devices import Device
from shoal.workers.device_fault import own_use
from shoal.workers.device_memory import Overhead, grow_segments_in_place, measure_overhead
from shoal.workers.device_speed import measure_gflops
from shoal.workers.pipeline.stage import Stage
from shoal.workers.pipeline.stage_types import StageSetup, StageStateError, torch_device
from shoal.workers.pipeline.timing import StepClock
from shoal.workers.sharp.host_copies import HostCopies
from shoal.workers.sharp.pinned import PinnedState
from shoal.workers.sharp.saved import MovableSaves
from shoal.workers.sharp.shard_types import (
    Handover,
    Inputs,
    Outputs,
    Record,
    Replays,
    ShardKey,
    Targets,
    TaskResult,
)
from shoal.workers.sharp.spares import Spares
from shoal.workers.sharp.task_io import TaskIO, as_wire
from shoal.workers.snapshot import StagePlan
from shoal.workers.wire import receive, receive_tree, send, send_tree
from shoal.workers.zoo.models import states_loaded


class BudgetError(RuntimeError):
    """A shard cannot fit the device's budget even alone (a planning bug, never user input)."""


class ShardHost:
    """The shards one device holds for the SHARP executor."""

    def __init__(self, device: Device, budget_bytes: int) -> None:
        self.device = device
        self._target = torch_device(device)
        grow_segments_in_place(self._target)  # fewer free blocks left stranded
        self._overhead = measure_overhead(self._target)  # before the first shard
        """What the device holds for this process before any shard (``workers.device_memory``)."""
        measured = replace(device, overhead_mb=-(-self._overhead.bytes // 2**20))
        self.budget_bytes = (
            min(budget_bytes, measured.usable_bytes) if self._overhead.bytes else budget_bytes
        )
        """The given budget, within what the device has beside this process's overhead where
        it holds any (a GPU): the budget was planned with an overhead known before."""
        self._host = torch.device("cpu")
        self._shards: dict[ShardKey, Stage] = {}
        self._saves: dict[ShardKey, MovableSaves] = {}
        self._pinned: dict[ShardKey, PinnedState] = {}
        self._planned: dict[ShardKey, tuple[int, int, int]] = {}  # add's sizes of each shard
        self._resident: OrderedDict[ShardKey, int] = OrderedDict()
        """Shards on the device and the bytes of their state there, least recently used first."""
        self._running: ShardKey | None = None  # the shard of the task running, or last run
        self._io = TaskIO(device.id, ahead=self._target.type == "cuda")
        self._residue: dict[ShardKey, int] = {}
        """Demoted shards between a forward and its backward: the bytes of the micro-batches'
        inputs and outputs they keep, which stay on the device (autograd's other saved
        tensors move with the shard)."""
        self._copies = HostCopies()
        self._spares = Spares()  # on a GPU: a demoted shard's memory for the next promoted
        self._side: torch.cuda.Stream | None = None
        if self._target.type == "cuda":
            with own_use(self._target, "started on it"):
                self._side = torch.cuda.Stream(self._target)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ holding shards

    def add(
        self,
        key: ShardKey,
        setup: StageSetup,
        blocks: tuple[int, int],
        planned: int,
        state: Mapping[int, Any] | None = None,
        again: bool = False,
        kept: int = 0,
        work: int = 0,
    ) -> int:
        """Hold shard ``key`` (blocks ``[start, stop)`` of the model ``setup`` builds) in host
        memory, from ``state`` (block states by index) or freshly initialised. On the device its
        task takes ``planned`` (``scheduler.sharp``: state, gradients, activations, autocast's
        copies, temporaries); between tasks it keeps ``kept`` of that while micro-batches are
        in flight, never ``work``. The bytes it takes there. ``again``: whatever this host holds
        of it is dropped first (a rollback: it may have been handed here, or never arrived)."""
        if again and key in self._shards:
            self.drop(key)
        if key in self._shards:
            raise StageStateError(f"shard {key} is already held on {self.device.id}")
        host = replace(self.device, index=0, gpu=False)  # promoted when a task needs it
        with states_loaded(state is not None):
            stage = Stage(StagePlan(key[1], blocks, host), setup)
        if state is not None:
            stage.load(receive_tree(state, self._host))
        self._shards[key] = stage
        self._io.learn(key[0], setup)
        self._saves[key] = MovableSaves(lambda: _parameters(stage), stage.in_flight.tensors)
        self._pinned[key] = PinnedState(stage.blocks, self._spares)
        self._planned[key] = (planned, kept, work)
        return max(stage.nbytes(), planned)

    def copy(self, key: ShardKey, step: int, number: int) -> None:
        """Start copy ``number`` (rising with each of the shard's copies) of shard ``key``'s
        block states (parameters and optimizer) as they are after the tasks before this call,
        ``step`` steps; on a GPU it returns at once, the copy made beside the tasks after it
        (``workers.pipeline.copier``: only the shard's next optimizer step waits for it),
        on a CPU device once it is made. ``copied`` hands it over."""
        stage = self._stage(key)
        if key not in self._resident:
            self._settle()  # it may be on its way to host memory: there first
        self._start_copy((key, number), stage, step)

    def copied(
        self, key: ShardKey, number: int, timeout: float
    ) -> tuple[dict[int, Any], float, float]:
        """Copy ``number`` of shard ``key`` (``copy``), once made, in wire form (what Ray moves
        fastest; the executor keeps it so, ``add`` and ``load`` take it back, its checkpoints
        read it back as tensors); the seconds it cost this device (starting it, and on a CPU
        device the CPU time of the threads copying it and handing it over: a CPU device is
        its cores); and the wall clock then (the executor counts its way there too). A call
        beside the tasks, once the one that started the copy has ended; on a GPU it waits up
        to ``timeout`` s for the copy to be made."""
        stage, seconds = self._copies.take((key, number))
        handing = time.thread_time()  # this thread's own: it serves every shard's copies
        _, states = stage.copier.wait_for(number, timeout)
        wire: dict[int, Any] = send_tree(states)
        stage.copier.release(number)  # delivered: the host keeps no copy of its own
        handing = time.thread_time() - handing
        busy = self._copies.busy(key, stage, threads=self._side is None)
        return wire, seconds + busy + (handing if self._side is None else 0.0), time.time()

    def drop(self, key: ShardKey) -> None:
        """Forget shard ``key`` (it moved to another host, or its model ended, or rolls
        back), and whatever this host keeps for its model's next tasks: then the host
        holds nothing of it, whether it held the shard or not (a model that failed as its
        shards were loaded drops them all)."""
        self._io.drop(key[0])
        if key in self._shards:
            self._forget(key)

    def give(self, key: ShardKey, stashed: int | None = None) -> tuple[Handover, int]:
        """Hand shard ``key`` over to another host (``Handover``) and forget it, with the
        outputs kept here for its model's task at position ``stashed`` (``Stashed``) if
        given (the executor names them when that task is this shard's); and its bytes."""
        stage = self._stage(key)
        self._settle()
        kept = stage.in_flight.inputs()
        outputs = self._io.unstash(key[0], stashed) if stashed is not None else []
        sent = [x for x, _, _ in kept.values()] + [t for t in outputs if t is not None]
        handover = Handover(
            send_tree(stage.state()),
            {mb: send(x) for mb, (x, _, _) in kept.items()},
            any(loss for _, loss, _ in kept.values()),
            None if stashed is None else (stashed, [as_wire(t) for t in outputs]),
            _replays({mb: ran for mb, (_, _, ran) in kept.items()}),
        )
        self._forget(key)
        return handover, stage.nbytes() + sum(t.numel() * t.element_size() for t in sent)

    def take(
        self,
        key: ShardKey,
        setup: StageSetup,
        blocks: tuple[int, int],
        planned: int,
        handover: Handover,
        targets: Targets | None = None,
        scale: float = 1.0,
        again: bool = False,
        kept: int = 0,
        work: int = 0,
    ) -> int:
        """Hold shard ``key`` as ``handover`` has it (another host's ``give``, or the
        executor's rebuild after a loss): its states loaded, each micro-batch in flight
        kept for its backward (``targets`` and ``scale``: the loss's, the model's last
        shard's), its forward run again here under the RNG it first ran under unless the
        backward recomputes it, and the outputs kept for its model's next task kept here.
        The bytes it holds on the device, as ``add`` (``again``, ``kept`` and ``work`` as there)."""
        if handover.loss and targets is None:
            raise StageStateError(f"shard {key} is handed over mid-loss without its targets")
        missing = sorted(set(handover.inputs) - set(handover.replays))
        if missing:
            raise StageStateError(f"shard {key} is handed over without the RNG of {missing}")
        size = self.add(key, setup, blocks, planned, handover.state, again, kept, work)
        stage, host = self._shards[key], self._host
        graphs = stage.in_flight.keeps_graphs
        if handover.inputs and graphs:
            self._begin(key, None)  # their forwards run again here, on the device
        ys = self._io.targets(key[0], targets, self._target) if targets and handover.loss else []
        with self._saves[key].hooks():
            for mb, wire in sorted(handover.inputs.items()):
                x = receive(wire, self._target)
                y = ys[mb] if ys else None
                cpu, cuda = handover.replays[mb]
                ran = (receive(cpu, host), None if cuda is None else receive(cuda, host))
                stage.hold_tensor(mb, x, y, scale, ran)
        if handover.inputs and not graphs:  # they stay on the device, as a demoted shard's do
            self._residue[key] = stage.in_flight.nbytes()
        if handover.stash is not None:
            position, outputs = handover.stash
            self._io.keep(
                key[0], position, [None if t is None else receive(t, self._target) for t in outputs]
            )
        return size

    def _forget(self, key: ShardKey) -> None:
        self._demote(key)
        self._spares.release()
        self._settle()
        self._shards[key].copier.close()
        self._residue.pop(key, None)
        del self._shards[key]
        del self._saves[key]
        del self._pinned[key]
        del self._planned[key]
        if all(k[0] != key[0] for k in self._shards):
            self._io.forget(key[0])

    def overhead(self) -> Overhead:
        """What the device held for this worker before any shard, and how it was measured."""
        return self._overhead

    def measure_speed(self) -> float:
        """The device's GFLOP/s (``workers.device_speed``)."""
        return measure_gflops(self._target, self.device.emulate_slowdown)

    def pid(self) -> int:
        """The worker's process id (for operators, and tests that kill it)."""
        return os.getpid()

    def held(self) -> dict[str, Any]:
        """What this host holds: every shard, and those on the device (accounting)."""
        return {
            "shards": sorted(self._shards),
            "resident": list(self._resident),
            "resident_bytes": sum(self._held(k, size) for k, size in self._resident.items()),
            "residue_bytes": sum(self._residue.values()),
            "stash_bytes": self._io.nbytes(),
            "budget_bytes": self.budget_bytes,
            "overhead_bytes": self._overhead.bytes,
        }

    # ------------------------------------------------------------------------ tasks

    def forward(
        self,
        key: ShardKey,
        inputs: Inputs,
        targets: Targets | None = None,
        scale: float = 1.0,
        prefetch: ShardKey | None = None,
        keep: int | None = None,
        record: bool = False,
    ) -> tuple[Outputs, TaskResult]:
        """Run every micro-batch through shard ``key``, keeping what its backward needs:
        the outputs are the next shard's inputs; on the model's last shard (``targets``
        given) there are none, and the losses, ``scale`` times the mean, are in the result.
        ``keep``: the position of the model's next task, which runs on this host too: the
        outputs stay here for it (``Stashed``) instead of leaving. ``record``: the result
        carries copies of the outputs and the forwards' RNG states (``Record``)."""
        stage, promoted = self._begin(key, prefetch)
        taken, ys = self._io.take(key[0], inputs, stage.device, targets)
        xs = _every(taken, key)
        with self._saves[key].hooks():
            if ys is None:
                outputs = [stage.forward_tensor(j, x) for j, x in enumerate(xs)]
                handed = self._io.hand_on(key[0], outputs, keep, copy=True)
                compute_s = self._compute_s(key, stage.lap())
                kept = self._record(stage, outputs, forward=True) if record else None
                return handed, TaskResult([], compute_s, promoted, kept)
            pairs = zip(xs, ys, strict=True)
            losses = [stage.loss_tensor(j, x, y, scale) for j, (x, y) in enumerate(pairs)]
        values = torch.stack(losses).tolist()  # the task's one read of the device
        compute_s = self._compute_s(key, stage.lap())
        kept = self._record(stage, [], forward=True) if record else None
        return [], TaskResult([float(v) for v in values], compute_s, promoted, kept)

    def backward(
        self,
        key: ShardKey,
        grads: Inputs,
        prefetch: ShardKey | None = None,
        keep: int | None = None,
        record: tuple[int, int] | None = None,
    ) -> tuple[Outputs, TaskResult]:
        """Backpropagate every micro-batch through shard ``key`` from its output gradients
        (None on the last shard: from the losses), then apply the shard's step; the outputs
        are the gradients of its inputs (kept here for the next task as in ``forward``).
        ``record``, ``(step, number)``: the result carries copies of the outputs
        (``Record``), and copy ``number`` of the shard as the step leaves it, after ``step``
        steps, is started (as ``copy`` does: ``copied`` hands it over)."""
        stage, promoted = self._begin(key, prefetch)
        upstream, _ = self._io.take(key[0], grads, stage.device)
        outputs = [stage.backward_tensor(j, g) for j, g in enumerate(upstream)]
        compute_s = self._compute_s(key, stage.apply_step())
        handed = self._io.hand_on(key[0], outputs, keep, copy=False)
        kept = None
        if record is not None:
            kept = self._record(stage, outputs, forward=False)
            self._start_copy((key, record[1]), stage, record[0])
        return handed, TaskResult([], compute_s, promoted, kept)

    def _start_copy(self, copy: tuple[ShardKey, int], stage: Stage, step: int) -> None:
        """Start ``copy`` of ``stage`` after ``step`` steps; on a CPU device make it now: its
        cores are the device, which a thread beside would take from the tasks after."""
        self._copies.start(copy, stage, step)
        if self._side is None:
            stage.copier.settle()

    def _compute_s(self, key: ShardKey, clock: StepClock) -> float:
        """A task's compute seconds from its ``clock``; what that holds of the shard's copies
        (waiting for one, or a CPU device's copying thread) is booked as theirs."""
        self._copies.book(key, clock.copy_s)
        return clock.compute_s

    def _record(
        self, stage: Stage, outputs: Sequence[torch.Tensor | None], *, forward: bool
    ) -> Record:
        """A task's ``Record``: copies of its outputs in wire form, and a ``forward``'s the
        RNG states of the micro-batches its shard holds in flight."""
        started = time.perf_counter()
        sent = [None if t is None else send(t.detach().to("cpu", copy=True)) for t in outputs]
        replays = _replays(stage.in_flight.rng_states()) if forward else {}
        return Record(sent, replays, time.perf_counter() - started, time.time())

    # ------------------------------------------------------------ promotion (spilling)

    def _stage(self, key: ShardKey) -> Stage:
        stage = self._shards.get(key)
        if stage is None:
            raise StageStateError(f"shard {key} is not held on {self.device.id}")
        return stage

    def _begin(self, key: ShardKey, prefetch: ShardKey | None) -> tuple[Stage, int]:
        """Promote ``key`` (and start promoting ``prefetch``, which must leave room for it)."""
        self._running = key
        promoted = self._promote(key, keep=(), optional=False)
        if self._side is not None:
            torch.cuda.current_stream(self._target).wait_stream(self._side)
        if prefetch is not None and prefetch in self._shards and prefetch != key:
            promoted += self._promote(prefetch, keep=(key,), optional=True)
        self._spares.release()  # what demoted shards left and neither took: freed once out
        return self._shards[key], promoted

    def _promote(self, key: ShardKey, keep: Sequence[ShardKey], *, optional: bool) -> int:
        """Shard ``key`` onto the device, demoting the least recently used others (never
        those in ``keep``) until it fits beside the demoted shards' residue; the bytes
        copied (0 when it was there). An ``optional`` promotion (a prefetch) with no room
        does nothing; a task's own shard goes on the device whatever residue is left."""
        resident = key in self._resident
        copied = 0 if resident else self._stage(key).nbytes()
        planned, kept, work = self._planned[key]
        size = self._resident.get(key, max(copied, planned - kept - work))
        if size + kept + work > self.budget_bytes:
            raise BudgetError(
                f"shard {key} needs {size + kept + work} bytes, more than {self.device.id}'s"
                f" budget of {self.budget_bytes}"
            )
        need = 0 if resident else self._held(key, size)  # a resident one's is counted
        for other in list(self._resident):
            if self._used() + need <= self.budget_bytes:
                break
            if other not in keep and other != key:
                self._demote(other)
        if resident:
            self._resident.move_to_end(key)
            return 0
        if optional and self._used() + need > self.budget_bytes:
            return 0  # a prefetch with no room: the shard is promoted when its task comes
        self._residue.pop(key, None)  # its kept tensors are part of its size again
        self._move(key, self._target)
        self._resident[key] = size
        return copied

    def _used(self) -> int:
        held = sum(self._held(k, size) for k, size in self._resident.items())
        return held + sum(self._residue.values()) + self._io.nbytes()

    def _held(self, key: ShardKey, state: int) -> int:
        """Shard ``key``'s bytes on the device, ``state`` of its state: its task's while it
        runs, else with what its micro-batches in flight keep."""
        _, kept, work = self._planned[key]
        if key == self._running:
            return state + kept + work
        return state + (kept if self._shards[key].in_flight.inputs() else 0)

    def _demote(self, key: ShardKey) -> None:
        if self._resident.pop(key, None) is not None:
            if self._side is not None:  # its copy reads the device memory the move frees
                self._shards[key].copier.settle()
            self._move(key, self._host)
            if kept := self._shards[key].in_flight.nbytes():
                self._residue[key] = kept

    def _move(self, key: ShardKey, device: torch.device) -> None:
        """Shard ``key`` onto the GPU or back into its pinned host buffers, asynchronously
        on the side stream (``workers.sharp.pinned``); its saved activations with it."""
        stage, saves, side = self._shards[key], self._saves[key], self._side
        if device == stage.device or side is None:
            return  # a CPU device: host and device memory are one, the budget is accounting
        if device.type == "cuda":
            self._pinned[key].to_device(device, side)
        else:
            self._pinned[key].to_host(side)  # after the compute that last wrote it
        saves.to(device, stream=side)
        stage.moved(device)

    def _settle(self) -> None:
        """Wait for the side stream's copies: before the host reads a shard it sent back."""
        if self._side is not None:
            self._side.synchronize()


def _every(tensors: Sequence[torch.Tensor | None], key: ShardKey) -> list[torch.Tensor]:
    """A forward's inputs: one tensor per micro-batch, none missing."""
    present = [t for t in tensors if t is not None]
    if len(present) != len(tensors):
        raise StageStateError(f"shard {key}'s forward was given no input for a micro-batch")
    return present


def _replays(states: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]]) -> Replays:
    return {mb: (send(cpu), as_wire(cuda)) for mb, (cpu, cuda) in states.items()}


def _parameters(stage: Stage) -> list[torch.Tensor]:
    return [p for block in stage.blocks for p in block.module.parameters()]
