"""Engines, sessions and migrations: nothing is created until a caller asks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"


POOL: dict[str, Any] = {"pool_size": 20, "max_overflow": 20}
"""Connections kept open for the API's request threads (``Settings.api_threads``, 8 by
default) and the controller, and room for as many again (a request may hold two): a request
waits for a connection only while every thread holds its share, never for a thread that
waits for one."""


def make_engine(url: str) -> sa.Engine:
    """An engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        database = sa.engine.make_url(url).database
        if database and database != ":memory:":
            private_database(Path(database))
        pool = POOL if database and database != ":memory:" else {}
        engine = sa.create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, **pool
        )

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return sa.create_engine(url, pool_pre_ping=True, **POOL)


def private_database(path: Path) -> None:
    """Make the SQLite file (and its WAL and journal files) readable by this user only: it
    holds every spec and token hash. Its directory, if new, is made private too; SQLite
    creates the WAL and shared-memory files with the database's mode."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for sibling in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        if sibling.exists():
            sibling.chmod(0o600)  # one made by an older Shoal, or under a looser umask


SessionFactory = sessionmaker[Session]


def make_session_factory(engine: sa.Engine) -> SessionFactory:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: SessionFactory) -> Iterator[Session]:
    """A session whose work is committed on success and rolled back on any error."""
    with factory() as session, session.begin():
        yield session


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str) -> None:
    """Bring the database at ``url`` to the latest schema."""
    if url.startswith("sqlite"):
        make_engine(url).dispose()  # creates the parent directory
    command.upgrade(alembic_config(url), "head")
