"""Scratch PostgreSQL databases: one made on a server for a run (a benchmark, a test session)
and dropped after it."""

from __future__ import annotations

import re
import uuid

import sqlalchemy as sa

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
"""A scratch database's name: an identifier (SQL cannot bind one), so nothing else is let in."""


def _checked(name: str | None) -> str:
    if name is None or not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a scratch database's name (lowercase identifier)")
    return name


def _server(server_url: str) -> sa.Engine:
    return sa.create_engine(server_url, isolation_level="AUTOCOMMIT")


def create_database(server_url: str, prefix: str) -> str:
    """A new, empty database named ``prefix`` and a random suffix, on the PostgreSQL server
    that ``server_url`` (any of its databases) reaches; its URL. Raises
    ``sqlalchemy.exc.OperationalError`` when the server cannot be reached."""
    name = _checked(f"{prefix}_{uuid.uuid4().hex[:10]}")
    server = _server(server_url)
    try:
        with server.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        server.dispose()
    return sa.engine.make_url(server_url).set(database=name).render_as_string(False)


def drop_database(server_url: str, url: str) -> None:
    """Drop the database at ``url`` (made by ``create_database`` on ``server_url``'s server),
    ending every connection to it first."""
    name = _checked(sa.engine.make_url(url).database)
    server = _server(server_url)
    try:
        with server.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        server.dispose()
