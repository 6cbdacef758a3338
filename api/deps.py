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
    session: Annotated[Session, Depends(get_session)],
) -> Principal:
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
