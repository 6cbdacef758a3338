"""HTTP hardening: the security headers of every answer, and the DNS-rebinding guard of an
API served without auth.

Every response says ``X-Content-Type-Options: nosniff`` (a browser never runs a JSON answer
as a script or page), ``Referrer-Policy: no-referrer`` and ``X-Frame-Options: DENY``; the
dashboard's pages add a Content-Security-Policy that lets them load their own scripts and
styles and nothing else (no inline script, no other origin), so a hostile string that ever
reached the page as markup could not run.

With ``SHOAL_AUTH=false`` (loopback binds only, ``Settings.check_safe``) any web page the
user visits could still reach the API through DNS rebinding: a name of the attacker's
resolved to 127.0.0.1. Its requests carry that name in ``Host``, so a request whose ``Host``
is not a loopback name or address is refused with 400.
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self';"
    " frame-ancestors 'none'"
)
"""The dashboard's own modules and stylesheet, its API calls, and its ``data:`` favicon."""


def is_dashboard(path: str) -> bool:
    return path == "/" or path.startswith("/static/")


class SecurityHeaders:
    """ASGI middleware adding ``HEADERS`` to every response, and the CSP to the dashboard's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = list(HEADERS)
        if is_dashboard(scope["path"]):
            extra.append((b"content-security-policy", DASHBOARD_CSP.encode()))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                added = [(name, value) for name, value in extra if name not in present]
                message["headers"] = [*message.get("headers", []), *added]
            await send(message)

        await self.app(scope, receive, with_headers)


def is_loopback_host(host: str | None) -> bool:
    """Whether a ``Host`` header names this machine's loopback: ``localhost``, an address
    in 127.0.0.0/8 or ``[::1]``, with or without a port."""
    if not host:
        return False
    name, port = host, ""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                return False
            port = rest[1:]
    elif ":" in host:
        name, _, port = host.partition(":")
    if port and not port.isdigit():
        return False
    name = name.lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LoopbackHost:
    """ASGI middleware refusing, with 400, requests whose ``Host`` is not a loopback name."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not is_loopback_host(host):
                await _refusal(host)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(host: str | None) -> JSONResponse:
    shown = (host or "")[:100]
    return JSONResponse(
        {
            "detail": f"Host {shown!r} is not a loopback name: with SHOAL_AUTH=false Shoal"
            " answers only requests addressed to localhost, 127.0.0.1 or [::1] (a web page"
            " could otherwise reach it by DNS rebinding); open it as http://127.0.0.1:<port>"
            " or turn auth on",
            "errors": [{"field": "Host", "message": "not a loopback name"}],
        },
        status_code=400,
    )
