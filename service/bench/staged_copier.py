"""A candidate copier, measured against Shoal's in ``shoal bench copier --copier staged``: a
block's state copied through a staging buffer on the device, a chunk at a time, where
``workers.pipeline.copier.Copier`` copies each tensor on its own.

On a GPU ``Copier.start`` issues, on the host, a pinned allocation, a device-to-host copy
and a ``record_stream`` for each tensor: some 370 for the step bench's large GPT with its
AdamW state, where a job on an H200 booked ~7 ms a copy (its start and the waits it caused,
not measured apart: docs/benchmarks.md). Here the tensors of one dtype are concatenated, on
the side stream, into a staging buffer of ``chunk_bytes`` at most (one ``torch.cat`` a
chunk), and each chunk goes to pinned host memory in one copy; a tensor larger than a chunk
is copied on its own. A block's optimizer step waits only for the concatenation that read
its last tensor (``guard``), so the copy is exactly the boundary's state, as ``Copier``'s
is. A copy's host state is views into its chunks, made when asked (``latest``), not as it
starts. On a CPU device the same copy is made at once, without a stream: there the tests
check that the views hold the boundary's state bit for bit.

Not Shoal's copier until a GPU run of the bench says it pays.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shoal.workers.blocks import map_tensors, tensors_in
from shoal.workers.pipeline.copier import Copyable, forward_changes_copied

_CUDA: Any = torch.cuda  # torch's stubs leave Stream and Event untyped

CHUNK_BYTES = 32 * 2**20
"""The staging buffer's size: a chunk's most bytes."""


@dataclass(frozen=True)
class Chunk:
    """Tensors of one dtype copied together, by their place in the state's order; ``staged``:
    through the staging buffer (else one tensor larger than it, copied on its own)."""

    dtype: torch.dtype
    members: tuple[int, ...]
    numel: int
    staged: bool


@dataclass(frozen=True)
class Place:
    """Where a tensor's copy lies: ``offset`` elements into chunk ``chunk``."""

    chunk: int
    offset: int


def pack(tensors: Sequence[Tensor], chunk_bytes: int) -> tuple[list[Chunk], dict[int, Place]]:
    """The chunks ``tensors`` are copied in: each of one dtype, its tensors in their order,
    at most ``chunk_bytes`` (a chunk closes as the next tensor would overflow it; the chunks
    still open come last); a larger tensor is a chunk of its own. Where each tensor lands,
    by its place in ``tensors``."""
    chunks: list[Chunk] = []
    places: dict[int, Place] = {}
    filling: dict[torch.dtype, list[int]] = {}  # each dtype's chunk being filled
    filled: dict[torch.dtype, int] = {}  # and its bytes so far

    def add(dtype: torch.dtype, members: list[int], *, staged: bool = True) -> None:
        offset = 0
        for i in members:
            places[i] = Place(len(chunks), offset)
            offset += tensors[i].numel()
        chunks.append(Chunk(dtype, tuple(members), offset, staged))

    for i, tensor in enumerate(tensors):
        size, dtype = tensor.numel() * tensor.element_size(), tensor.dtype
        if size > chunk_bytes:
            add(dtype, [i], staged=False)
            continue
        if filled.get(dtype, 0) + size > chunk_bytes:
            add(dtype, filling.pop(dtype))
            filled[dtype] = 0
        filling.setdefault(dtype, []).append(i)
        filled[dtype] = filled.get(dtype, 0) + size
    for dtype, members in filling.items():
        add(dtype, members)
    return chunks, places


@dataclass
class _Copy:
    states: list[Any]
    """Each block's live state: the layout its host state is rebuilt in."""
    shapes: list[torch.Size]
    """Each tensor's shape, in the states' order."""
    chunks: list[Tensor]
    """Each chunk's host memory."""
    places: dict[int, Place]
    clones: dict[int, Tensor]
    """The tensors not on the device (such as Adam's step counts on a GPU's), copied at once."""
    done: Any
    """The event the copy's last chunk completes (None on a CPU device: complete at once)."""

    def result(self) -> list[Any]:
        """Each block's state as the copy holds it (views into the chunks)."""
        if self.done is not None:
            self.done.synchronize()
        views = iter(self._views())
        return [map_tensors(state, lambda _: next(views)) for state in self.states]

    def _views(self) -> Iterator[Tensor]:
        for i, shape in enumerate(self.shapes):
            if i in self.clones:
                yield self.clones[i]
                continue
            at = self.places[i]
            yield self.chunks[at.chunk][at.offset : at.offset + shape.numel()].view(shape)


