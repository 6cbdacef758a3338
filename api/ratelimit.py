"""Requests per second per caller: a token bucket per bearer token (per client address for
requests without one), refused with 429 and ``Retry-After`` once spent.

Health probes and ``/metrics`` are never limited (monitoring must see an overloaded server).
Callers are keyed by a hash of their token, never the token itself, and at most
``MAX_CALLERS`` buckets are kept (the least recently seen go first), so memory is bounded
whatever the traffic.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

MAX_CALLERS = 10_000
UNLIMITED = ("/healthz", "/readyz", "/metrics")


@dataclass
class _Bucket:
    tokens: float
    at: float


class Buckets:
    """Token buckets: ``rate`` requests per second on average, bursts of ``burst``."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, caller: str) -> float:
        """Spend one request of ``caller``'s: 0 if allowed, else the seconds until it is."""
        now = self._clock()
        bucket = self._buckets.pop(caller, None) or _Bucket(float(self.burst), now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        self._buckets[caller] = bucket  # the most recently seen last
        while len(self._buckets) > MAX_CALLERS:
            self._buckets.popitem(last=False)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate


def caller(scope: Scope) -> str:
    """Who is asking: a hash of the bearer token, or the client address without one."""
    for name, value in scope.get("headers") or []:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return "token:" + hashlib.sha256(value[7:].strip()).hexdigest()[:32]
    client = scope.get("client")
    return f"address:{client[0] if client else '-'}"


class RateLimit:
    """ASGI middleware refusing a caller's requests beyond its bucket with 429."""

    def __init__(self, app: ASGIApp, rate: float, burst: int) -> None:
        self.app = app
        self.buckets = Buckets(rate, burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED:
            await self.app(scope, receive, send)
            return
        wait = self.buckets.take(caller(scope))
        if wait <= 0:
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "detail": f"too many requests: at most {self.buckets.rate:g} per second"
                f" (bursts of {self.buckets.burst}) per token; retry after the"
                " Retry-After seconds",
                "errors": [],
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(math.ceil(wait)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
