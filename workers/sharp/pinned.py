"""A SHARP shard's state between page-locked host memory and its GPU, moved asynchronously.

Hydra's double buffering needs a shard's copy onto the device to overlap the compute of the
task before it. A copy from pageable memory is synchronous, so each shard keeps page-locked
(pinned) host buffers of its own, made once and reused: its parameters, buffers and
optimizer state go back and forth with non-blocking copies on the host's side stream. The
tensors are moved in place (``.data`` and the optimizer's state entries), so the module's
parameter objects, and the optimizer over them, are the same after every move: nothing is
rebuilt. A leaving shard's device tensors are kept for the next shard coming on (``Spares``).
The side stream waits for the compute stream before a shard comes or leaves (here);
the caller has the compute stream wait for the side stream before a task, and the host for
the side stream (``settle``) before it reads a shard it has sent back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from shoal.workers.blocks import Block
from shoal.workers.sharp.spares import Spares

Slot = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]
"""One tensor of a shard's state: how to read it and how to put another in its place."""


class PinnedState:
    """The pinned host buffers of one shard's blocks, and the moves through them."""

    def __init__(self, blocks: Sequence[Block], spares: Spares) -> None:
        self._blocks = list(blocks)
        self._buffers: list[torch.Tensor] = []
        self._spares = spares
        """The device's spares, shared by its shards: left here, taken from here."""

    def to_device(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        """Copy the state onto ``device`` on ``stream``, without waiting for it, into device
        memory of the current (compute) stream's pool (``compute_pool_targets``), a spare
        where one has the shape."""
        slots = list(self._slots())
        targets = compute_pool_targets([read() for read, _ in slots], device, stream, self._spares)
        with torch.cuda.stream(stream):
            for (read, write), target in zip(slots, targets, strict=True):
                target.copy_(read(), non_blocking=True)
                write(target)

    def to_host(self, stream: torch.cuda.Stream) -> None:
        """Copy the state into its pinned buffers on ``stream``, after the work queued on
        the current stream so far (the last task that wrote it), without waiting for it.
        The device memory is kept for the next shard to copy into (``Spares``), or
        released once the copies are done (``record_stream``)."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for i, (read, write) in enumerate(self._slots()):
                live = read()
                if live.device.type != "cuda":
                    continue
                buffer = self._buffer(i, live)
                buffer.copy_(live, non_blocking=True)
                live.record_stream(stream)
                write(buffer)
                self._spares.keep(live)

    def _buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0))
        buffer = self._buffers[i]
        if buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype).pin_memory()
            self._buffers[i] = buffer
        return buffer

    def _slots(self) -> Iterator[Slot]:
        """Every tensor of the state, in a fixed order: each block's parameters, buffers,
        then optimizer state. Adam's step counters stay on the host (0-dim CPU tensors:
        where a non-capturable optimizer wants them)."""
        for block in self._blocks:
            for tensor in [*block.module.parameters(), *block.module.buffers()]:
                yield _data_slot(tensor)
            for param in block.module.parameters():
                state = block.optimizer.state.get(param, {})
                for name in sorted(state):
                    value = state[name]
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield _entry_slot(state, name)


def compute_pool_targets(
    tensors: Sequence[torch.Tensor],
    device: torch.device,
    stream: torch.cuda.Stream,
    spares: Spares | None = None,
) -> list[torch.Tensor]:
    """Empty tensors like ``tensors`` on ``device``, for ``stream`` to copy into, taken from
    the current (compute) stream's pool. PyTorch's caching allocator keeps a pool per stream
    and gives a freed block again only to the stream it was made on: a shard's memory
    taken on the side stream would stay there once the shard left, out of the tasks' reach
    (their activations are made on the compute stream), and the device would hold both
    pools' peaks where the host accounts for one. ``stream`` waits for the compute stream's
    work queued so far (which may still use a block given here), and a block goes back to
    the pool only once ``stream``'s work queued by then is done. With ``spares``, a kept
    tensor of the same shape is used first: its copy out is queued on ``stream`` already,
    ahead of the copy into it."""
    targets = [
        spares.take(t, device) if spares is not None else torch.empty_like(t, device=device)
        for t in tensors
    ]
    stream.wait_stream(torch.cuda.current_stream(device))
    for target in targets:
        target.record_stream(stream)
    return targets


def _data_slot(tensor: torch.Tensor) -> Slot:
    def write(value: torch.Tensor) -> None:
        tensor.data = value

    return (lambda: tensor.data), write


def _entry_slot(state: dict[str, torch.Tensor], name: str) -> Slot:
    def write(value: torch.Tensor) -> None:
        state[name] = value

    return (lambda: state[name]), write
