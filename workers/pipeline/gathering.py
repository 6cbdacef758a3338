"""ZeRO-3 (``parallelism.shard: full``): each block's parameters whole only while it runs.

Between uses a replica keeps only its slice of a block's parameters (``BlockShard.values``,
the storage of the whole ones released). Hooks on each block's module do the rest, as
FSDP's do (Zhao et al., VLDB '23; Rajbhandari et al., SC '20):

* before its forward, the parameters are all-gathered from every replica's slice;
* when its output's gradient arrives (the backward reaching the block), gathered again:
  the autograd graph saved the very tensors it used, and the refill writes them back;
* when every parameter has accumulated its gradient of the micro-batch, the gradient is
  reduce-scattered (each replica adds its slice of the sum to the slices of the
  micro-batches before).

One block is whole at a time: a block's parameters are released when another block's are
gathered (so a block whose backward follows its forward, or whose next forward follows
its backward, as at the ends of a stage, keeps them between the two), and at the step's
end, before the update changes the slices.

Every replica gathers and scatters the same blocks in the same order only if each runs the
same program: the same schedule over the same number of micro-batches, which the
partitioner gives a ``full`` job (``scheduler.partition``). The collectives run inside the
stage's forwards and backwards and are timed as all-reduce time, which the forward's and
backward's compute time leaves out (``workers.pipeline.timing``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from shoal.workers.pipeline.collective import GlooCollective
from shoal.workers.pipeline.timing import Timed, untimed
from shoal.workers.pipeline.transport import LinkError


class BlockShard(Protocol):
    """What the hooks need of a block's share (``workers.pipeline.sharding.BlockShard``)."""

    params: list[nn.Parameter]

    @property
    def index(self) -> int: ...

    @property
    def module(self) -> nn.Module: ...

    def fill(self, collective: GlooCollective) -> None: ...

    def free(self) -> None: ...

    def scatter_grad(self, collective: GlooCollective) -> None: ...


class Gatherer:
    """The hooks that gather and release ``shards``' parameters around each use of them,
    over ``collective`` (this stage's replicas), each exchange timed by ``timed``."""

    def __init__(
        self, shards: Sequence[BlockShard], collective: GlooCollective, timed: Timed = untimed
    ) -> None:
        self._collective = collective
        self._timed = timed
        self._accumulated = {shard.index: 0 for shard in shards}
        self._live: BlockShard | None = None
        """The block whose parameters are whole now."""
        self._handles: list[Any] = []
        for shard in shards:
            module: nn.Module = shard.module
            self._handles.append(module.register_forward_pre_hook(partial(self._before, shard)))
            self._handles.append(module.register_forward_hook(partial(self._after, shard)))
            for param in shard.params:
                self._handles.append(
                    param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        partial(self._done, shard)
                    )
                )

    def _call(self, what: Callable[[GlooCollective], None]) -> None:
        """``what(collective)``; a replica lost meanwhile is a ``LinkError`` (recovered)."""
        try:
            with self._timed("allreduce"):
                what(self._collective)
        except RuntimeError as exc:  # gloo and NCCL report a lost replica as RuntimeError
            raise LinkError(None, " ".join(str(exc).split())[:300]) from exc

    def _gather(self, shard: BlockShard) -> None:
        """``shard``'s parameters whole, the other block's released first."""
        if self._live is not None and self._live is not shard:
            self._live.free()
        self._live = None
        self._call(shard.fill)
        self._live = shard

    def _before(self, shard: BlockShard, module: nn.Module, args: Any) -> None:
        self._gather(shard)

    def _after(self, shard: BlockShard, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"block {shard.index} returned {type(output).__name__}, not one tensor:"
                    " parallelism.shard: full gathers a block's parameters for its backward"
                    " from its output's gradient (use shard: gradients)"
                )
            if output.requires_grad:
                output.register_hook(  # type: ignore[no-untyped-call]
                    partial(self._backward_reaches, shard)
                )

    def _backward_reaches(self, shard: BlockShard, grad: Tensor) -> None:
        self._gather(shard)

    def _done(self, shard: BlockShard, param: Tensor) -> None:
        self._accumulated[shard.index] += 1
        if self._accumulated[shard.index] == len(shard.params):
            self._accumulated[shard.index] = 0
            self._call(shard.scatter_grad)

    def finish(self) -> list[int]:
        """The step's backwards are done: release the parameters still whole; the blocks
        whose backward left some parameter without a gradient (their replicas never summed
        it). The counts start again."""
        if self._live is not None:
            self._live.free()
            self._live = None
        left = [index for index, count in self._accumulated.items() if count]
        self._accumulated = dict.fromkeys(self._accumulated, 0)
        return left

    def remove(self) -> None:
        """Take the hooks off: the blocks run whole again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
