"""Sharded replicas (ZeRO-1, 2 and 3): the replicas of a stage split its optimizer's work.

With ``parallelism.shard: optimizer`` (ZeRO-1, Rajbhandari et al., SC '20) replica r of R
keeps optimizer state only for its slice of every block: the gradients are summed over the
replicas as without sharding (``GlooCollective.all_reduce``), each replica updates its
slice, and the slices are all-gathered into every replica's parameters. With ``gradients``
(ZeRO-2) no replica holds the whole summed gradient either: the replicas' gradients are
reduce-scattered, each receiving only its slice's sum, and their own are dropped. With
``full`` (ZeRO-3) the slices are the only parameters kept: a block's whole ones are
gathered for each use and its gradient reduce-scattered micro-batch by micro-batch
(``workers.pipeline.gathering``).

A block's parameters, flattened in parameter order, are cut into R contiguous slices (the
first ones a value longer where R does not divide them), so every block is spread over every
replica and each holds 1/R of the stage's optimizer state. A slice is one leaf tensor with
the job's optimizer over it: SGD, Adam and AdamW are element-wise, so its update is the
whole block's up to the rounding of vectorised kernels. The gradient sums are the
replica-order fold of ``workers.pipeline.collective``: a reduce-scatter is an all-to-all of
slices then that fold, bitwise what plain data parallelism sums.

State leaves a sharded stage whole: a checkpoint, relayout or re-cut first ``unshard``s
every replica (an all-gather of the optimizer state into each block's own optimizer), and
the next step shards again, so checkpoints and exports are those of an unsharded stage.
In-memory copies are the exception: each replica copies only its slice of every block's
parameters and optimizer state (``BlockShard.live_state``), and a recovery makes the blocks
whole from the replicas' copies (``workers.pipeline.pieces``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from shoal.workers.blocks import Block, make_optimizer
from shoal.workers.pipeline.collective import GlooCollective, ordered_sum, pieces
from shoal.workers.pipeline.gathering import Gatherer
from shoal.workers.pipeline.timing import Timed, untimed

SHARD_MODES = ("none", "optimizer", "gradients", "full")


class ShardingError(ValueError):
    """A block cannot be sharded as it is; the message says why and what to change."""


def slice_of(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[lo, hi)`` of ``numel`` values cut into ``world`` slices."""
    share, rest = divmod(numel, world)
    lo = rank * share + min(rank, rest)
    return lo, lo + share + (1 if rank < rest else 0)


