"""A SHARP host's task inputs and outputs: a model's next task's inputs kept on the device
when it runs on the same host (the stash), a step's batch drawn where it is used, or
tensors received in wire form; and a task's outputs handed on one of those ways.

A step's batch is drawn once on a host and kept while its step runs: a model's first and
last shards usually live on one host, and both take it. On a GPU host a model's next batch
is drawn ahead, by a thread of the host's own, as soon as its step's batch is taken: the
device computes while the host's CPU draws, where a task would otherwise hold the device
idle for it (a batch is the same function of its step whoever draws it). On a CPU device
that thread would take the cores the tasks compute on, so there each batch is drawn when
its step's first task comes."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from shoal.workers.pipeline.batch_rows import Draws
from shoal.workers.pipeline.stage_types import StageSetup, StageStateError
from shoal.workers.sharp.shard_types import Drawn, Inputs, Outputs, Stashed, Targets
from shoal.workers.wire import Wire, receive, send


class TaskIO:
    """What one host's shard tasks take in and hand on, by model."""

    def __init__(self, where: str, *, ahead: bool = False) -> None:
        self._where = where
        """The device, as errors name it."""
        self._drawer = ThreadPoolExecutor(1, thread_name_prefix="shoal-draw") if ahead else None
        """The thread that draws every batch (``ahead``: each model's next one early)."""
        self._drawing: dict[str, dict[int, Future[tuple[Tensor, Tensor]]]] = {}
        """Each model's batches drawn or being drawn, by step: the latest taken (its first
        and last shards may both run here) and (``ahead``) the next."""
        self._stash: dict[tuple[str, int], list[Tensor | None]] = {}
        """Outputs of tasks whose model's next task runs here, by (model, that task's
        position): they stay on the device (``keep``) until it takes them."""
        self._draws: dict[str, Draws] = {}

    def learn(self, model: str, setup: StageSetup) -> None:
        """``model``'s tasks here may draw its batches (``Drawn``), from ``setup``'s data."""
        self._draws.setdefault(model, Draws(setup))

    def drop(self, model: str) -> None:
        """Forget what is kept for ``model``'s next tasks."""
        for kept in [k for k in self._stash if k[0] == model]:
            del self._stash[kept]

    def forget(self, model: str) -> None:
        """Nothing of ``model`` is left here: neither its stash nor its data."""
        self.drop(model)
        self._draws.pop(model, None)
        self._drawing.pop(model, None)

    def take(
        self, model: str, inputs: Inputs, device: torch.device, targets: Targets | None = None
    ) -> tuple[list[Tensor | None], list[Tensor] | None]:
        """A task's input tensors on ``device`` (from the stash, drawn or received), and
        its ``targets``' where given; a step's batch wanted for both is drawn once."""
        drawn = [w for w in (inputs, targets) if isinstance(w, Drawn)]
        batch = self._draw(model, drawn[0]) if drawn else None
        if isinstance(inputs, Stashed):
            xs = self.unstash(model, inputs.position)
        elif isinstance(inputs, Drawn):
            xs = list(_micro_batches(batch, 0, inputs, device))
        else:
            xs = [None if x is None else receive(x, device) for x in inputs]
        if targets is None:
            return xs, None
        if isinstance(targets, Drawn):
            return xs, _micro_batches(batch, 1, targets, device)
        return xs, [receive(y, device) for y in targets]

    def targets(self, model: str, targets: Targets, device: torch.device) -> list[Tensor]:
        """A last shard's targets on ``device``, drawn or received."""
        _, ys = self.take(model, [], device, targets)
        assert ys is not None  # targets were given
        return ys

    def keep(self, model: str, position: int, tensors: list[Tensor | None]) -> None:
        """Keep ``tensors`` for ``model``'s task at ``position``, which runs here."""
        self._stash[(model, position)] = tensors

    def unstash(self, model: str, position: int) -> list[Tensor | None]:
        kept = self._stash.pop((model, position), None)
        if kept is None:
            raise StageStateError(
                f"no outputs are kept on {self._where} for task {position} of model {model}"
            )
        return kept

    def hand_on(
        self, model: str, outputs: Sequence[Tensor | None], keep: int | None, *, copy: bool
    ) -> Outputs:
        """Outputs for the model's next task: kept here (on the device) when it runs here,
        else in wire form. A forward's output is copied: the shard that made it still
        holds it for its backward, and the next shard may change its input in place."""
        if keep is None:
            return [as_wire(t) for t in outputs]
        with torch.no_grad():
            kept = [None if t is None else t.detach() for t in outputs]
            self.keep(model, keep, [t.clone() if copy and t is not None else t for t in kept])
        return []

    def nbytes(self) -> int:
        """The bytes the stash holds (on the device)."""
        kept = [t for outputs in self._stash.values() for t in outputs if t is not None]
        return sum(t.numel() * t.element_size() for t in kept)

    def _draw(self, model: str, drawn: Drawn) -> tuple[Tensor, Tensor]:
        """Step ``drawn.step``'s batch of ``model``: drawn once, kept while its step runs.
        With a drawing thread (``ahead``), drawn by that thread (one draw at a time, as a
        user's data source may expect), and the step after it drawn ahead. (A task is
        given copies of it, so one that changes its inputs in place leaves it as drawn.)"""
        draws = self._draws.get(model)
        if draws is None:
            raise StageStateError(
                f"model {model} holds no shard on {self._where}: its batch is not drawn there"
            )
        step = drawn.step
        kept = {s: f for s, f in self._drawing.get(model, {}).items() if s >= step}
        for wanted in (step, step + 1) if self._drawer is not None else (step,):
            if wanted not in kept:
                kept[wanted] = self._start(draws, wanted)
        self._drawing[model] = kept
        try:
            return kept[step].result()
        except BaseException:
            del kept[step]  # drawn again if asked again
            raise

    def _start(self, draws: Draws, step: int) -> Future[tuple[Tensor, Tensor]]:
        """The draw of step ``step``'s batch: by the drawing thread, or done here."""
        if self._drawer is not None:
            return self._drawer.submit(draws.batch, step)
        done: Future[tuple[Tensor, Tensor]] = Future()
        try:
            done.set_result(draws.batch(step))
        except Exception as error:  # raised where the batch is asked for, as the thread's
            done.set_exception(error)
        return done


def _micro_batches(
    batch: tuple[Tensor, Tensor] | None, part: int, drawn: Drawn, device: torch.device
) -> list[Tensor]:
    """The micro-batches of ``batch``'s inputs (``part`` 0) or targets (1) on ``device``,
    moved (on a CPU device: copied) in one copy."""
    assert batch is not None  # drawn for ``drawn``
    whole = batch[part]
    rows = len(whole) // drawn.micro_batches
    moved = whole[: rows * drawn.micro_batches].to(device, copy=True)
    return [moved[j * rows : (j + 1) * rows] for j in range(drawn.micro_batches)]


def as_wire(tensor: Tensor | None) -> Wire | None:
    return None if tensor is None else send(tensor)
