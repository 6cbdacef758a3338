"""Submissions made at most once per (owner, ``Idempotency-Key``): jobs and sweeps alike.

A client that retries a submission (a timeout, a dropped connection) sends the same key and
gets the row the first attempt made, never a second one; the same key with another spec is
a conflict. Two concurrent requests with one key race on the table's unique constraint
(owner, key): the loser reads the winner's row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shoal.service.db.session import SessionFactory, transaction


class KeyConflict(ValueError):
    """The key was already used for a different spec."""


class _Submitted(Protocol):
    @property
    def spec(self) -> dict[str, Any]: ...


Row = TypeVar("Row", bound=_Submitted)


def create_once(
    factory: SessionFactory,
    key: str | None,
    find: Callable[[Session, str], Row | None],
    add: Callable[[Session], Row],
    spec: dict[str, Any],
    what: str,
) -> tuple[Row, bool]:
    """``add`` a row in a transaction of its own, unless ``find`` (the owner's row with
    ``key``) gives one: then that one, if its spec is ``spec``. Returns (row, created)."""
    if key is not None:
        with factory() as session:
            existing = find(session, key)
        if existing is not None:
            return _same(existing, spec, what), False
    try:
        with transaction(factory) as session:
            row = add(session)
        return row, True
    except IntegrityError:
        if key is None:
            raise
        with factory() as session:  # a concurrent request with the same key won the race
            existing = find(session, key)
        if existing is None:
            raise
        return _same(existing, spec, what), False


def _same(row: Row, spec: dict[str, Any], what: str) -> Row:
    if row.spec != spec:
        raise KeyConflict(
            f"this Idempotency-Key was already used for a different {what} spec; use a new key"
        )
    return row
