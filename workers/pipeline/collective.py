"""The data-parallel collective: summing one stage's block gradients across its replicas.

Data parallelism (as in DAPPLE's hybrid pipeline x data parallel): the replicas of a stage
hold the same blocks and train different micro-batches of the mini-batch; before the step,
every replica's accumulated gradients are replaced by their sum over the replicas, so each
replica applies the same update and they stay identical.

Two implementations of the same sum:

* ``sum_in_process`` adds the gradients of in-process ``Stage`` objects directly
  (``LocalGroup``, unit tests);
* ``GlooCollective`` runs a ``torch.distributed`` process group among the StageWorker actors of
  one stage (gloo on CPU, NCCL on CUDA), one group per stage, ranks = replica numbers. Replica
  0 hosts the rendezvous (a ``TCPStore`` on a free port of its node); the others join it.

The order of the sum is fixed and the same in both: a left fold in replica order,
``((g_0 + g_1) + g_2) + ...``, so results are deterministic and equal across the two. With two
replicas gloo's all-reduce is that sum (float addition is commutative); with more, gloo's ring
would add in another order per chunk, so each rank receives every replica's values of one
R-th of the buffer (an all-to-all), folds them in replica order, and the folded R-ths are
all-gathered: the bytes of a ring all-reduce, and every element the same fold. (Measured
among Ray actors on a 2-core box, 1M floats: 2 ranks 4.6 ms raw all-reduce, 10 ms with
flattening; 3 ranks 10 ms raw all-reduce against 52 ms when the whole buffers were
all-gathered and folded, as before 2026-11-27; ``shoal bench shard`` measured 4 replicas of
a 3.4M-parameter stage about twice as fast with the R-ths, docs/benchmarks.md.) Gradients
travel as one flat buffer per stage: one call per step instead of one per parameter.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed
from torch import Tensor

from shoal.workers.pipeline.clipping import gradients

# torch's stubs do not export the store and process-group classes; used untyped.
dist: Any = torch.distributed

DEFAULT_TIMEOUT_S = 300.0
"""How long a rank waits for its peers (rendezvous or a collective) before it raises."""


class HasBlocks(Protocol):
    """What the collective needs of a stage: its blocks' modules."""

    @property
    def blocks(self) -> Sequence[Any]: ...


def flatten_grads(blocks: Iterable[Any]) -> Tensor:
    """The blocks' gradients as one flat buffer, in block and parameter order."""
    grads = gradients(blocks)
    if not grads:
        return torch.zeros(0)
    return torch.cat([g.reshape(-1) for g in grads])


def unflatten_grads(blocks: Iterable[Any], flat: Tensor) -> None:
    """Write ``flat`` (as made by ``flatten_grads``) back into the blocks' gradients."""
    grads = gradients(blocks)
    total = sum(g.numel() for g in grads)
    if total != flat.numel():
        raise ValueError(f"a gradient buffer of {flat.numel()} values for {total} gradients")
    offset = 0
    for grad in grads:
        n = grad.numel()
        grad.copy_(flat[offset : offset + n].view_as(grad))
        offset += n


def ordered_sum(buffers: Sequence[Tensor]) -> Tensor:
    """``((b_0 + b_1) + b_2) + ...``: the one order both implementations sum in (a new
    tensor)."""
    total = buffers[0] + buffers[1] if len(buffers) > 1 else buffers[0].clone()
    for buffer in buffers[2:]:
        total += buffer
    return total


def pieces(flat: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """``flat`` cut into consecutive pieces of ``lengths``."""
    out, offset = [], 0
    for n in lengths:
        out.append(flat[offset : offset + n])
        offset += n
    return out


def sum_in_process(stages: Sequence[HasBlocks]) -> None:
    """Replace each replica's block gradients by their sum over ``stages`` (replica order)."""
    total = ordered_sum([flatten_grads(s.blocks) for s in stages])
    for stage in stages:
        unflatten_grads(stage.blocks, total)


def node_address() -> str:
    """This node's IP as the cluster sees it (Ray's view when running in Ray)."""
    try:
        import ray

        util: Any = ray.util
        if ray.is_initialized():
            return str(util.get_node_ip_address())
    except ImportError:  # pragma: no cover - Ray is a dependency; kept usable without it
        pass
    return socket.gethostbyname(socket.gethostname())


class GroupMember:
    """One rank of a ``torch.distributed`` process group formed among Ray actors (gloo; NCCL
    when ``device`` is CUDA), without the global default group, so one actor can belong to
    several groups (its stage's replicas, its pipeline neighbours) and leave any of them.

    Rank 0 calls ``host`` first and hands ``(address, port)`` to every rank, itself
    included, which then call ``join`` concurrently (the rendezvous waits for all ``world``).
    """

    def __init__(self, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._device = device
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._group: Any = None
        self.rank = 0
        self.world = 1

    def host(self, address: str | None = None) -> tuple[str, int]:
        """Start the rendezvous store on a free port of this node; return where it listens."""
        self._store = dist.TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=self._timeout,
        )
        return (address or node_address(), int(self._store.port))

    def join(self, address: str, port: int, rank: int, world: int, name: str) -> None:
        """Form the process group ``name`` as ``rank`` of ``world`` (blocks until all join)."""
        if rank != 0 or self._store is None:
            self._store = dist.TCPStore(address, port, is_master=False, timeout=self._timeout)
        store = dist.PrefixStore(name, self._store)
        if self._device.type == "cuda":
            self._group = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, world, self._timeout)
        self.rank, self.world = rank, world

    @property
    def group(self) -> Any:
        if self._group is None:
            raise RuntimeError("this rank has not joined its group; call join first")
        return self._group

    def close(self) -> None:
        """Leave the group at once: the peers' pending operations with this rank fail (the
        abort closes its connections), so nobody waits out a timeout on a rank that gave up.
        (No garbage collection here: a full one costs seconds in a process holding much.)"""
        group, self._group, self._store = self._group, None, None
        if group is not None:
            group.abort()


