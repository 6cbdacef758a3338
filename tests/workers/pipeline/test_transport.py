"""Neighbouring stages' links: tensors cross bit for bit, and a link that breaks fails fast."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from shoal.workers.pipeline.socket_wire import GREETING_S, SocketWire
from shoal.workers.pipeline.transport import GroupWire, Link, LinkError, Shape, Wire

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


WIRES: dict[str, Callable[[float], Wire]] = {
    "socket": SocketWire,
    "group": lambda timeout_s: GroupWire(CPU, timeout_s),  # gloo here, NCCL's code on CUDA
}


@pytest.fixture(params=sorted(WIRES))
def wire(request: pytest.FixtureRequest) -> Callable[[float], Wire]:
    return WIRES[request.param]


def pair(make: Callable[[float], Wire], timeout_s: float = 30.0) -> tuple[Link, Link]:
    """Two ends of one link over ``make``'s wires, formed in this process (a thread per end)."""
    lower = Link(CPU, +1, "test-link", timeout_s, make(timeout_s))
    upper = Link(CPU, -1, "test-link", timeout_s, make(timeout_s))
    address, port = lower.host()
    with ThreadPoolExecutor(2) as pool:
        joins = [pool.submit(end.join, address, port) for end in (lower, upper)]
        for join in joins:
            join.result(timeout=60)
    return lower, upper


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["value"] = work()
        except Exception as exc:
            out["error"] = exc
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_cross_a_link_both_ways_bit_for_bit(
    dtype: torch.dtype, wire: Callable[[float], Wire]
) -> None:
    lower, upper = pair(wire)
    try:
        activation = torch.randn(3, 5, 7).to(dtype)
        gradient = torch.randn(3, 5, 7).to(dtype)
        up = lower.send(activation)
        shape = Shape.of(activation)
        arrived = upper.recv(shape)
        down = upper.send(gradient)
        back = lower.recv(shape)
        assert arrived.wait().dtype == dtype
        assert torch.equal(bits(arrived.tensor), bits(activation))
        assert torch.equal(bits(back.wait()), bits(gradient))
        up.wait()
        down.wait()
    finally:
        lower.close()
        upper.close()


def test_a_header_tells_the_receiver_what_to_allocate(wire: Callable[[float], Wire]) -> None:
    lower, upper = pair(wire)
    try:
        shape = Shape(torch.bfloat16, (4, 128, 512))
        sent = lower.send_header(shape)  # kept until waited: a dropped send is cancelled
        assert upper.recv_header() == shape
        sent.wait()
    finally:
        lower.close()
        upper.close()


def test_a_shape_beyond_the_header_is_refused_with_the_limits() -> None:
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        Shape(torch.float32, (1,) * 9).encode(CPU)
    with pytest.raises(ValueError, match=r"dtype torch\.complex64"):
        Shape(torch.complex64, (2,)).encode(CPU)


def test_closing_one_end_fails_the_other_ends_pending_receive_at_once(
    wire: Callable[[float], Wire],
) -> None:
    lower, upper = pair(wire, timeout_s=30.0)
    pending = upper.recv(Shape(torch.float32, (4,)))
    thread, out = in_thread(pending.wait)
    time.sleep(0.2)  # the receive is waiting
    lower.close()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the receive still waits after its neighbour closed"
    assert isinstance(out.get("error"), LinkError), out
    assert out["error"].peer == -1
    assert out["seconds"] < 10, out  # far inside the 30 s timeout: the close, not a timeout
    upper.close()


def test_a_receive_nobody_answers_gives_up_at_the_links_timeout(
    wire: Callable[[float], Wire],
) -> None:
    lower, upper = pair(wire, timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(LinkError, match="offset -1"):
            upper.recv(Shape(torch.float32, (4,))).wait()
        assert time.monotonic() - started < 15
    finally:
        lower.close()
        upper.close()


def test_large_tensors_sent_both_ways_at_once_do_not_block_each_other(
    wire: Callable[[float], Wire],
) -> None:
    """Both ends post a send far larger than the kernel's buffers before either receives:
    neither send may wait for the other end to read (on a socket, the writer thread)."""
    lower, upper = pair(wire)
    try:
        activation, gradient = torch.randn(4, 1024, 1024), torch.randn(4, 1024, 1024)
        up, down = lower.send(activation), upper.send(gradient)
        arrived = upper.recv(Shape.of(activation))
        back = lower.recv(Shape.of(gradient))
        assert torch.equal(arrived.wait(), activation)
        assert torch.equal(back.wait(), gradient)
        up.wait()
        down.wait()
    finally:
        lower.close()
        upper.close()


def test_receives_fill_in_the_order_they_were_posted_whatever_order_they_are_waited(
    wire: Callable[[float], Wire],
) -> None:
    lower, upper = pair(wire)
    try:
        first, second = torch.arange(6.0).view(2, 3), torch.arange(10.0, 14.0)
        early = upper.recv(Shape.of(first))
        late = upper.recv(Shape.of(second))
        sends = [lower.send(first), lower.send(second)]
        assert torch.equal(late.wait(), second)
        assert torch.equal(early.wait(), first)
        for sent in sends:
            sent.wait()
    finally:
        lower.close()
        upper.close()


def test_a_send_the_neighbour_never_reads_fails_when_it_closes() -> None:
    """A send still queued (64 MB: more than the kernel takes) when the neighbour closes
    fails with a ``LinkError`` at once, not at the link's timeout."""
    lower, upper = pair(SocketWire, timeout_s=30.0)
    sent = lower.send(torch.zeros(16, 1024, 1024))
    thread, out = in_thread(sent.wait)
    time.sleep(0.2)
    upper.close()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the send still waits after its neighbour closed"
    assert isinstance(out.get("error"), LinkError), out
    assert out["seconds"] < 10, out
    lower.close()


def test_a_silent_connection_holds_the_link_up_only_for_the_greeting() -> None:
    """A connection that never greets (a port scan, a dead client) is dropped after
    ``GREETING_S``, and the neighbour connecting behind it is taken, long before the link's
    timeout."""
    lower, upper = Link(CPU, +1, "the-link", timeout_s=120.0), Link(CPU, -1, "the-link")
    address, port = lower.host()
    silent = socket.create_connection((address, port), timeout=10)
    began = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:
            joins = [pool.submit(end.join, address, port) for end in (lower, upper)]
            for join in joins:
                join.result(timeout=60)
        took = time.monotonic() - began
        assert GREETING_S <= took < GREETING_S + 10, took
        assert silent.recv(1) == b"", "the host kept the silent connection open"
    finally:
        silent.close()
        lower.close()
        upper.close()


def test_a_connection_that_does_not_name_the_link_is_not_taken_for_the_neighbour() -> None:
    lower, upper = Link(CPU, +1, "the-link"), Link(CPU, -1, "the-link")
    address, port = lower.host()
    stray = socket.create_connection((address, port), timeout=10)
    stray.sendall(b"\x00\x05other")
    try:
        with ThreadPoolExecutor(2) as pool:
            joins = [pool.submit(end.join, address, port) for end in (lower, upper)]
            for join in joins:
                join.result(timeout=60)
        assert stray.recv(1) == b"", "the host kept the stray connection open"
        sent = lower.send(torch.ones(3))
        assert torch.equal(upper.recv(Shape.of(torch.ones(3))).wait(), torch.ones(3))
        sent.wait()
    finally:
        stray.close()
        lower.close()
        upper.close()
