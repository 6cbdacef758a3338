"""How tensors cross between processes through Ray (the runner, the stages, a stage's buddy
holding its in-memory copy): the one place that knows that transport.

A tensor leaves as a numpy array: Ray serializes numpy arrays with pickle protocol 5 out-of-band
buffers straight into the object store, where a torch tensor takes the slower general pickle
path (``shoal bench transport`` measures an actor call with 1M floats about 4x faster as
numpy). Dtypes numpy lacks (bfloat16, the mixed-precision activation type) travel as
same-width integers with their dtype beside them, so every bit arrives unchanged: the
exactness invariant needs the receiving stage to see the very tensor the sender computed.

On arrival the array is copied into a fresh tensor on the stage's device: arrays that come out
of Ray's object store are read-only views of shared memory, and a stage may write to its
inputs (an in-place activation) or hand them to autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

# Same-width integer stand-ins for the tensor dtypes numpy has no type for.
_BITS = {torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class Bits:
    """A tensor whose dtype numpy lacks: its raw bits and the dtype to read them as."""

    array: np.ndarray
    dtype: torch.dtype


Wire = np.ndarray | Bits
"""What ``send`` produces and ``receive`` takes."""


def send(tensor: Tensor) -> Wire:
    """``tensor`` detached, on the host, in the form Ray moves fastest."""
    host = tensor.detach().cpu()
    bits = _BITS.get(host.dtype)
    if bits is not None:
        return Bits(host.view(bits).numpy(), host.dtype)
    return host.numpy()


def receive(value: Wire, device: torch.device) -> Tensor:
    """The tensor ``send`` was given, as a fresh (writable) tensor on ``device``."""
    if isinstance(value, Bits):
        return torch.tensor(value.array, device=device).view(value.dtype)
    return torch.tensor(value, device=device)


def send_tree(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples, such as a block's state) with every tensor
    ``send``-ed: what Ray moves fastest. A state dict's version metadata stays with it."""
    if isinstance(value, Tensor):
        return send(value)
    return _map(value, send_tree)


def receive_tree(value: Any, device: torch.device) -> Any:
    """What ``send_tree`` was given, with fresh tensors on ``device``."""
    if isinstance(value, np.ndarray | Bits):
        return receive(value, device)
    return _map(value, lambda v: receive_tree(v, device))


def _map(value: Any, each: Any) -> Any:
    if isinstance(value, dict):
        out: Any = type(value)((k, each(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # nn.Module.state_dict's versions
            out._metadata = value._metadata
        return out
    if isinstance(value, list | tuple):
        return type(value)(each(v) for v in value)
    return value
