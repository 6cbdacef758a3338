"""What autograd saves in a SHARP shard's forward, kept movable while the graph waits.

A shard that keeps its autograd graph between its forward and its backward (the job's
``recompute`` off: no second forward) may be demoted to host memory in between, while other
models' shards use the device. Autograd's saved tensors would pin the device memory: the
parameters' values (``weight.t()`` of a linear layer) and the activations. ``MovableSaves``
packs them differently (``torch.autograd.graph.saved_tensors_hooks``):

- a saved tensor that is a parameter, or a view of one, is kept by reference and read back
  from the parameter wherever it lives at backward time (the values are the same: the step
  comes after the backward);
- any other saved tensor is held in a box that ``to`` moves with the shard's blocks.

On a CPU device both are no-ops in effect (host and device memory are one); on a GPU they
are what lets a demoted shard's memory go while its graph is alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.workers.sharp.pinned import compute_pool_targets


@dataclass(frozen=True)
class _ParamView:
    """A saved view of a parameter: the geometry to read it back with."""

    param: Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def read(self) -> Tensor:
        return self.param.detach().as_strided(self.size, self.stride, self.offset)


class _Box:
    """A saved activation; ``tensor`` moves with the shard."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class MovableSaves:
    """Saved-tensor hooks for the forwards of a shard whose parameters are ``params``; the
    tensors its micro-batches keep on the device whatever moves are ``staying``."""

    def __init__(
        self,
        params: Callable[[], Iterable[Tensor]],
        staying: Callable[[], Iterable[Tensor]] = tuple,
    ) -> None:
        self._params = params
        self._staying = staying
        self._boxes: weakref.WeakSet[_Box] = weakref.WeakSet()
        """Boxes of graphs still alive (autograd drops them once their backward ran)."""

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run the shard's forwards under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: Tensor) -> _ParamView | _Box:
        storage = tensor.untyped_storage().data_ptr()
        for param in self._params():
            if param.device == tensor.device and param.untyped_storage().data_ptr() == storage:
                geometry = (tuple(tensor.size()), tensor.stride(), int(tensor.storage_offset()))
                return _ParamView(param, *geometry)
        box = _Box(tensor)
        self._boxes.add(box)
        return box

    def held(self) -> int:
        """Bytes of saved activations still waiting for their backward (each storage once)."""
        storages = {_storage(b.tensor): b.tensor.untyped_storage() for b in self._boxes}
        return sum(s.nbytes() for s in storages.values())

    def to(self, device: torch.device, *, stream: torch.cuda.Stream | None = None) -> None:
        """Move the saved activations to ``device``; on a GPU with ``stream``, its side stream
        (the shard's blocks move on it too), asynchronously: onto the device into memory of
        the compute stream's pool (``workers.sharp.pinned.compute_pool_targets``), or out
        into page-locked host memory after the compute queued so far, their device memory
        reused once the copy out of it is done. A storage moves once, whole, however many
        saved tensors view it (they view the one copy after), and one that a ``staying``
        tensor holds does not leave the GPU: the device holds it anyway, and a copy of it
        coming back would be held twice."""
        if stream is None:
            for box in list(self._boxes):
                box.tensor = box.tensor.to(device)
            return
        stay = set() if device.type == "cuda" else {_storage(t) for t in self._staying()}
        moving: dict[int, list[_Box]] = {}
        for box in list(self._boxes):
            key = _storage(box.tensor)
            if box.tensor.device.type != device.type and key not in stay:
                moving.setdefault(key, []).append(box)
        whole = [_raw(boxes[0].tensor) for boxes in moving.values()]
        if device.type == "cuda":
            moved = compute_pool_targets(whole, device, stream)
            with torch.cuda.stream(stream):
                for raw, target in zip(whole, moved, strict=True):
                    target.copy_(raw, non_blocking=True)
        else:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                # Non-blocking out of a GPU: PyTorch makes the host tensor page-locked.
                moved = [raw.to(device, non_blocking=True) for raw in whole]
                for raw in whole:
                    raw.record_stream(stream)
        for boxes, target in zip(moving.values(), moved, strict=True):
            for box in boxes:
                box.tensor = _view_in(target, box.tensor)


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _raw(tensor: Tensor) -> Tensor:
    """The whole storage under ``tensor``, as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _view_in(raw: Tensor, like: Tensor) -> Tensor:
    """``like``'s view (dtype, offset, sizes, strides) of its storage, in ``raw``'s copy of it."""
    view = torch.empty(0, dtype=like.dtype, device=raw.device)
    return view.set_(raw.untyped_storage(), like.storage_offset(), like.size(), like.stride())


def _unpack(packed: _ParamView | _Box) -> Tensor:
    return packed.read() if isinstance(packed, _ParamView) else packed.tensor