class StagedCopier:
    """The copies of one worker's blocks on ``device`` through a staging buffer: the last
    ``generations`` started kept. The surface ``shoal bench copier`` uses of ``Copier``."""

    def __init__(
        self, device: torch.device, generations: int, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self._device, self._chunk_bytes = device, chunk_bytes
        self._cuda = device.type == "cuda"
        self._stream: Any = _CUDA.Stream(device) if self._cuda else None
        self._staging: Tensor | None = None
        self._kept: deque[_Copy] = deque(maxlen=generations)
        self._unguarded: dict[int, Any] = {}
        self._layout: tuple[tuple[Any, ...], list[Chunk], dict[int, Place]] | None = None

    def reserve(self, blocks: Sequence[Copyable]) -> None:
        """Make the staging buffer, and the pinned host memory every copy alive at once
        needs, ready (held in torch's caching host allocator for the copies to take)."""
        tensors = [t for b in blocks for t in tensors_in(b.live_state())]
        chunks, _ = self._pack(tensors)
        spare = [self._host(c) for _ in range(self._kept.maxlen or 0) for c in chunks]
        del spare
        self._staging_buffer()

    def start(self, step: int, number: int, blocks: Sequence[Copyable]) -> None:
        """Start copying ``blocks`` as they are after ``step`` steps (copy ``number``, as
        ``Copier.start`` is asked); returns at once (on a CPU device once it is made)."""
        states = [forward_changes_copied(b) for b in blocks]
        owned = [
            (b.index, t) for b, state in zip(blocks, states, strict=True) for t in tensors_in(state)
        ]
        tensors = [t for _, t in owned]
        chunks, places = self._pack(tensors)
        hosts = [self._host(c) for c in chunks]
        last: dict[int, int] = {}  # each block's last chunk, in the order chunks are copied
        for i, (index, _) in enumerate(owned):
            if i in places:
                last[index] = max(last.get(index, 0), places[i].chunk)
        clones = {i: t.clone() for i, t in enumerate(tensors) if i not in places}
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        with self._on_side():
            staging = self._staging_buffer()
            for k, (chunk, host) in enumerate(zip(chunks, hosts, strict=True)):
                members = [tensors[i].detach().reshape(-1) for i in chunk.members]
                if chunk.staged:
                    flat = staging[: chunk.numel * members[0].element_size()].view(chunk.dtype)
                    torch.cat(members, out=flat)
                    read = self._event()  # the blocks may change once their chunk is read
                    host.copy_(flat, non_blocking=self._cuda)
                else:
                    host.copy_(members[0], non_blocking=self._cuda)
                    read = self._event()
                for index in [b for b, at in last.items() if at == k]:
                    self._unguarded[index] = read
            done = self._event()
        shapes = [t.shape for t in tensors]
        self._kept.append(_Copy(states, shapes, hosts, places, clones, done))

    def guard(self, index: int) -> None:
        """Before block ``index`` changes: order that after the copy's read of it."""
        event = self._unguarded.pop(index, None)
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def settle(self) -> None:
        """Wait until every kept copy is complete."""
        for copy in self._kept:
            if copy.done is not None:
                copy.done.synchronize()

    def latest(self) -> list[Any]:
        """The blocks' host states of the latest copy, once complete."""
        return self._kept[-1].result()

    def _pack(self, tensors: Sequence[Tensor]) -> tuple[list[Chunk], dict[int, Place]]:
        """``pack``'s answer for those of ``tensors`` on the device (by their places in
        ``tensors``), kept while their dtypes, sizes and devices stay."""
        key = tuple((t.dtype, t.numel(), t.device.type) for t in tensors)
        if self._layout is None or self._layout[0] != key:
            here = [i for i, t in enumerate(tensors) if t.device.type == self._device.type]
            chunks, places = pack([tensors[i] for i in here], self._chunk_bytes)
            members = [
                Chunk(c.dtype, tuple(here[j] for j in c.members), c.numel, c.staged) for c in chunks
            ]
            self._layout = (key, members, {here[j]: at for j, at in places.items()})
        return self._layout[1], self._layout[2]

    def _host(self, chunk: Chunk) -> Tensor:
        return torch.empty(chunk.numel, dtype=chunk.dtype, pin_memory=self._cuda)

    def _staging_buffer(self) -> Tensor:
        if self._staging is None:
            with self._on_side():
                self._staging = torch.empty(
                    self._chunk_bytes, dtype=torch.uint8, device=self._device
                )
        return self._staging

    def _on_side(self) -> AbstractContextManager[Any]:
        """Where the copies' device work goes: the side stream (a CPU device has none)."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _event(self) -> Any:
        if self._stream is None:
            return None
        event = _CUDA.Event()
        event.record(self._stream)
        return event
