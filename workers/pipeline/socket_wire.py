"""A CPU link's wire: one TCP connection between two neighbouring stages, no gloo beneath.

gloo hands every message to a device thread of its own and back through a condition
variable, and a send waits for the receiver's ready-to-receive: several thread wake-ups per
hop where a socket read in the waiting thread has one. In a 2-stage pipeline of a tiny
model on the 2-core dev machine, each hop over gloo took 0.5-0.6 ms from one stage's send to
the other's receive and a step 8.4-9.8 ms; over this wire the step takes 2.6-2.7 ms
(``docs/benchmarks.md``, "CPU links on sockets"). Alone, two idle processes passing 1,024
floats there and back take ~0.09 ms over this wire against ~0.14 ms over a gloo pair
(``shoal bench transport``). A pipeline pays a hop per activation and per gradient on its
critical path, so CPU links carry their bytes on a socket of their own; CUDA links stay on
NCCL (device to device, ``workers.pipeline.transport``).

The stream carries the tensors' bytes back to back in the order they were sent; the
receiver posts its receives in that same order (``scheduler.programs`` fixes one order per
pair for both ends), so no framing is needed. Each transfer is posted without blocking:

* a send writes what the kernel takes at once from the calling thread (all of a small
  tensor); a remainder, and every send after it, goes to a writer thread, so two ends
  sending large tensors to each other at the same time cannot both block;
* a receive is read by whoever waits for it, earlier posted receives first (the stream's
  order), each read bounded by the wait's timeout.

A neighbour that closes its end (``close``, or a process that exits) ends the stream: the
other end's reads fail at once. A neighbour gone silently (a lost node) is the wait's
timeout. Failures are ``RuntimeError`` (``transport.Link`` names the neighbour).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import select
import socket
import struct
import threading
import time

from torch import Tensor

from shoal.workers.pipeline.collective import node_address

_HELLO = struct.Struct("!H")
"""The joining end's first bytes: the length of the link's name, then the name (the hosting
end checks it, so a stray connection is not taken for the neighbour)."""

GREETING_S = 5.0
"""How long the hosting end waits for a connection's greeting: the neighbour sends it as
soon as it connects, so a connection silent this long is a stray one, and the host goes
back to waiting for the neighbour."""


class WireError(RuntimeError):
    """The connection failed or was closed."""


def _bytes(tensor: Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes (no copy)."""
    flat = tensor.detach().view(-1)
    return flat.numpy().data.cast("B") if flat.numel() else memoryview(b"")


