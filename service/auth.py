"""Users, bearer tokens and who may see what.

Tokens are random 256-bit secrets shown once; only their SHA-256 is stored. A user sees and
acts on their own jobs; an admin on every job. Someone else's job is reported as absent
(404), never as forbidden, so ids cannot be probed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.db.models import ApiToken, User, utcnow
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.settings import ADMIN_TOKEN_HINT, Settings

TOKEN_PREFIX = "shoal_"
ADMIN_USER = "admin"
_USER_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,63}\Z")


class AuthError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    user_id: int
    name: str
    is_admin: bool
    may_upload_code: bool = False

    @property
    def can_upload_code(self) -> bool:
        """Whether they may send code of their own with a job: an admin's grant (admins
        always may)."""
        return self.is_admin or self.may_upload_code


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _check_user_name(name: str) -> None:
    if not _USER_RE.match(name):
        raise AuthError(
            f"user name {name!r} is invalid; use 1-64 lower-case letters, digits, '_', '.', '-'"
        )


def _user(session: Session, user: str, *, admin: bool, code: bool = False) -> User:
    """``user``'s row, created if needed (``admin`` and ``code`` grant, never take away)."""
    _check_user_name(user)
    row = session.scalar(sa.select(User).where(User.name == user))
    if row is None:
        row = User(name=user, is_admin=admin, may_upload_code=code)
        session.add(row)
        session.flush()
    row.is_admin = row.is_admin or admin
    row.may_upload_code = row.may_upload_code or code
    return row


def issue_token(session: Session, user: str, *, admin: bool = False, code: bool = False) -> str:
    """Create ``user`` if needed and a new token for it; ``admin`` makes them an admin and
    ``code`` lets them upload code (each grants, never takes away)."""
    row = _user(session, user, admin=admin, code=code)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(user_id=row.id, token_hash=hash_token(token), prefix=token[:12]))
    return token


def register_admin_token(factory: SessionFactory, token: str) -> None:
    """Make ``token`` (one chosen outside Shoal, e.g. a Kubernetes Secret) a token of the admin
    user; idempotent. A token that was revoked stays revoked: that is an error to report."""
    with transaction(factory) as session:
        admin = _user(session, ADMIN_USER, admin=True)
        known = session.scalar(sa.select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
        if known is None:
            session.add(ApiToken(user_id=admin.id, token_hash=hash_token(token), prefix=token[:12]))
        elif known.revoked_at is not None or known.user_id != admin.id:
            raise AuthError(
                "SHOAL_ADMIN_TOKEN was revoked or belongs to another user; set a new one"
                f" ({ADMIN_TOKEN_HINT})"
            )


def create_token(
    factory: SessionFactory, *, user: str, admin: bool = False, code: bool = False
) -> str:
    with transaction(factory) as session:
        return issue_token(session, user, admin=admin, code=code)


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal a presented token belongs to, or None (unknown, revoked, malformed)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    digest = hash_token(token)
    row = session.execute(
        sa.select(ApiToken, User)
        .join(User, User.id == ApiToken.user_id)
        .where(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    api_token, user = row
    if not hmac.compare_digest(api_token.token_hash, digest):
        return None
    return Principal(
        user_id=user.id,
        name=user.name,
        is_admin=user.is_admin,
        may_upload_code=user.may_upload_code,
    )


class PrincipalCache:
    """Tokens authenticated in the last ``ttl_s`` seconds and whom they belong to, so a busy
    client's requests do not each look its token up: a token revoked (or a user promoted)
    elsewhere takes effect here within ``ttl_s``. Keyed by the token's hash, never the token;
    at most ``max_entries`` (the least recently used go first). Only known tokens are kept:
    an unknown one is looked up every time. Not thread-safe: one event loop uses it."""

    def __init__(
        self, ttl_s: float, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[Principal, float]] = OrderedDict()

    def get(self, token: str) -> Principal | None:
        digest = hash_token(token)
        entry = self._entries.get(digest)
        if entry is None:
            return None
        principal, expires = entry
        if self._clock() >= expires:
            del self._entries[digest]
            return None
        self._entries.move_to_end(digest)
        return principal

    def put(self, token: str, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        digest = hash_token(token)
        self._entries[digest] = (principal, self._clock() + self.ttl_s)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def revoke_token(factory: SessionFactory, token: str) -> bool:
    with transaction(factory) as session:
        row = session.scalar(sa.select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
        if row is None or row.revoked_at is not None:
            return False
        row.revoked_at = utcnow()
        return True


def write_secret(path: os.PathLike[str] | str, secret: str) -> None:
    """Write ``secret`` to ``path`` readable by the owner only (mode 0600), atomically."""
    target = os.fspath(path)
    os.makedirs(os.path.dirname(target) or ".", mode=0o700, exist_ok=True)
    temp = f"{target}.tmp-{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(temp, 0o600)
    os.replace(temp, target)


def ensure_admin_token(settings: Settings, factory: SessionFactory) -> str:
    """The admin token of this installation: ``SHOAL_ADMIN_TOKEN`` if set (registered as the
    admin's), else the stored one if still valid, else a new one; written to the admin token
    file either way (for the CLI on this machine)."""
    path = settings.admin_token_path
    if settings.admin_token is not None:
        token = settings.admin_token.get_secret_value()
        register_admin_token(factory, token)
        write_secret(path, token)
        return token
    if path.exists():
        existing = path.read_text().strip()
        with factory() as session:
            principal = authenticate(session, existing)
        if principal is not None and principal.is_admin:
            os.chmod(path, 0o600)
            return existing
    token = create_token(factory, user=ADMIN_USER, admin=True)
    write_secret(path, token)
    return token
