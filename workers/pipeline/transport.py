"""Peer-to-peer transport between neighbouring pipeline stages: one link per pair.

Stage s and stage s+1 of a replica share a link, the lower stage its host. On CUDA it is a
two-rank NCCL group (device to device, no host copy); on CPU a TCP connection of its own
(``workers.pipeline.socket_wire``: one thread wake-up a hop where gloo has several).
Activations go up and gradients down as non-blocking sends and receives, posted
on both sides in the one order ``scheduler.programs`` fixes for the pair, so NCCL's
in-order streams cannot deadlock and a socket's bytes need no framing.

A receiver must size its buffer before the data arrives. The first activation of every
step travels behind a small header (dtype and shape); every later activation of the step,
and every gradient (shaped like the activation it answers), has that shape, so nothing
else needs one. A sender whose activation changes shape mid-step fails with a clear error
rather than corrupting its neighbour's buffer.

Failures: an operation that fails or outlives the link's timeout raises ``LinkError``
naming the neighbour. ``close`` ends the link at once, which fails the neighbour's pending
operations too: one stage giving up unblocks the whole pipeline (a peer's pending receive
fails as soon as the connection closes, or within ~10 ms of the other process exiting),
instead of every stage waiting out its timeout.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from shoal.workers.pipeline.collective import GroupMember
from shoal.workers.pipeline.socket_wire import SocketWire

LINK_TIMEOUT_S = 60.0
"""How long an operation with a neighbour may wait before the link gives up on it: the
longest a stage may wait for its neighbour's next micro-batch. A neighbour that dies
closes its connections and fails its peers at once; this bounds only a silent loss (a
node gone without closing them)."""

_HEADER_LEN = 10
"""Header: dtype code, number of dimensions, up to eight sizes."""
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)
# Dtypes a transport may lack are carried as same-width integers (bits unchanged).
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


class LinkError(RuntimeError):
    """A transfer with a neighbour failed: it died, left, or did not answer in time. With
    ``peer`` None, the stage's data-parallel group failed (some replica, not known which)."""

    def __init__(self, peer: int | None, reason: str) -> None:
        what = (
            "the data-parallel group"
            if peer is None
            else f"the link to the neighbour at offset {peer:+d}"
        )
        super().__init__(f"{what} failed: {reason}")
        self.peer = peer
        self.reason = reason


@dataclass(frozen=True)
class Shape:
    """What a receiver allocates: the tensor's dtype and sizes."""

    dtype: torch.dtype
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, tensor: Tensor) -> Shape:
        return cls(tensor.dtype, tuple(tensor.shape))

    def encode(self, device: torch.device) -> Tensor:
        if self.dtype not in _DTYPES or len(self.sizes) > _HEADER_LEN - 2:
            raise ValueError(
                f"a stage boundary tensor of dtype {self.dtype} and {len(self.sizes)}"
                f" dimensions cannot cross a link (dtypes {list(_DTYPES)}, at most"
                f" {_HEADER_LEN - 2} dimensions)"
            )
        values = [_DTYPES.index(self.dtype), len(self.sizes), *self.sizes]
        values += [0] * (_HEADER_LEN - len(values))
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, header: Tensor) -> Shape:
        values = header.tolist()
        return cls(_DTYPES[values[0]], tuple(values[2 : 2 + values[1]]))

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.sizes, dtype=self.dtype, device=device)


class Pending:
    """One posted operation: wait for it, then (a receive) read its tensor."""

    def __init__(self, link: Link, work: Any, tensor: Tensor) -> None:
        self._link = link
        self._work = work
        self.tensor = tensor

    def wait(self) -> Tensor:
        self._link.wait(self._work)
        return self.tensor


class Wire(Protocol):
    """What carries a link's bytes: ``SocketWire`` on CPU, ``GroupWire`` (NCCL) on CUDA."""

    def host(self) -> tuple[str, int]: ...

    def join(self, address: str, port: int, rank: int, name: str) -> None: ...

    def send(self, tensor: Tensor) -> Any: ...

    def recv(self, tensor: Tensor) -> Any: ...

    def close(self) -> None: ...


