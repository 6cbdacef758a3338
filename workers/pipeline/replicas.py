"""A stage's data-parallel side: its group among the stage's replicas and, when the job
shards them, this replica's shares of the blocks' state (``workers.pipeline.sharding``).

Without a group (one replica, or the in-process group, whose runner sums replicas itself)
there is nothing to sum or shard. With one, the accumulated gradients are summed over the
replicas before the update (``workers.pipeline.collective``); sharded, each replica updates
its slices of every block and the slices are all-gathered (ZeRO-3: gathered where each
block next runs, ``workers.pipeline.gathering``), and before a block's state is read or
moved every replica ``unshard``s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shoal.workers.blocks import Block
from shoal.workers.pipeline.collective import GlooCollective
from shoal.workers.pipeline.sharding import BlockShard, StageShards
from shoal.workers.pipeline.stage_types import StageStateError
from shoal.workers.pipeline.timing import Timed, untimed
from shoal.workers.pipeline.transport import LinkError
from shoal.workers.snapshot import RunnerEvent

_SHARDED = {
    "optimizer": "each replica keeps the optimizer state of 1/R of every block (ZeRO-1)",
    "gradients": "each replica keeps the optimizer state and summed gradients of 1/R of"
    " every block (ZeRO-2)",
    "full": "each replica keeps the parameters, summed gradients and optimizer state of 1/R"
    " of every block, gathering a block's parameters for each use (ZeRO-3)",
}


def shard_event(mode: str, grouped: bool, step: int) -> RunnerEvent:
    """What a job asking for ``mode`` gets: sharded replicas where its workers sum in
    process groups of their own (``grouped``), else whole ones, and why."""
    if grouped:
        text = f"sharded replicas: {_SHARDED[mode]}, wherever a stage has several"
    else:
        text = (
            f"replicas stay whole (parallelism.shard: {mode} needs Ray workers, whose"
            " replicas sum in process groups of their own)"
        )
    return RunnerEvent("shard", step, text, {"shard": mode, "sharded": grouped})


class Replicas:
    """The replicas' group of one stage on ``device``, sharded per ``mode``; ZeRO-3's
    exchanges within forwards and backwards timed by ``timed``."""

    def __init__(self, device: torch.device, mode: str, timed: Timed = untimed) -> None:
        self._device = device
        self._mode = mode
        self._timed = timed
        self._collective: GlooCollective | None = None
        self._shards: StageShards | None = None

    @property
    def grouped(self) -> bool:
        """Whether the stage sums over a group of replicas here (``reduce``)."""
        return self._collective is not None

    def host(self) -> tuple[str, int]:
        """Replica 0: start the group's rendezvous; the address the replicas join at."""
        self._collective = GlooCollective(self._device)
        return self._collective.host()

    def join(self, address: str, port: int, rank: int, world: int, name: str) -> None:
        """Join the group ``name`` as replica ``rank`` of ``world``."""
        self.require_whole("joining another group")
        if self._collective is None:
            self._collective = GlooCollective(self._device)
        self._collective.join(address, port, rank, world, name)

    def leave(self) -> None:
        """Leave the group: the stage is no longer replicated."""
        self.require_whole("leaving its group")
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    def abort(self) -> None:
        """A step failed here: leave the group at once, so that replicas waiting on this one
        in a collective fail now instead of waiting out its timeout and being taken for
        lost themselves (a recovery forms the group again)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    def _sharded(self, blocks: Sequence[Block], *, relayed: bool = False) -> StageShards | None:
        """This replica's shares, made from the blocks' whole state: at the first update of
        a sharded, replicated stage, or (ZeRO-3, ``prepare``) before its first forward; None
        for whole replicas. ``relayed`` steps (a call per forward and backward, whose
        order among the replicas the runner sets) cannot gather in lockstep: ZeRO-3 shards
        only the optimizer state there."""
        collective = self._collective
        if self._mode == "none" or collective is None or collective.world < 2:
            return None
        if self._shards is None:
            mode = "optimizer" if relayed and self._mode == "full" else self._mode
            self._shards = StageShards(blocks, mode, collective, self._timed)
        return self._shards

    def prepare(self, blocks: Sequence[Block]) -> None:
        """Before a step's first forward: ZeRO-3 shards the parameters now."""
        if self._mode == "full":
            self._sharded(blocks)

    def reduce(self, blocks: Sequence[Block], *, scatter: bool = True) -> None:
        """Sum the accumulated gradients over the replicas: all-reduced, or reduce-scattered
        into this replica's slices (``gradients``, unless not ``scatter``: the relayed path,
        whose runner reads replica 0's norms alone). A lost replica is a ``LinkError``."""
        if self._collective is None:
            return
        shards = self._sharded(blocks, relayed=not scatter)
        try:
            if shards is not None and shards.mode == "full":
                shards.settle()  # summed micro-batch by micro-batch already
            elif scatter and shards is not None and shards.mode == "gradients":
                shards.reduce_scatter(self._collective)
            else:
                self._collective.all_reduce(blocks)
        except RuntimeError as exc:  # gloo and NCCL report a lost replica as RuntimeError
            raise LinkError(None, " ".join(str(exc).split())[:300]) from exc

    @property
    def sharded(self) -> bool:
        """Whether this replica holds shares of the blocks' state now."""
        return self._shards is not None

    @property
    def scattered(self) -> bool:
        """Whether the step's summed gradients are here as this replica's slices."""
        return self._shards is not None and self._shards.scattered

    def scattered_norms(self) -> Tensor:
        """With the summed gradients reduce-scattered, each parameter's gradient norm from
        every replica's slices (every replica asks at once)."""
        if self._shards is None or not self._shards.scattered or self._collective is None:
            raise StageStateError("the gradients are not reduce-scattered: read them whole")
        return self._shards.grad_norms(self._collective)

    def copyable(self, blocks: Sequence[Block]) -> Sequence[Block] | Sequence[BlockShard]:
        """What an in-memory copy of the stage takes: this replica's shares of ``blocks``
        while sharded, else the blocks."""
        return self._shards.shards if self._shards is not None else blocks

    def shares(self, blocks: Sequence[Block]) -> StageShards | None:
        """The shares that update this replica's slices, where the stage is sharded."""
        return self._sharded(blocks)

    def gather(self) -> None:
        """All-gather every replica's updated slices into the blocks' parameters."""
        if self._shards is not None and self._collective is not None:
            self._shards.gather(self._collective)

    def unshard(self) -> None:
        """Give every block its whole state back (every replica at once); the next update
        shards again."""
        if self._shards is not None and self._collective is not None:
            self._shards.unshard(self._collective)
        self._shards = None

    def forget(self) -> None:
        """The blocks are about to be loaded anew: the shares hold a state that is no
        longer theirs (under ZeRO-3 the parameters get whole memory back for the load)."""
        if self._shards is not None:
            self._shards.release()
        self._shards = None

    def require_whole(self, what: str) -> None:
        if self._shards is not None:
            raise StageStateError(f"its replicas are sharded: unshard them before {what}")

    def held_bytes(self, blocks: Sequence[Block]) -> int:
        """Bytes of ``blocks``' state as this replica holds it now: whole, or its shares."""
        if self._shards is not None:
            return self._shards.held_bytes()
        return sum(block.nbytes() for block in blocks)