def _flat(tensors: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
    """``tensors`` end to end, flat (on ``device`` when none holds a value)."""
    parts = [t.reshape(-1) for t in tensors if t.numel()]
    if parts:
        return torch.cat(parts)
    return torch.zeros(0, device=device or (tensors[0].device if tensors else None))


class BlockShard:
    """This replica's slice of one block: a leaf tensor over its values and the job's
    optimizer over it (the block's own optimizer keeps no state meanwhile). The block's
    parameters become views of one flat buffer, the slice one more view of it: the update
    changes them in place, and no copy of the slice is kept."""

    def __init__(self, block: Block, rank: int, world: int, *, full: bool = False) -> None:
        self.block = block
        self.params = list(block.module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.rank, self.world = rank, world
        self.lo, self.hi = slice_of(self.numel, rank, world)
        self._flat = _flat([p.detach() for p in self.params])
        offset = 0
        for p in self.params:
            p.data = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        own = self._flat[self.lo : self.hi]
        self.full = full
        """ZeRO-3: the slice is the only copy of the parameters kept; the whole ones are
        gathered for each use (``fill``) and freed after it (``free``)."""
        self.values = nn.Parameter(own.clone() if full else own)
        self.filled = True
        self.optimizer = make_optimizer(block.conf, [self.values])
        whole = block.optimizer.state_dict()["state"]
        if whole:
            self._load({k: _slice(v, self.lo, self.hi) for k, v in self._flat_state(whole).items()})
        block.optimizer.state.clear()
        if full:
            self.free()

    def _flat_state(self, per_param: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The block's optimizer state with each element-wise entry flattened over its
        parameters; the others (Adam's step) are the same for every parameter."""
        if set(per_param) != set(range(len(self.params))):
            raise ShardingError(
                f"block {self.block.index}: only some of its parameters have optimizer state;"
                " sharded replicas need every parameter trained every step"
                " (set parallelism.shard: none)"
            )
        flat: dict[str, Any] = {}
        for key, first in per_param[0].items():
            values = [per_param[i][key] for i in range(len(self.params))]
            if all(_elementwise(v, p) for v, p in zip(values, self.params, strict=True)):
                flat[key] = _flat(values)
            else:
                flat[key] = first
        return flat

    def _load(self, flat: dict[str, Any]) -> None:
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": {0: flat}, "param_groups": groups})

    def state_slices(self) -> dict[str, Any]:
        """The slice's optimizer state (element-wise entries flat), empty before a step."""
        state = self.optimizer.state_dict()["state"]
        return dict(state.get(0, {}))

    def restore(self, flat: dict[str, Any]) -> None:
        """Load the whole block's optimizer state, element-wise entries given flat."""
        groups = self.block.optimizer.state_dict()["param_groups"]
        shapes = [tuple(p.shape) for p in self.params]
        self.block.optimizer.load_state_dict(
            {"state": per_param_state(flat, shapes), "param_groups": groups}
        )

    @property
    def index(self) -> int:
        return self.block.index

    @property
    def module(self) -> nn.Module:
        return self.block.module

    def live_state(self) -> dict[str, Any]:
        """What a copy of this replica's share of the block holds, as live tensors
        (``Block.live_state``'s counterpart): the block's buffers, and this replica's slice
        of its parameters and of their optimizer state, with what makes the slices whole
        again (``workers.pipeline.pieces``). The replicas' parameters are the same bits (an
        all-gather), so R slices of them hold what each replica would copy whole."""
        module = self.block.module.state_dict(keep_vars=True)
        position = {id(p): i for i, p in enumerate(self.params)}
        params = {key: position[id(v)] for key, v in module.items() if id(v) in position}
        return {
            "module": {key: v.detach() for key, v in module.items() if key not in params},
            "slice": {
                "rank": self.rank,
                "world": self.world,
                "shapes": [tuple(p.shape) for p in self.params],
                "params": params,
                "values": self.values.detach(),
                "groups": self.block.optimizer.state_dict()["param_groups"],
                "state": self.state_slices(),
            },
        }

    def grad_parts(self, lo: int, hi: int) -> list[Tensor]:
        """Values ``[lo, hi)`` of the block's flat gradient as views of its parameters'
        gradients, in order (nothing copied)."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise ShardingError(
                f"block {self.block.index}: parameters {missing} got no gradient this step;"
                " sharded replicas need every parameter trained every step"
                " (set parallelism.shard: none)"
            )
        parts, offset = [], 0
        for p in self.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b and p.grad is not None:
                parts.append(p.grad.reshape(-1)[a - offset : b - offset])
            offset += p.numel()
        return parts

    def drop_grad(self) -> None:
        """The parameters' gradients, summed into the slice's, are dropped."""
        for p in self.params:
            p.grad = None

    def write_slice(self, rank: int, values: Tensor) -> None:
        """Set replica ``rank``'s slice of the block's parameters to ``values``."""
        lo, hi = slice_of(self.numel, rank, self.world)
        with torch.no_grad():
            self._flat[lo:hi].copy_(values)

    def _lengths(self) -> list[int]:
        cuts = (slice_of(self.numel, q, self.world) for q in range(self.world))
        return [hi - lo for lo, hi in cuts]

    def fill(self, collective: GlooCollective) -> None:
        """ZeRO-3: give the parameters their whole values again, all-gathered from every
        replica's slice into the storage ``free`` released. The autograd graphs of
        micro-batches in flight saved these very tensors: the refill writes the values they
        saw (nothing updates the slices during a step), so their version stays as it was."""
        if self.filled:
            return
        storage = self._flat.untyped_storage()
        storage.resize_(self._flat.numel() * self._flat.element_size())
        with torch.no_grad(), _unsafe_preserve_version_counter(self._flat):
            collective.all_gather_into(self._flat, self.values.detach(), self._lengths())
        self.filled = True

    def free(self) -> None:
        """ZeRO-3: release the whole parameters' memory (the tensors stay, storage empty)."""
        self._flat.untyped_storage().resize_(0)
        self.filled = False

    def release(self) -> None:
        """The block is about to be loaded anew: its parameters get memory of their own
        again (the load writes their values)."""
        if not self.filled:
            self._flat.untyped_storage().resize_(self._flat.numel() * self._flat.element_size())
            self.filled = True

    def scatter_grad(self, collective: GlooCollective) -> None:
        """ZeRO-3: sum this micro-batch's gradient of the block over the replicas, keeping
        this replica's slice of the sum, added to the slices of the micro-batches before
        it; the whole gradient is dropped."""
        whole = _flat(self.grad_parts(0, self.numel))  # the slices end to end, rank order
        self.drop_grad()
        mine = collective.reduce_scatter(whole, self._lengths())
        if self.values.grad is None:
            self.values.grad = mine
        else:
            self.values.grad.add_(mine)

    def nbytes(self) -> int:
        """Bytes of the slice's optimizer state (its values are the parameters')."""
        return sum(t.numel() * t.element_size() for t in _tensors(self.optimizer.state))

    def held_bytes(self) -> int:
        """Bytes this replica holds of the block now: its buffers, its parameters (whole,
        or under ZeRO-3 the slice, and the whole ones only while gathered), the slice's
        optimizer state."""
        buffers = sum(b.numel() * b.element_size() for b in self.block.module.buffers())
        params = self._flat.numel() * self._flat.element_size() if self.filled else 0
        if self.full:
            params += self.values.numel() * self.values.element_size()
        return buffers + params + self.nbytes()


def unflatten(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """``flat`` cut into fresh tensors of ``shapes``, end to end."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset : offset + size].view(shape).clone())
        offset += size
    return out


def per_param_state(flat: dict[str, Any], shapes: Sequence[tuple[int, ...]]) -> dict[int, Any]:
    """A block's optimizer state by parameter (as its optimizer's ``state_dict`` holds it)
    from ``flat``: each element-wise entry one tensor over the parameters of ``shapes`` end
    to end, the other entries (Adam's step) every parameter's own copy."""
    numel = sum(math.prod(shape) for shape in shapes)
    per_param: dict[int, Any] = {i: {} for i in range(len(shapes))}
    for key, value in flat.items():
        if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == numel > 0:
            parts = unflatten(value, shapes)
        else:  # a tensor of its own each: Adam counts its steps in place
            parts = [value.clone() if isinstance(value, Tensor) else value for _ in shapes]
        for i, part in enumerate(parts):
            per_param[i][key] = part
    return per_param if flat else {}


def _elementwise(value: Any, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == param.shape and value.dim() > 0


def _slice(value: Any, lo: int, hi: int) -> Any:
    if isinstance(value, Tensor) and value.dim() == 1:
        return value[lo:hi].clone()
    return value


def _tensors(state: Any) -> list[Tensor]:
    found: list[Tensor] = []
    for entry in state.values():
        found.extend(v for v in entry.values() if isinstance(v, Tensor))
    return found


class StageShards:
    """One replica's shares of its stage's blocks, ``mode`` ``optimizer``, ``gradients`` or
    ``full`` (whose parameters the ``collective`` gathers for each use,
    ``workers.pipeline.gathering``, timed by ``timed``)."""

    def __init__(
        self,
        blocks: Sequence[Block],
        mode: str,
        collective: GlooCollective,
        timed: Timed = untimed,
    ) -> None:
        if mode not in SHARD_MODES[1:]:
            raise ValueError(f"shard mode {mode!r}: choose one of {list(SHARD_MODES[1:])}")
        rank, world = collective.rank, collective.world
        self.mode, self.rank, self.world = mode, rank, world
        full = mode == "full"
        self.shards = [BlockShard(b, rank, world, full=full) for b in blocks]
        self._gatherer = Gatherer(self.shards, collective, timed) if full else None
        self._grads_scattered = False

    def _lengths(self, rank: int) -> list[int]:
        """Rank ``rank``'s slice length in each block."""
        return [hi - lo for lo, hi in (slice_of(s.numel, rank, self.world) for s in self.shards)]

    def reduce_scatter(self, collective: GlooCollective) -> None:
        """ZeRO-2: sum the gradients over the replicas, each keeping only its slices' sums;
        the blocks' own gradients are dropped."""
        cuts = [[slice_of(s.numel, q, self.world) for s in self.shards] for q in range(self.world)]
        sent = _flat(
            [
                part
                for q in range(self.world)
                for shard, (lo, hi) in zip(self.shards, cuts[q], strict=True)
                for part in shard.grad_parts(lo, hi)
            ]
        )
        for shard in self.shards:
            shard.drop_grad()
        sizes = [sum(self._lengths(q)) for q in range(self.world)]
        mine = collective.reduce_scatter(sent, sizes)
        for shard, part in zip(self.shards, pieces(mine, self._lengths(self.rank)), strict=True):
            shard.values.grad = part  # a view of the sum, made for this step
        self._grads_scattered = True

    def grad_norms(self, collective: GlooCollective) -> Tensor:
        """ZeRO-2: the L2 norm of each parameter's summed gradient, block and parameter order
        (``workers.pipeline.clipping``), from every replica's slices."""
        partial: list[Tensor] = []
        for shard in self.shards:
            grad = shard.values.grad
            offset = 0
            for p in shard.params:
                lo, hi = max(offset, shard.lo), min(offset + p.numel(), shard.hi)
                if grad is not None and lo < hi:
                    partial.append(grad[lo - shard.lo : hi - shard.lo].square().sum())
                else:  # none of it is here: a zero on the device
                    partial.append(p.detach().new_zeros(()))
                offset += p.numel()
        if not partial:
            return torch.zeros(0)
        mine = torch.stack(partial)
        parts = collective.all_gather(mine, [mine.numel()] * self.world)
        return ordered_sum(parts).sqrt()

    def settle(self) -> None:
        """ZeRO-3: the step's backwards are done and their gradients reduce-scattered as
        they came (``workers.pipeline.gathering``): the slices hold the summed gradients."""
        if self._gatherer is None:
            raise ShardingError("only ZeRO-3 (shard: full) scatters its gradients as it goes")
        unfinished = self._gatherer.finish()
        if unfinished:
            raise ShardingError(
                f"blocks {unfinished}: some parameters got no gradient this micro-batch;"
                " sharded replicas need every parameter trained every step"
                " (set parallelism.shard: none)"
            )
        self._grads_scattered = True

    @property
    def scattered(self) -> bool:
        """Whether the step's summed gradients are here as slices (ZeRO-2), not whole."""
        return self._grads_scattered

    def update(self, clip: float | None) -> None:
        """Update this replica's slices from the summed gradients (taken from the blocks'
        whole ones unless reduce-scattered), multiplied first by ``clip`` when given."""
        for shard in self.shards:
            if not self._grads_scattered:
                own = shard.grad_parts(shard.lo, shard.hi)
                shard.values.grad = _flat(own, shard.values.device)
                shard.drop_grad()
            grad = shard.values.grad
            if clip is not None and grad is not None:
                # A float32 scalar tensor, as clip_grad_norm_ multiplies by.
                grad.mul_(torch.tensor(clip, device=grad.device))
            shard.optimizer.step()
            shard.optimizer.zero_grad(set_to_none=True)
        self._grads_scattered = False

    def gather(self, collective: GlooCollective) -> None:
        """All-gather every replica's updated slices into the blocks' parameters (ZeRO-3:
        nothing now, each block gathers them where it next runs). This replica's own
        slices are views of its parameters, updated in place already."""
        if self._gatherer is not None:
            return
        mine = _flat([s.values.detach() for s in self.shards])
        sizes = [sum(self._lengths(q)) for q in range(self.world)]
        for q, part in enumerate(collective.all_gather(mine, sizes)):
            if q == self.rank:
                continue
            for shard, values in zip(self.shards, pieces(part, self._lengths(q)), strict=True):
                shard.write_slice(q, values)

    def unshard(self, collective: GlooCollective) -> None:
        """Give every block its whole optimizer state back (an all-gather of each replica's
        slices); the shards are done with after it."""
        if self._gatherer is not None:
            for shard in self.shards:
                shard.fill(collective)
            self._gatherer.remove()
        slices = [s.state_slices() for s in self.shards]
        keys = sorted({k for state in slices for k in state})
        sizes = [sum(self._lengths(q)) for q in range(self.world)]
        gathered: dict[str, list[Sequence[Tensor]]] = {}
        for key in keys:
            values = [state.get(key) for state in slices]
            if all(isinstance(v, Tensor) and v.dim() == 1 for v in values):
                mine = _flat([v for v in values if v is not None])
                parts = collective.all_gather(mine, sizes)
                gathered[key] = [pieces(p, self._lengths(q)) for q, p in enumerate(parts)]
        for b, (shard, state) in enumerate(zip(self.shards, slices, strict=True)):
            whole = {
                key: torch.cat([part[b] for part in gathered[key]]) if key in gathered else value
                for key, value in state.items()
            }
            shard.restore(whole)

    def release(self) -> None:
        """The blocks are about to be loaded anew: whole parameters of their own again, no
        hooks (``BlockShard.release``); the shards are done with after it."""
        if self._gatherer is not None:
            self._gatherer.remove()
        for shard in self.shards:
            shard.release()

    def nbytes(self) -> int:
        """Bytes of this replica's slices' optimizer state."""
        return sum(s.nbytes() for s in self.shards)

    def held_bytes(self) -> int:
        """Bytes this replica holds of its blocks now (``BlockShard.held_bytes``)."""
        return sum(s.held_bytes() for s in self.shards)
