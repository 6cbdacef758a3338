"""OnceEach: one computation per key under concurrency, bounded, errors not kept."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.service.memo import OnceEach


def test_threads_asking_at_once_share_one_computation() -> None:
    memo: OnceEach[int] = OnceEach(4)
    calls, release = [], threading.Event()

    def compute() -> int:
        calls.append(1)
        release.wait(5)
        return 42

    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(memo.get, "k", compute) for _ in range(8)]
        release.set()
        assert [a.result(timeout=5) for a in answers] == [42] * 8
    assert len(calls) == 1


def test_a_failed_computation_is_not_kept_and_the_least_recent_key_goes_first() -> None:
    memo: OnceEach[str] = OnceEach(2)

    def fail() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError):
        memo.get("a", fail)
    assert memo.get("a", lambda: "a1") == "a1"  # computed again after the failure
    memo.get("b", lambda: "b1")
    memo.get("a", lambda: "unused")  # "a" is now the most recent
    memo.get("c", lambda: "c1")  # evicts "b"
    assert memo.get("a", lambda: "a2") == "a1"
    assert memo.get("b", lambda: "b2") == "b2"
