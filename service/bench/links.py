"""``shoal bench transport``'s link question: a value there and back between two pipeline
stages' processes, over each wire a CPU link could use.

This process and a spawned one form one ``workers.pipeline.transport.Link`` on the wire
measured, the way two neighbouring stages do (this process hosts, as the lower stage), and
pass a value there and back: the other process echoes what it receives. ``socket`` is the
wire CPU links use (``workers.pipeline.socket_wire``); ``gloo`` is a two-rank gloo group
(``transport.GroupWire`` on a CPU), what they used before and what the peer,
``torch.distributed.pipelining``, uses. No Ray runs beside them.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import torch

from shoal.service.bench.report import BenchError
from shoal.workers.pipeline.socket_wire import SocketWire
from shoal.workers.pipeline.transport import GroupWire, Link, Shape, Wire

LINK_WIRES = ("socket", "gloo")

_CPU = torch.device("cpu")
_TIMEOUT_S = 60.0
_EXIT_S = 30.0


def _wire(kind: str) -> Wire:
    if kind == "socket":
        return SocketWire(_TIMEOUT_S)
    if kind == "gloo":
        return GroupWire(_CPU, _TIMEOUT_S)
    raise ValueError(f"no wire {kind!r}; the wires are {', '.join(LINK_WIRES)}")


def _link(kind: str, peer: int) -> Link:
    return Link(_CPU, peer, f"bench-{kind}", _TIMEOUT_S, _wire(kind))


def _echo(kind: str, address: str, port: int, size: int, count: int) -> None:
    """The other end: receive ``count`` values of ``size`` floats, each sent straight back."""
    torch.set_num_threads(1)
    link = _link(kind, -1)
    link.join(address, port)
    shape = Shape(torch.float32, (size,))
    try:
        for _ in range(count):
            link.send(link.recv(shape).wait()).wait()
    finally:
        link.close()


def round_trip_ms(kind: str, size: int, calls: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the median milliseconds of ``calls`` round trips of
    ``size`` floats over a ``kind`` link, after ``warmup`` untimed ones."""
    total = warmup + calls * repeats
    link = _link(kind, +1)
    address, port = link.host()
    spawn = multiprocessing.get_context("spawn")
    other = spawn.Process(target=_echo, args=(kind, address, port, size, total), daemon=True)
    other.start()
    value = torch.randn(size)
    shape = Shape.of(value)
    seconds = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        link.join(address, port)
        for _ in range(total):
            started = time.perf_counter()
            sent = link.send(value)
            back = link.recv(shape).wait()
            sent.wait()
            seconds.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
        link.close()
        other.join(_EXIT_S)
        if other.is_alive():
            other.kill()
    if not torch.equal(back, value):
        raise BenchError(f"the {kind} link's echo differs from what was sent")
    timed = seconds[warmup:]
    return 1000 * statistics.median(
        statistics.median(timed[r * calls : (r + 1) * calls]) for r in range(repeats)
    )