class _Transfer:
    """One posted send or receive: its bytes, how many have moved, and its end. (No event
    of its own: a message costs ~10 us of Python on this machine, where a hop is ~10 us.)"""

    __slots__ = ("done", "error", "moved", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.moved = 0
        self.done = False
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True


class SocketWork:
    """What ``send`` and ``recv`` return: ``wait(timeout)`` is True once the transfer is done,
    False if the timeout passed first; it raises if the connection failed."""

    def __init__(self, wire: SocketWire, transfer: _Transfer, incoming: bool) -> None:
        self._wire = wire
        self._transfer = transfer
        self._incoming = incoming

    def wait(self, timeout: datetime.timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        if self._incoming:
            return self._wire.read_until(self._transfer, deadline)
        return self._wire.sent(self._transfer, deadline)


class SocketWire:
    """One end of a CPU link. The lower stage calls ``host`` and hands its address to both
    ends, which then ``join`` (the host accepts, the other connects); each waits at most
    ``timeout_s`` for the other."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._listener: socket.socket | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._outgoing: collections.deque[_Transfer] = collections.deque()
        self._writer: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._sent = threading.Condition(self._lock)
        self._incoming: collections.deque[_Transfer] = collections.deque()
        self._read_lock = threading.Lock()
        self._poll = select.poll()
        self._closed = False

    def host(self) -> tuple[str, int]:
        """Listen on a free port of this node; where the other end connects."""
        listener = socket.create_server(("0.0.0.0", 0))
        listener.settimeout(self._timeout_s)
        self._listener = listener
        return node_address(), int(listener.getsockname()[1])

    def join(self, address: str, port: int, rank: int, name: str) -> None:
        """Form the connection (blocks until the other end joins too): rank 0 accepts on the
        port it hosts, rank 1 connects to it."""
        wanted = name.encode()
        try:
            if rank == 0:
                sock = self._accept(wanted)
            else:
                sock = socket.create_connection((address, port), timeout=self._timeout_s)
                sock.sendall(_HELLO.pack(len(wanted)) + wanted)
        except OSError as exc:
            raise WireError(f"could not connect link {name!r} ({address}:{port}): {exc}") from exc
        sock.settimeout(None)  # blocking; reads are bounded by polling first
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._poll.register(sock, select.POLLIN)
        self._sock = sock

    def _accept(self, wanted: bytes) -> socket.socket:
        listener = self._listener
        if listener is None:
            raise WireError("rank 0 joins the link it hosted; call host first")
        try:
            while True:
                sock, _ = listener.accept()
                sock.settimeout(min(self._timeout_s, GREETING_S))
                try:
                    (length,) = _HELLO.unpack(_read_exactly(sock, _HELLO.size))
                    if _read_exactly(sock, length) == wanted:
                        return sock
                except OSError:
                    pass
                sock.close()  # not the neighbour: keep waiting for it
        finally:
            self._listener = None
            listener.close()

    # ------------------------------------------------------------------------- sending

    def send(self, tensor: Tensor) -> SocketWork:
        """Post ``tensor``'s bytes (it must stay unchanged until the work is waited)."""
        transfer = _Transfer(_bytes(tensor))
        sock = self._connected()
        with self._lock:
            if not self._outgoing:
                self._write_now(sock, transfer)
            if not transfer.done:
                self._outgoing.append(transfer)
                self._start_writer()
                self._wake.notify()
        return SocketWork(self, transfer, incoming=False)

    def _write_now(self, sock: socket.socket, transfer: _Transfer) -> None:
        """Write what the kernel takes without blocking."""
        view = transfer.view
        try:
            while transfer.moved < len(view):
                transfer.moved += sock.send(view[transfer.moved :], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            transfer.finish(exc)
            return
        transfer.finish()

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_queued, daemon=True)
            self._writer.start()

    def _write_queued(self) -> None:
        """The writer thread: the queued sends in order, blocking, until the wire closes."""
        while True:
            with self._lock:
                while not self._outgoing and not self._closed:
                    self._wake.wait()
                if self._closed:
                    for transfer in self._outgoing:
                        transfer.finish(WireError("the link was closed"))
                    self._outgoing.clear()
                    self._sent.notify_all()
                    return
                transfer = self._outgoing[0]
                sock = self._sock
            try:
                if sock is None:
                    raise WireError("the link was closed")
                sock.sendall(transfer.view[transfer.moved :])
                transfer.moved = len(transfer.view)
                error: BaseException | None = None
            except OSError as exc:
                error = exc
            with self._lock:
                self._outgoing.popleft()
                transfer.finish(error)
                self._sent.notify_all()

    def sent(self, transfer: _Transfer, deadline: float) -> bool:
        """Wait until ``transfer`` (a send) has left; False if ``deadline`` passes first."""
        if not transfer.done:  # else it left at once, in ``send``
            with self._lock:
                while not transfer.done:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._sent.wait(left)
        if transfer.error is not None:
            raise WireError(f"a send failed: {transfer.error}")
        return True

    # ------------------------------------------------------------------------- receiving

    def recv(self, buffer: Tensor) -> SocketWork:
        """Post a receive into ``buffer`` (contiguous); the next bytes after every earlier
        posted receive's."""
        self._connected()
        transfer = _Transfer(_bytes(buffer))
        with self._read_lock:
            if len(transfer.view) == 0:
                transfer.finish()
            else:
                self._incoming.append(transfer)
        return SocketWork(self, transfer, incoming=True)

    def read_until(self, transfer: _Transfer, deadline: float) -> bool:
        """Read the stream into the posted receives, in order, until ``transfer`` is full;
        False if ``deadline`` passes first."""
        with self._read_lock:
            while not transfer.done:
                sock = self._connected()
                head = self._incoming[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not self._poll.poll(1000 * left):
                    return False
                try:
                    got = sock.recv_into(head.view[head.moved :])
                except OSError as exc:
                    raise WireError(f"the neighbour's connection failed: {exc}") from exc
                if got == 0:
                    raise WireError(
                        "the link was closed" if self._closed else "the neighbour closed the link"
                    )
                head.moved += got
                if head.moved == len(head.view):
                    self._incoming.popleft().finish()
        if transfer.error is not None:
            raise WireError(str(transfer.error))
        return True

    # ------------------------------------------------------------------------- ending

    def _connected(self) -> socket.socket:
        sock = self._sock
        if sock is None or self._closed:
            raise WireError("the link is closed" if self._closed else "the link is not joined")
        return sock

    def close(self) -> None:
        """End the connection at once: the other end's reads fail, as do this end's waits."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            listener, self._listener = self._listener, None
            self._wake.notify_all()
        for end in (sock, listener):
            if end is None:
                continue
            with contextlib.suppress(OSError):  # not connected, or the other end already went
                end.shutdown(socket.SHUT_RDWR)
            end.close()


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the greeting")
        data += chunk
    return bytes(data)