class GlooCollective(GroupMember):
    """One rank of one stage's data-parallel group: replica 0 hosts, every replica joins."""

    def reduce_scatter(self, sent: Tensor, sizes: Sequence[int]) -> Tensor:
        """This rank's chunk summed over the group in replica order: ``sent`` (flat) holds
        one chunk per rank end to end, rank q's ``sizes[q]`` values; rank q folds what it
        gets as ``ordered_sum`` does, so each chunk's sum is bitwise ``all_reduce``'s.
        The first and the last rank keep their own chunk out of the exchange (the others'
        are contiguous without it); a rank between them sends it to itself."""
        sent = sent.to(self._device)
        rank, mine = self.rank, sizes[self.rank]
        lo = sum(sizes[:rank])
        own = sent[lo : lo + mine]
        if rank == 0:
            out = sent[lo + mine :]
        elif rank == self.world - 1:
            out = sent[:lo]
        else:
            out = sent
        keep = out is not sent
        others = [0 if q == rank and keep else size for q, size in enumerate(sizes)]
        counts = [0 if q == rank and keep else mine for q in range(self.world)]
        received = torch.empty(sum(counts), dtype=sent.dtype, device=self._device)
        self.group.alltoall_base(received, out, counts, others).wait()
        chunks = pieces(received, [n for n in counts if n or not keep])
        if keep:
            chunks.insert(rank, own)
        return ordered_sum(chunks) if mine else received[:0]

    def all_gather(self, mine: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        """Every rank's ``mine`` (flat; rank q's holds ``sizes[q]`` values), in rank order;
        this rank's is ``mine`` itself."""
        flat = mine.reshape(-1).to(self._device)
        others = sum(sizes) - sizes[self.rank]
        received = torch.empty(others, dtype=flat.dtype, device=self._device)
        self._send_around(flat, received, sizes)
        parts = pieces(received, [n for q, n in enumerate(sizes) if q != self.rank])
        parts.insert(self.rank, flat)
        return parts

    def all_gather_into(self, out: Tensor, mine: Tensor, sizes: Sequence[int]) -> None:
        """Every rank's ``mine`` written into ``out`` (flat, rank q's ``sizes[q]`` values
        end to end in rank order), this rank's copied in: the others' land in place where
        they are contiguous (the first and the last rank)."""
        rank, world = self.rank, self.world
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        flat = mine.reshape(-1).to(self._device)
        if rank in (0, world - 1):
            self._send_around(flat, out[hi:] if rank == 0 else out[:lo], sizes)
        else:
            received = torch.empty(out.numel() - (hi - lo), dtype=out.dtype, device=out.device)
            self._send_around(flat, received, sizes)
            out[:lo].copy_(received[:lo])
            out[hi:].copy_(received[lo:])
        out[lo:hi].copy_(flat)

    def _send_around(self, flat: Tensor, received: Tensor, sizes: Sequence[int]) -> None:
        """Send ``flat`` to every other rank and receive theirs into ``received`` (rank
        order, this rank's left out), by an all-to-all: with two ranks ``flat`` goes as it
        is (gloo's own all-gather measured 1.5-2x slower for the same bytes:
        docs/benchmarks.md); beyond two it is repeated once per other rank."""
        rank, world = self.rank, self.world
        sent = flat if world == 2 else flat.repeat(world - 1)
        counts = [0 if q == rank else size for q, size in enumerate(sizes)]
        out = [0 if q == rank else flat.numel() for q in range(world)]
        self.group.alltoall_base(received, sent, counts, out).wait()

    def all_reduce(self, blocks: Sequence[Any]) -> None:
        """Replace the blocks' gradients by their sum over the group, in replica order."""
        group = self.group
        flat = flatten_grads(blocks).to(self._device)
        if self.world == 2:
            group.allreduce([flat]).wait()  # a + b == b + a: the replica-order sum
            total = flat
        else:
            total = self.fold_all(flat)
        unflatten_grads(blocks, total)

    def fold_all(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the group in replica order, every element as ``ordered_sum``
        adds it: each rank folds one R-th (``reduce_scatter``), the R-ths are gathered."""
        n = flat.numel()
        sizes = [n // self.world + (1 if q < n % self.world else 0) for q in range(self.world)]
        mine = self.reduce_scatter(flat, sizes)
        return torch.cat(self.all_gather(mine, sizes))
