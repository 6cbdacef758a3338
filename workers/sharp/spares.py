"""The device memory of SHARP shards leaving a GPU, handed to the shard coming onto it.

A demoted shard's tensors are read by their copy out on the host's side stream, so their
blocks go back to PyTorch's caching allocator only once that copy is done
(``record_stream``), and the allocator looks only when it is next asked for memory. A shard
promoted at once after another was demoted (a prefetch making room) would be given new
memory while the leaving shard's is still pending: the device would hold the leaving, the
resident and the coming shard together where the host accounts for two. Kept here instead,
a leaving tensor becomes the copy target of a coming one of the same shape and dtype (a
model's blocks, and a sweep's models, repeat their shapes): the copy into it is queued on
the side stream after the copy out of it, so the memory is reused in stream order and
nothing waits. What the coming shard does not take is let go when its promotion is done.

Only a shard's own state (its parameters, buffers and optimizer state) is kept: saved
activations may share memory with tensors that stay on the device.
"""

from __future__ import annotations

import torch

_Kind = tuple[tuple[int, ...], torch.dtype]


class Spares:
    """The tensors a device's demoted shards left, by shape and dtype, until let go."""

    def __init__(self) -> None:
        self._free: dict[_Kind, list[torch.Tensor]] = {}

    def keep(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``, a demoted shard's, whose copy out is queued on the side stream."""
        self._free.setdefault(_kind(tensor), []).append(tensor)

    def take(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A kept tensor shaped as ``like``, or new memory on ``device`` where none is."""
        kept = self._free.get(_kind(like))
        return kept.pop() if kept else torch.empty_like(like, device=device)

    def release(self) -> None:
        """Let the tensors nothing took go back to the allocator (once copied out)."""
        self._free.clear()


def _kind(tensor: torch.Tensor) -> _Kind:
    return tuple(tensor.shape), tensor.dtype
