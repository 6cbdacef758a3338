"""Shared request dependencies: settings, database sessions, the authenticated principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.auth import Principal, authenticate
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


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session_factory(request: Request) -> SessionFactory:
    factory: SessionFactory = request.app.state.session_factory
    return factory


def get_session(
    factory: Annotated[SessionFactory, Depends(get_session_factory)],
) -> Iterator[Session]:
    with factory() as session:
        yield session


def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    factory: Annotated[SessionFactory, Depends(get_session_factory)],
) -> Principal:
    """The caller, authenticated in a session of its own, closed before the endpoint runs:
    a request never holds one pooled connection while it waits for another."""
    settings = get_settings(request)
    if not settings.auth:
        anonymous: Principal = request.app.state.anonymous
        return anonymous
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token; send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    with factory() as session:
        principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "invalid or revoked token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
FactoryDep = Annotated[SessionFactory, Depends(get_session_factory)]
SessionDep = Annotated[Session, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
