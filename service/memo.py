"""A bounded memo that computes each key once, however many threads ask at once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


def _weightless(_: object) -> int:
    return 0


class OnceEach(Generic[T]):
    """``get(key, compute)``: ``compute()``'s value for ``key``, computed by the first caller
    while the others asking for that key wait for it. A computation that raises is not kept
    (every caller waiting gets the error; the next one computes again). At most ``size``
    keys are kept and, with ``max_bytes``, at most that many bytes of keys and values
    (``weigh(value)`` says a value's), the least recently used going first: keys come from
    requests, so a few huge ones must not hold what many small ones would. A value heavier
    than ``max_bytes`` on its own is returned but not kept. Values are shared: keep them
    immutable."""

    def __init__(
        self,
        size: int,
        max_bytes: int | None = None,
        weigh: Callable[[T], int] = _weightless,
    ) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._weigh = weigh
        self._lock = threading.Lock()
        self._values: OrderedDict[str, Future[T]] = OrderedDict()
        self._weights: dict[str, int] = {}
        self.bytes = 0
        """What the kept values and their keys weigh (values still being computed: nothing)."""

    def get(self, key: str, compute: Callable[[], T]) -> T:
        with self._lock:
            future = self._values.get(key)
            owner = future is None
            if future is None:
                future = self._values[key] = Future()
                self._evict()
            self._values.move_to_end(key)
        if not owner:
            return future.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                if self._values.get(key) is future:
                    self._drop(key)
            future.set_exception(exc)
            raise
        with self._lock:
            if self._values.get(key) is future:  # not evicted while it was computed
                self._weights[key] = len(key) + self._weigh(value)
                self.bytes += self._weights[key]
                self._evict()
        future.set_result(value)
        return value

    def _evict(self) -> None:
        """Drop the least recently used keys until both bounds hold (under the lock)."""
        while len(self._values) > self.size or (
            self.max_bytes is not None and self.bytes > self.max_bytes
        ):
            self._drop(next(iter(self._values)))

    def _drop(self, key: str) -> None:
        del self._values[key]
        self.bytes -= self._weights.pop(key, 0)
