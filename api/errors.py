"""Error responses: every failure is JSON ``{"detail", "errors"}``; no traceback leaves."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.api.schemas import ErrorOut
from shoal.service.exports import CheckpointNotFound
from shoal.service.idempotency import KeyConflict
from shoal.service.jobs import JobConflict, JobNotFound
from shoal.service.lifecycle import InvalidTransition
from shoal.service.spec_errors import SpecError
from shoal.service.sweeps import SweepNotFound

log = logging.getLogger(__name__)

# What each error status means, for the routes' OpenAPI ``responses`` (so the schema lists
# every status a route can answer; tests/api/test_fuzz.py holds the routes to it).
_MEANINGS = {
    400: "the body could not be read (JSON must be UTF-8)",
    401: "a missing, invalid or revoked bearer token",
    403: "an admin token is needed",
    404: "no such resource, or another user's",
    409: "the resource's state does not allow it, or the Idempotency-Key was used for another"
    " request",
    413: "a request body over SHOAL_MAX_BODY_BYTES",
    422: "invalid input; ``errors`` names each field",
    429: "too many requests from this user, or this address without a valid token"
    " (SHOAL_RATE_LIMIT_PER_S); retry after Retry-After",
    503: "the database is unreachable or the spec checks are all taken; nothing was changed,"
    " retry after Retry-After seconds",
}
# The headers an error always carries, as (name, meaning).
_HEADERS = {
    401: ("WWW-Authenticate", "Bearer: the scheme to authenticate with"),
    429: ("Retry-After", "seconds to wait before retrying"),
    503: ("Retry-After", "seconds to wait before retrying"),
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for the error statuses it can answer (each an ``ErrorOut``);
    every API route may also answer 429 (``api.ratelimit``)."""
    responses: dict[int | str, dict[str, Any]] = {}
    for code in (*codes, 429):
        responses[code] = {"model": ErrorOut, "description": _MEANINGS[code]}
        if code in _HEADERS:
            name, meaning = _HEADERS[code]
            header = {"description": meaning, "required": True, "schema": {"type": "string"}}
            responses[code]["headers"] = {name: header}
    return responses


def _body(detail: str, errors: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    return {
        "detail": detail,
        "errors": [{"field": f, "message": m} for f, m in (errors or [])],
    }


def error_response(
    code: int, detail: str, errors: list[tuple[str, str]] | None = None
) -> JSONResponse:
    return JSONResponse(_body(detail, errors), status_code=code)


def _validation_errors(exc: RequestValidationError) -> list[tuple[str, str]]:
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith("function-after")]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            message = f"the body is not valid JSON ({err.get('ctx', {}).get('error', message)})"
            loc = []
        errors.append((".".join(loc), message))
    return errors


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _validation_errors(exc)
        detail = "; ".join(f"{f}: {m}" if f else m for f, m in errors) or "invalid request"
        return error_response(status.HTTP_422_UNPROCESSABLE_CONTENT, detail, errors)

    @app.exception_handler(SpecError)
    async def _spec(_: Request, exc: SpecError) -> JSONResponse:
        return error_response(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc), exc.errors)

    @app.exception_handler(JobNotFound)
    @app.exception_handler(SweepNotFound)
    @app.exception_handler(CheckpointNotFound)
    async def _missing(_: Request, exc: LookupError) -> JSONResponse:
        return error_response(status.HTTP_404_NOT_FOUND, str(exc))

    @app.exception_handler(JobConflict)
    @app.exception_handler(KeyConflict)
    @app.exception_handler(InvalidTransition)
    async def _conflict(_: Request, exc: Exception) -> JSONResponse:
        return error_response(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(sa.exc.OperationalError)
    @app.exception_handler(sa.exc.InterfaceError)
    async def _database_gone(request: Request, exc: Exception) -> JSONResponse:
        # The connection broke (a restart, a failover): the transaction was rolled back,
        # nothing was written. The client may repeat the request.
        log.warning("database unreachable on %s %s: %s", request.method, request.url.path, exc)
        response = error_response(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "the database is unreachable; nothing was changed, retry (a submission with the"
            " same Idempotency-Key creates at most one job)",
        )
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            status.HTTP_500_INTERNAL_SERVER_ERROR, "internal error; see the server log"
        )


class BodyLimit:
    """Refuse request bodies over their limit (``max_bytes``; ``larger`` ones for some paths)
    with 413, whether or not Content-Length is set.

    The body is read (up to the limit) before the app runs and then replayed to it, so an
    oversized upload is refused before any handler sees a byte of it.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        larger: Mapping[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app = app
        self.limits = {"": (max_bytes, "SHOAL_MAX_BODY_BYTES"), **(larger or {})}
        """Per path, the largest body and the setting that sets it (``""``: any other)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.limits.get(scope["path"]) or self.limits[""]
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit, setting)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # client went away; let the app see the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(scope, receive, send, limit, setting)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str
    ) -> None:
        response = error_response(
            status.HTTP_413_CONTENT_TOO_LARGE, f"request body over {limit} bytes ({setting})"
        )
        await response(scope, receive, send)
