"""Error responses: every failure is JSON ``{"detail", "errors"}``; no traceback leaves."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.jobs import JobConflict, JobNotFound
from service.lifecycle import InvalidTransition
from service.specs import SpecError
from service.sweeps import SweepNotFound

log = logging.getLogger(__name__)


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
    async def _missing(_: Request, exc: LookupError) -> JSONResponse:
        return error_response(status.HTTP_404_NOT_FOUND, str(exc))

    @app.exception_handler(JobConflict)
    @app.exception_handler(InvalidTransition)
    async def _conflict(_: Request, exc: Exception) -> JSONResponse:
        return error_response(status.HTTP_409_CONFLICT, str(exc))

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
    """Refuse request bodies over ``max_bytes`` with 413, whether or not Content-Length is set.

    The body is read (up to the limit) before the app runs and then replayed to it, so an
    oversized upload is refused before any handler sees a byte of it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # client went away; let the app see the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
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

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"request body over {self.max_bytes} bytes (SHOAL_MAX_BODY_BYTES)",
        )
        await response(scope, receive, send)
