"""Tokens: hashed at rest, revocable, admin token file kept private and reused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.auth import (
    AuthError,
    authenticate,
    create_token,
    ensure_admin_token,
    hash_token,
    revoke_token,
)
from service.db.models import ApiToken
from service.db.session import SessionFactory
from service.settings import Settings

pytestmark = pytest.mark.integration


def test_tokens_are_stored_hashed_and_authenticate(session_factory: SessionFactory) -> None:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        stored = session.scalars(sa.select(ApiToken.token_hash)).all()
        assert stored == [hash_token(token)] and token not in stored
        principal = authenticate(session, token)
    assert principal is not None and principal.name == "alice" and not principal.is_admin


def test_wrong_and_revoked_tokens_fail(session_factory: SessionFactory) -> None:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        assert authenticate(session, token + "x") is None
        assert authenticate(session, "not-a-shoal-token") is None
    assert revoke_token(session_factory, token)
    assert not revoke_token(session_factory, token)
    with session_factory() as session:
        assert authenticate(session, token) is None


def test_admin_flag_promotes_never_demotes(session_factory: SessionFactory) -> None:
    create_token(session_factory, user="bob")
    admin_token = create_token(session_factory, user="bob", admin=True)
    later = create_token(session_factory, user="bob")
    with session_factory() as session:
        for token in (admin_token, later):
            principal = authenticate(session, token)
            assert principal is not None and principal.is_admin


def test_bad_user_names_are_refused(session_factory: SessionFactory) -> None:
    with pytest.raises(AuthError, match="user name"):
        create_token(session_factory, user="Robert'); DROP TABLE users;--")


def test_admin_token_file_is_private_and_reused(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path / "home")
    token = ensure_admin_token(settings, session_factory)
    path = settings.admin_token_path
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_admin_token(settings, session_factory) == token
    revoke_token(session_factory, token)
    fresh = ensure_admin_token(settings, session_factory)
    assert fresh != token and path.read_text().strip() == fresh
