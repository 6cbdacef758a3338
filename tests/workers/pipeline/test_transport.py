"""Neighbouring stages' links: tensors cross bit for bit, and a link that breaks fails fast."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from shoal.workers.pipeline.transport import Link, LinkError, Shape

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def pair(timeout_s: float = 30.0) -> tuple[Link, Link]:
    """Two ends of one link, formed in this process (one thread per end)."""
    lower = Link(CPU, +1, "test-link", timeout_s)
    upper = Link(CPU, -1, "test-link", timeout_s)
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
def test_tensors_cross_a_link_both_ways_bit_for_bit(dtype: torch.dtype) -> None:
    lower, upper = pair()
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


def test_a_header_tells_the_receiver_what_to_allocate() -> None:
    lower, upper = pair()
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


def test_closing_one_end_fails_the_other_ends_pending_receive_at_once() -> None:
    lower, upper = pair(timeout_s=30.0)
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


def test_a_receive_nobody_answers_gives_up_at_the_links_timeout() -> None:
    lower, upper = pair(timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(LinkError, match="offset -1"):
            upper.recv(Shape(torch.float32, (4,))).wait()
        assert time.monotonic() - started < 15
    finally:
        lower.close()
        upper.close()
