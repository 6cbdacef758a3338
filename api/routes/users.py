"""``/api/v1/users``: users, their quotas and priority grants, and what they hold (admins
only)."""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from shoal.api.deps import FactoryDep, PrincipalDep, SettingsDep
from shoal.api.errors import documented
from shoal.api.responses import ModelJSON
from shoal.scheduler.placement import Quota, Usage
from shoal.service.auth import Principal
from shoal.service.db.models import User
from shoal.service.db.session import transaction
from shoal.service.holdings import max_priority, quotas, usage_by_owner
from shoal.service.settings import Settings

router = APIRouter(prefix="/users", tags=["users"])

UserName = Annotated[str, Path(max_length=64, pattern=r"^[a-z0-9][a-z0-9_.\-]{0,63}$")]


class QuotaIn(BaseModel):
    """A user's limits; null: the installation's default (SHOAL_USER_MAX_*, and for
    max_priority the default priority, 0)."""

    max_jobs: int | None = Field(None, ge=1, le=100_000)
    max_devices: int | None = Field(None, ge=1, le=1_000_000)
    max_priority: int | None = Field(
        None,
        ge=-100,  # a job's priority range (JobSpec.priority)
        le=100,
        description="the highest priority their jobs and sweeps may have (a higher priority"
        " preempts other users' jobs)",
    )


class CodeGrantIn(BaseModel):
    """Whether the user may send code of their own with jobs (it runs on the cluster)."""

    allowed: bool


class UserOut(BaseModel):
    name: str
    is_admin: bool
    may_upload_code: bool = Field(
        description="their own grant to send code with jobs (admins always may)"
    )
    max_jobs: int | None = Field(description="their own limit; null: the default")
    max_devices: int | None = Field(description="their own limit; null: the default")
    effective_max_jobs: int | None = Field(description="what applies; null: no limit")
    effective_max_devices: int | None = Field(description="what applies; null: no limit")
    max_priority: int | None = Field(description="their own grant; null: the default")
    effective_max_priority: int | None = Field(
        description="the highest priority they may submit; null: any (an admin)"
    )
    running_jobs: int
    held_devices: int


class UserList(BaseModel):
    items: list[UserOut]


def _admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "users and quotas need an admin token")


def _users(session: Session, settings: Settings, names: list[str] | None) -> list[UserOut]:
    default = Quota(settings.user_max_jobs, settings.user_max_devices)
    limits, usage = quotas(session, default), usage_by_owner(session)
    query = sa.select(User).order_by(User.name)
    if names is not None:
        query = query.where(User.name.in_(names))
    return [
        UserOut(
            name=user.name,
            is_admin=user.is_admin,
            may_upload_code=user.may_upload_code,
            max_jobs=user.max_jobs,
            max_devices=user.max_devices,
            effective_max_jobs=limits[user.name].max_jobs,
            effective_max_devices=limits[user.name].max_devices,
            max_priority=user.max_priority,
            effective_max_priority=max_priority(user),
            running_jobs=usage.get(user.name, Usage()).jobs,
            held_devices=usage.get(user.name, Usage()).devices,
        )
        for user in session.scalars(query)
    ]


@router.get("", response_model=UserList, responses=documented(401, 403, 503))
def list_users(principal: PrincipalDep, factory: FactoryDep, settings: SettingsDep) -> ModelJSON:
    """Every user with their quota (own and effective) and what they run now."""
    _admin(principal)
    with factory() as session:
        return ModelJSON(UserList(items=_users(session, settings, None)))


@router.put("/{name}/quota", responses=documented(400, 401, 403, 404, 413, 422, 503))
def set_quota(
    name: UserName,
    quota: QuotaIn,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
) -> UserOut:
    """Set a user's limits (null: back to the default); jobs already running go on, queued
    ones wait while the user is over them. ``max_priority`` bounds the priority of what they
    submit from now on."""
    _admin(principal)
    with transaction(factory) as session:
        user = _named(session, name)
        user.max_jobs, user.max_devices = quota.max_jobs, quota.max_devices
        user.max_priority = quota.max_priority
    with factory() as session:
        (out,) = _users(session, settings, [name])
    return out


@router.put("/{name}/code", responses=documented(400, 401, 403, 404, 413, 422, 503))
def set_code_grant(
    name: UserName,
    grant: CodeGrantIn,
    principal: PrincipalDep,
    factory: FactoryDep,
    settings: SettingsDep,
) -> UserOut:
    """Grant (``allowed: true``) or take away a user's permission to send code of their own
    with jobs: that code runs on the cluster's nodes. Jobs already accepted run on; a token
    is re-read within SHOAL_AUTH_CACHE_S."""
    _admin(principal)
    with transaction(factory) as session:
        _named(session, name).may_upload_code = grant.allowed
    with factory() as session:
        (out,) = _users(session, settings, [name])
    return out


def _named(session: Session, name: str) -> User:
    user = session.scalar(sa.select(User).where(User.name == name))
    if user is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no user {name!r}")
    return user