class GroupWire:
    """A link over a two-rank ``torch.distributed`` group: NCCL on CUDA (gloo on CPU, which
    only the transport tests use: CPU links are sockets)."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self._member = GroupMember(device, timeout_s)

    def host(self) -> tuple[str, int]:
        return self._member.host()

    def join(self, address: str, port: int, rank: int, name: str) -> None:
        self._member.join(address, port, rank, 2, name)

    def send(self, tensor: Tensor) -> Any:
        return self._member.group.send([tensor], 1 - self._member.rank, 0)

    def recv(self, tensor: Tensor) -> Any:
        return self._member.group.recv([tensor], 1 - self._member.rank, 0)

    def close(self) -> None:
        self._member.close()


def wire_for(device: torch.device, timeout_s: float) -> Wire:
    """The wire a link on ``device`` uses: NCCL between GPUs, a socket between CPUs."""
    if device.type == "cuda":
        return GroupWire(device, timeout_s)
    return SocketWire(timeout_s)


class Link:
    """This stage's end of the link it shares with the neighbour at ``peer`` (+1 or -1)."""

    def __init__(
        self,
        device: torch.device,
        peer: int,
        name: str,
        timeout_s: float = LINK_TIMEOUT_S,
        wire: Wire | None = None,
    ) -> None:
        self.peer = peer
        self.name = name
        self._device = device
        self._timeout_s = timeout_s
        self._wire = wire if wire is not None else wire_for(device, timeout_s)

    def host(self) -> tuple[str, int]:
        """Rank 0 (the lower stage): start the pair's rendezvous; where it listens."""
        return self._wire.host()

    def join(self, address: str, port: int) -> None:
        """Form the link (blocks until the neighbour joins too)."""
        rank = 0 if self.peer > 0 else 1
        self._guard(lambda: self._wire.join(address, port, rank, self.name))

    def send(self, tensor: Tensor) -> Pending:
        """Post ``tensor`` to the neighbour; it must stay unchanged until the send is waited."""
        bits = _as_bits(tensor.contiguous())
        work = self._guard(lambda: self._wire.send(bits))
        return Pending(self, work, bits)

    def recv(self, shape: Shape) -> Pending:
        """Post a receive of a tensor of ``shape``; ``wait`` returns it."""
        buffer = shape.empty(self._device)
        work = self._guard(lambda: self._wire.recv(_as_bits(buffer)))
        return Pending(self, work, buffer)

    def send_header(self, shape: Shape) -> Pending:
        return self.send(shape.encode(self._device))

    def recv_header(self) -> Shape:
        """Receive a header (blocking: the receiver needs it to size the data's buffer)."""
        blank = Shape(torch.int64, (_HEADER_LEN,))
        return Shape.decode(self.recv(blank).wait())

    def wait(self, work: Any) -> None:
        timeout = datetime.timedelta(seconds=self._timeout_s)
        started = time.monotonic()
        finished = self._guard(lambda: work.wait(timeout))
        if finished is False:  # gloo answers False on a timeout where it does not raise
            raise LinkError(self.peer, f"no answer within {time.monotonic() - started:.0f} s")

    def close(self) -> None:
        self._wire.close()

    def _guard(self, operation: Any) -> Any:
        try:
            return operation()
        except LinkError:
            raise
        except RuntimeError as exc:  # every wire reports a lost peer as RuntimeError
            raise LinkError(self.peer, " ".join(str(exc).split())[:300]) from exc


def _as_bits(tensor: Tensor) -> Tensor:
    bits = _BITS.get(tensor.dtype)
    return tensor if bits is None else tensor.view(bits)


class Links:
    """A stage's links to its pipeline neighbours, by offset (-1: previous, +1: next stage)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._links: dict[int, Link] = {}
        self._hosted: dict[int, Link] = {}

    def keep(self, names: dict[int, str | None]) -> None:
        """Close every link not named in ``names`` (by offset): its pair was replaced or is
        no longer adjacent."""
        for peer, link in list(self._links.items()):
            if names.get(peer) != link.name:
                del self._links[peer]
                link.close()

    def host(self, peer: int, name: str) -> tuple[str, int]:
        """Start the rendezvous of the new link ``name`` to ``peer`` (this stage is rank 0)."""
        link = Link(self._device, peer, name)
        self._hosted[peer] = link
        return link.host()

    def join(self, peer: int, name: str, address: str, port: int) -> None:
        """Form the link ``name`` to ``peer``, replacing any link to it."""
        hosted = self._hosted.pop(peer, None)
        if hosted is not None and hosted.name != name:  # a rendezvous nobody joined
            hosted.close()
            hosted = None
        link = hosted if hosted is not None else Link(self._device, peer, name)
        old = self._links.pop(peer, None)
        if old is not None:
            old.close()
        link.join(address, port)
        self._links[peer] = link

    def names(self) -> dict[int, str]:
        return {peer: link.name for peer, link in self._links.items()}

    def __getitem__(self, peer: int) -> Link:
        link = self._links.get(peer)
        if link is None:
            raise LinkError(peer, "this stage has no link to that neighbour (not connected)")
        return link

    def close(self) -> None:
        """Close every link: the neighbours' pending transfers with this stage fail at once."""
        links = [*self._links.values(), *self._hosted.values()]
        self._links.clear()
        self._hosted.clear()
        for link in links:
            link.close()
