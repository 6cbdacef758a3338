"""What each micro-batch in flight on a stage keeps for its backward.

Without rematerialization, its input and its output (the autograd graph between them);
with it (activation checkpointing, as in GPipe), only its input and how to redo the
forward: the function and the random-number state it ran under, so the recomputed forward
is the same, dropout included. Either way the RNG states are kept, so another process can
take the micro-batch on exactly (a SHARP shard handed over, or rebuilt after a loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.workers.pipeline.stage_types import StageStateError

RngStates = tuple[Tensor, Tensor | None]
"""The CPU and (on a GPU) CUDA generator states a forward ran under."""


@dataclass
class Replay:
    """How to recompute a stage's forward exactly: the function and the RNG it ran under
    (on a GPU, that of the GPU its input was on, where it runs again)."""

    rerun: Callable[[Tensor], Tensor]
    cpu_rng: Tensor
    cuda_rng: Tensor | None

    def run(self, x: Tensor) -> Tensor:
        gpu = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=gpu):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None and gpu:
                torch.cuda.set_rng_state(self.cuda_rng, x.device)
            return self.rerun(x)


@dataclass
class Kept:
    """What one micro-batch's backward needs: its input and its output, or how to redo it."""

    input: Tensor
    output: Tensor | Replay
    is_loss: bool
    ran: RngStates
    """The RNG states its forward ran under."""

    def graph(self) -> Tensor:
        """The output under autograd: kept, or recomputed from the input."""
        return self.output if isinstance(self.output, Tensor) else self.output.run(self.input)


class InFlight:
    """The micro-batches stage ``stage`` has run forward and not yet backward. The RNG
    states a forward ran under are those of the device its input is on: a SHARP shard's
    stage moves between host memory and its GPU, and computes on the GPU."""

    def __init__(self, stage: int, recompute: bool) -> None:
        self.stage = stage
        self._recompute = recompute
        self._kept: dict[int, Kept] = {}

    def forward(
        self,
        mb: int,
        inp: Tensor,
        run: Callable[[Tensor], Tensor],
        *,
        is_loss: bool,
        input_grad: bool,
    ) -> Tensor:
        """``run(inp)`` for micro-batch ``mb``, keeping what its backward needs; with
        ``input_grad`` the backward also gives the input's gradient."""
        if mb in self._kept:
            raise StageStateError(f"stage {self.stage} already holds micro-batch {mb}")
        if input_grad:
            inp.requires_grad_()
        ran = (torch.get_rng_state(), torch.cuda.get_rng_state(inp.device) if inp.is_cuda else None)
        if not self._recompute:
            out = run(inp)
            self._kept[mb] = Kept(inp, out, is_loss, ran)
            return out
        with torch.no_grad():
            out = run(inp)
        self._kept[mb] = Kept(inp, Replay(run, *ran), is_loss, ran)
        return out

    def hold(
        self,
        mb: int,
        inp: Tensor,
        run: Callable[[Tensor], Tensor],
        ran: RngStates,
        *,
        is_loss: bool,
        input_grad: bool,
    ) -> None:
        """Keep micro-batch ``mb`` as if ``run(inp)`` had run here under the RNG states
        ``ran`` (it ran in another process: a SHARP shard handed over or rebuilt). With
        rematerialization that computes nothing (its backward recomputes the forward
        anyway); without, the forward runs again under ``ran``: the same graph."""
        if mb in self._kept:
            raise StageStateError(f"stage {self.stage} already holds micro-batch {mb}")
        if input_grad:
            inp.requires_grad_()
        replay = Replay(run, *ran)
        self._kept[mb] = Kept(inp, replay if self._recompute else replay.run(inp), is_loss, ran)

    def take(self, mb: int, *, upstream: bool) -> Kept:
        """Micro-batch ``mb``'s keepings, for its backward (``upstream``: the output's
        gradient came with it; only a loss goes without)."""
        kept = self._kept.pop(mb, None)
        if kept is None:
            raise StageStateError(f"stage {self.stage} has no forward of micro-batch {mb}")
        if not upstream and not kept.is_loss:
            raise StageStateError(
                f"stage {self.stage} needs the output gradient of micro-batch {mb}"
            )
        return kept

    def inputs(self) -> dict[int, tuple[Tensor, bool, RngStates]]:
        """Each micro-batch in flight's input (detached), whether it ends in the loss and
        the RNG states its forward ran under: what another process needs to run its
        backward (a SHARP shard handed over)."""
        return {mb: (k.input.detach(), k.is_loss, k.ran) for mb, k in sorted(self._kept.items())}

    def rng_states(self) -> dict[int, RngStates]:
        """The RNG states each micro-batch in flight's forward ran under."""
        return {mb: k.ran for mb, k in sorted(self._kept.items())}

    @property
    def keeps_graphs(self) -> bool:
        """Its micro-batches keep their autograd graphs (no rematerialization)."""
        return not self._recompute

    def require_none(self, before: str) -> None:
        """Refuse ``before`` (what would come next) while micro-batches are in flight."""
        if self._kept:
            raise StageStateError(
                f"stage {self.stage} still holds micro-batches {sorted(self._kept)}; {before}"
            )

    def clear(self) -> None:
        """Forget every micro-batch in flight (a rollback)."""
        self._kept.clear()

    def tensors(self) -> list[Tensor]:
        """The inputs and outputs kept (a replay keeps no output)."""
        kept = (t for k in self._kept.values() for t in (k.input, k.output))
        return [t for t in kept if isinstance(t, Tensor)]

    def nbytes(self) -> int:
        """Bytes of the inputs and outputs kept (memory accounting)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
