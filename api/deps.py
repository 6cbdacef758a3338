"""Shared request dependencies: settings, the session factory, the authenticated principal.

They are ``async``: FastAPI runs a plain ``def`` dependency on a worker thread, a hand-off
that costs more than the work of these. What blocks (a token's first lookup) is handed to a
thread explicitly. Endpoints that use the database are plain ``def``s that open and close
their session themselves, so a pooled connection is held only while a request thread runs:
never while a request waits for a thread (a session from a dependency would be closed
after the endpoint, in another hand-off, and many waiting their turn to close would hold
every connection while the threads wait for one).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.types import Scope

from shoal.service.auth import Principal, PrincipalCache, authenticate
from shoal.service.code_checks import CodeChecks
from shoal.service.db.session import SessionFactory
from shoal.service.settings import Settings

# The largest integer a query parameter may bring (steps, event ids, offsets): steps and
# event ids are INTEGER columns, 32-bit on PostgreSQL, and a larger value would fail in the
# database driver (out of range; on SQLite past 64 bits) instead of answering 422.
MAX_QUERY_INT = 2**31 - 1
# Ids in paths are printable: a control character (PostgreSQL text refuses NUL) is a 422
# naming the parameter, not a database error.
ID_PATTERN = r"^[^\x00-\x1f\x7f]+$"

_bearer = HTTPBearer(auto_error=False, description="A Shoal token (`shoal token create`).")


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session_factory(request: Request) -> SessionFactory:
    factory: SessionFactory = request.app.state.session_factory
    return factory


def _lookup(factory: SessionFactory, token: str) -> Principal | None:
    with factory() as session:
        return authenticate(session, token)


_KNOWN = "shoal.principal"
"""The scope key of a request's looked-up token and principal: the rate limiter asks first,
and the endpoint's dependency reuses the answer instead of asking the database again."""


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer`` header, parsed as ``HTTPBearer`` does (the
    scheme in any case, spaces around the token ignored); None without one."""
    scheme, token = get_authorization_scheme_param(headers.get("authorization"))
    return token if scheme.lower() == "bearer" and token else None


async def lookup_token(factory: SessionFactory, token: str) -> Principal | None:
    """Whom ``token`` belongs to now, from the database (never the cache)."""
    return await run_in_threadpool(_lookup, factory, token)


async def principal_of(scope: Scope, token: str) -> Principal | None:
    """Whom ``token`` belongs to (None: unknown or revoked): from the app's ``PrincipalCache``
    or the database, once per request. A database error propagates."""
    known = scope.get(_KNOWN)
    if known is not None and known[0] == token:
        found: Principal | None = known[1]
        return found
    state = scope["app"].state
    cache: PrincipalCache = state.principals
    principal = cache.get(token)
    if principal is None:
        principal = await lookup_token(state.session_factory, token)
        if principal is not None:
            cache.put(token, principal)  # remembered from now on, not from its latest use
    scope[_KNOWN] = (token, principal)
    return principal


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller: from the app's ``PrincipalCache``, or looked up in a session of its own,
    closed before the endpoint runs (a request never holds one pooled connection while it
    waits for another)."""
    settings: Settings = request.app.state.settings
    if not settings.auth:
        anonymous: Principal = request.app.state.anonymous
        return anonymous
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token; send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = await principal_of(request.scope, credentials.credentials)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "invalid or revoked token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
FactoryDep = Annotated[SessionFactory, Depends(get_session_factory)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_code_permission(principal: Principal) -> None:
    """403 unless ``principal`` may send code of their own."""
    if not principal.can_upload_code:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"user {principal.name!r} lacks the code permission (uploading code runs it on the"
            " cluster); an admin grants it with `shoal token create --user"
            f" {principal.name} --code` or PUT /api/v1/users/{principal.name}/code",
        )


async def get_code_checks(request: Request) -> CodeChecks:
    checks: CodeChecks = request.app.state.code_checks
    return checks


CodeChecksDep = Annotated[CodeChecks, Depends(get_code_checks)]
