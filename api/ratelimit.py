"""Requests per second per caller: a token bucket per principal (per client address for
requests without a valid token), refused with 429 and ``Retry-After`` once spent.

A caller is who the authenticator says it is, not the bytes of its header: every token of a
user, in every form ``HTTPBearer`` accepts, spends that user's bucket, and a request with no,
a wrong or a revoked token spends its address's, whatever token string it sends. The address
is the connecting peer's; ``X-Forwarded-For`` names it only when that peer is a proxy the
operator listed (``SHOAL_TRUSTED_PROXIES``), and other forwarding headers never do.

Health probes and ``/metrics`` are never limited (monitoring must see an overloaded server).
At most ``MAX_CALLERS`` buckets are kept (the least recently seen go first), so memory is
bounded whatever the traffic.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.api.deps import bearer_token, principal_of

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


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def client_address(scope: Scope, trusted: tuple[Network, ...]) -> str:
    """The caller's address: the peer's, or, while the hop that named it is a trusted proxy,
    the address that proxy put last in ``X-Forwarded-For`` (read right to left: only the
    entries trusted proxies appended can be believed, a client writes the rest)."""
    client = scope.get("client")
    address = client[0] if client else "-"
    if not trusted:
        return address
    values = Headers(scope=scope).getlist("x-forwarded-for")
    hops = [hop.strip() for value in values for hop in value.split(",") if hop.strip()]
    while hops and _is_trusted(address, trusted):
        address = hops.pop()
    return address


def _is_trusted(address: str, trusted: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in trusted)


async def caller(scope: Scope, trusted: tuple[Network, ...], authenticate: bool) -> str:
    """Who is asking: the principal of a valid bearer token, else the client address."""
    token = bearer_token(Headers(scope=scope)) if authenticate else None
    if token is not None:
        try:
            principal = await principal_of(scope, token)
        except SQLAlchemyError:
            principal = None  # the endpoint's own lookup answers 503
        if principal is not None:
            return f"user:{principal.user_id}"
    return "address:" + client_address(scope, trusted)


class RateLimit:
    """ASGI middleware refusing a caller's requests beyond its bucket with 429."""

    def __init__(
        self,
        app: ASGIApp,
        rate: float,
        burst: int,
        trusted_proxies: tuple[str, ...] = (),
        authenticate: bool = True,
    ) -> None:
        self.app = app
        self.buckets = Buckets(rate, burst)
        self.trusted = tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies)
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED:
            await self.app(scope, receive, send)
            return
        wait = self.buckets.take(await caller(scope, self.trusted, self.authenticate))
        if wait <= 0:
            await self.app(scope, receive, send)
            return
        refusal = JSONResponse(
            {
                "detail": f"too many requests: at most {self.buckets.rate:g} per second"
                f" (bursts of {self.buckets.burst}) per user (per address without a valid"
                " token); retry after the Retry-After seconds",
                "errors": [],
            },
            status_code=429,
            headers={"Retry-After": str(math.ceil(wait))},
        )
        await refusal(scope, receive, send)
