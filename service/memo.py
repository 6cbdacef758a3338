"""A bounded memo that computes each key once, however many threads ask at once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class OnceEach(Generic[T]):
    """``get(key, compute)``: ``compute()``'s value for ``key``, computed by the first caller
    while the others asking for that key wait for it. A computation that raises is not kept
    (every caller waiting gets the error; the next one computes again). At most ``size``
    keys are kept, the least recently used going first. Values are shared: keep them
    immutable."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._values: OrderedDict[str, Future[T]] = OrderedDict()

    def get(self, key: str, compute: Callable[[], T]) -> T:
        with self._lock:
            future = self._values.get(key)
            owner = future is None
            if future is None:
                future = self._values[key] = Future()
                while len(self._values) > self.size:
                    self._values.popitem(last=False)
            self._values.move_to_end(key)
        if not owner:
            return future.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                if self._values.get(key) is future:
                    del self._values[key]
            future.set_exception(exc)
            raise
        future.set_result(value)
        return value
