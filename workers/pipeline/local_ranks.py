"""Every rank of one gloo group in this process, a thread each: for measuring and testing
the collectives on one machine without a worker per rank (``bench.shard``, the tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from shoal.workers.pipeline.collective import GlooCollective

T = TypeVar("T")


def run_ranks(
    world: int,
    body: Callable[[GlooCollective, int], T],
    *,
    timeout_s: float,
    name: str = "local-ranks",
) -> list[T | BaseException]:
    """``body(collective, rank)`` on each of ``world`` ranks of one gloo group on the CPU;
    per rank, what ``body`` returned or the exception it raised. A collective waits at most
    ``timeout_s`` seconds, and so does each thread before the group is closed."""
    ranks = [GlooCollective(torch.device("cpu"), timeout_s=timeout_s) for _ in range(world)]
    address, port = ranks[0].host("127.0.0.1")
    results: list[T | BaseException] = [
        TimeoutError(f"rank {r} did not finish within {timeout_s:g} s") for r in range(world)
    ]

    def rank(r: int) -> None:
        try:
            ranks[r].join(address, port, r, world, name)
            results[r] = body(ranks[r], r)
        except BaseException as exc:  # the caller reads it
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for r in ranks:
        r.close()
    return results
