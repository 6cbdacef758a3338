"""Tokens: hashed at rest, revocable, admin token file kept private and reused."""

from __future__ import annotations

import hashlib
import hmac
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from shoal.api.app import create_app
from shoal.service import auth
from shoal.service.auth import (
    AuthError,
    Principal,
    PrincipalCache,
    authenticate,
    create_token,
    ensure_admin_token,
    hash_token,
    revoke_token,
)
from shoal.service.db.models import ApiToken
from shoal.service.db.session import SessionFactory
from shoal.service.settings import Settings

pytestmark = pytest.mark.integration


def test_tokens_are_stored_hashed_and_authenticate(session_factory: SessionFactory) -> None:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        stored = session.scalars(sa.select(ApiToken.token_hash)).all()
        assert stored == [hash_token(token)] and token not in stored
        principal = authenticate(session, token)
    assert principal is not None and principal.name == "alice" and not principal.is_admin


def test_a_tokens_stored_hash_is_the_sha256_hex_digest_of_the_token(
    session_factory: SessionFactory,
) -> None:
    token = create_token(session_factory, user="alice")
    with session_factory() as session:
        stored = session.scalars(sa.select(ApiToken.token_hash)).all()
    assert stored == [hashlib.sha256(token.encode()).hexdigest()], (token, stored)


def test_a_presented_token_is_compared_with_the_stored_hash_in_constant_time(
    session_factory: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``authenticate`` decides by ``hmac.compare_digest`` of the stored hash and the
    presented token's: the hash it finds is accepted only if that comparison says so."""
    token = create_token(session_factory, user="alice")
    digest = hashlib.sha256(token.encode()).hexdigest()
    compared: list[tuple[object, object]] = []
    verdict: list[bool] = []

    def compare_digest(a: str, b: str) -> bool:
        compared.append((a, b))
        return verdict[-1] if verdict else hmac.compare_digest(a, b)

    monkeypatch.setattr(auth, "hmac", SimpleNamespace(compare_digest=compare_digest))
    with session_factory() as session:
        principal = authenticate(session, token)
        assert principal is not None and principal.name == "alice", principal
        assert compared == [(digest, digest)], compared
        verdict.append(False)  # the comparison, not the lookup alone, decides
        assert authenticate(session, token) is None, compared


def test_every_api_process_remembers_a_token_for_the_auth_cache_time_5_s_by_default(
    session_factory: SessionFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A revoked token is refused within ``SHOAL_AUTH_CACHE_S``: the time each API process's
    app keeps whom a token belongs to, 5 s unless set."""
    monkeypatch.delenv("SHOAL_AUTH_CACHE_S", raising=False)
    settings = Settings(home=tmp_path, database_url="unused://")
    app = create_app(settings, session_factory)
    assert (settings.auth_cache_s, app.state.principals.ttl_s) == (5.0, 5.0), settings


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


def test_the_code_permission_is_granted_never_taken_by_a_token_and_admins_have_it(
    session_factory: SessionFactory,
) -> None:
    plain = create_token(session_factory, user="carol")
    granted = create_token(session_factory, user="carol", code=True)
    later = create_token(session_factory, user="carol")
    admin = create_token(session_factory, user="root", admin=True)
    with session_factory() as session:
        before = authenticate(session, plain)
        assert before is not None and before.may_upload_code and before.can_upload_code
        for token in (granted, later):
            principal = authenticate(session, token)
            assert principal is not None and principal.can_upload_code and not principal.is_admin
        root = authenticate(session, admin)
        assert root is not None and root.can_upload_code and not root.may_upload_code
    dave = create_token(session_factory, user="dave")
    with session_factory() as session:
        principal = authenticate(session, dave)
        assert principal is not None and not principal.can_upload_code


@pytest.mark.parametrize("name", ["Robert'); DROP TABLE users;--", "alice\n", "", "a" * 65])
def test_bad_user_names_are_refused(session_factory: SessionFactory, name: str) -> None:
    with pytest.raises(AuthError, match="user name"):
        create_token(session_factory, user=name)


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


def test_an_admin_token_chosen_outside_is_registered_once_and_never_revived(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    chosen = "shoal_" + "k" * 40
    settings = Settings(home=tmp_path / "home", admin_token=chosen)
    assert ensure_admin_token(settings, session_factory) == chosen
    assert ensure_admin_token(settings, session_factory) == chosen  # a restart: idempotent
    with session_factory() as session:
        principal = authenticate(session, chosen)
        assert principal is not None and principal.is_admin and principal.name == "admin"
        assert session.scalar(sa.select(sa.func.count()).select_from(ApiToken)) == 1
    assert settings.admin_token_path.read_text().strip() == chosen
    revoke_token(session_factory, chosen)
    with pytest.raises(AuthError, match="revoked"):
        ensure_admin_token(settings, session_factory)


def test_an_empty_admin_token_is_unset() -> None:
    assert Settings(admin_token="").admin_token is None


@pytest.mark.parametrize("token", ["too-short", "shoal_short", "x" * 50])
def test_an_admin_token_of_the_wrong_shape_is_refused_with_how_to_make_one(token: str) -> None:
    with pytest.raises(ValidationError, match=r"secrets\.token_urlsafe"):
        Settings(admin_token=token)


def test_the_principal_cache_forgets_a_token_its_ttl_after_the_lookup() -> None:
    now = [0.0]
    cache = PrincipalCache(5.0, clock=lambda: now[0])
    alice = Principal(user_id=1, name="alice", is_admin=False)
    assert cache.get("shoal_a") is None
    cache.put("shoal_a", alice)
    now[0] = 4.9
    assert cache.get("shoal_a") == alice  # a hit does not extend its time
    assert cache.get("shoal_b") is None
    now[0] = 5.0
    assert cache.get("shoal_a") is None


def test_the_principal_cache_is_bounded_and_off_at_zero() -> None:
    cache = PrincipalCache(60.0, max_entries=2)
    users = [Principal(user_id=i, name=f"u{i}", is_admin=False) for i in range(3)]
    cache.put("shoal_0", users[0])
    cache.put("shoal_1", users[1])
    assert cache.get("shoal_0") == users[0]  # now the most recently used
    cache.put("shoal_2", users[2])
    assert [cache.get(f"shoal_{i}") for i in range(3)] == [users[0], None, users[2]]
    off = PrincipalCache(0.0)
    off.put("shoal_0", users[0])
    assert off.get("shoal_0") is None
