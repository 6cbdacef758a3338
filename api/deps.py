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

from service.auth import Principal, PrincipalCache, authenticate
from service.db.session import SessionFactory
from service.settings import Settings

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


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    factory: Annotated[SessionFactory, Depends(get_session_factory)],
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
    cache: PrincipalCache = request.app.state.principals
    token = credentials.credentials
    principal = cache.get(token)
    if principal is None:
        principal = await run_in_threadpool(_lookup, factory, token)
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "invalid or revoked token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        cache.put(token, principal)  # remembered from now on, not from its latest use
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
FactoryDep = Annotated[SessionFactory, Depends(get_session_factory)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
