"""The SQLite database file is private to the service's user, from its first byte on."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from shoal.service.db.session import make_engine, migrate


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The usual 022: files readable by everyone unless made otherwise."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.unit
@pytest.mark.usefixtures("loose_umask")
def test_a_new_database_and_its_directory_are_private(tmp_path: Path) -> None:
    database = tmp_path / "home" / "shoal.db"
    url = f"sqlite:///{database}"
    migrate(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:  # WAL: the -wal and -shm files exist while connected
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS probe (x INTEGER)"))
            conn.execute(sa.text("INSERT INTO probe VALUES (1)"))
        files = sorted(p.name for p in database.parent.iterdir())
        assert {"shoal.db", "shoal.db-wal", "shoal.db-shm"} <= set(files), files
        assert {name: _mode(database.parent / name) for name in files} == dict.fromkeys(
            files, 0o600
        )
        assert _mode(database.parent) == 0o700
    finally:
        engine.dispose()


@pytest.mark.unit
@pytest.mark.usefixtures("loose_umask")
def test_a_database_left_readable_by_an_older_version_is_made_private(tmp_path: Path) -> None:
    database = tmp_path / "shoal.db"
    database.touch(mode=0o644)
    (tmp_path / "shoal.db-wal").touch(mode=0o644)
    make_engine(f"sqlite:///{database}").dispose()
    assert _mode(database) == 0o600 and _mode(tmp_path / "shoal.db-wal") == 0o600
