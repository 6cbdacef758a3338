"""The Alembic migrations produce exactly the schema of the models, on every backend."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from shoal.service.db.models import Base
from shoal.service.db.session import alembic_config, make_engine, migrate

pytestmark = pytest.mark.integration


def test_migrated_schema_matches_models(database_url: str) -> None:
    migrate(database_url)
    migrate(database_url)  # idempotent
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def revisions(url: str) -> list[str]:
    """Every migration, oldest first."""
    script = ScriptDirectory.from_config(alembic_config(url))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def test_each_migration_upgrades_its_predecessor_and_downgrades_back(
    empty_database_url: str,
) -> None:
    """From an empty database one revision at a time to the newest, then every downgrade
    back to empty and up again in one go: the schema ends exactly the models'."""
    url, config = empty_database_url, alembic_config(empty_database_url)
    migrate(url)  # creates SQLite's directory
    command.downgrade(config, "base")
    steps = revisions(url)
    assert steps[0] == "0001" and len(steps) >= 7
    engine = make_engine(url)
    try:
        for revision in steps:
            command.upgrade(config, revision)
            with engine.connect() as conn:
                assert MigrationContext.configure(conn).get_current_revision() == revision
        for _ in steps:
            command.downgrade(config, "-1")
        with engine.connect() as conn:
            assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
        command.upgrade(config, "head")
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def test_the_newest_migration_keeps_the_rows_of_the_one_before(empty_database_url: str) -> None:
    """A database in use at the previous revision: its users, jobs and events survive the
    upgrade, and the new columns (users' quotas) start empty."""
    url, config = empty_database_url, alembic_config(empty_database_url)
    migrate(url)
    previous = revisions(url)[-2]
    command.downgrade(config, previous)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO users (id, name, is_admin, created_at)"
                    " VALUES (1, 'alice', false, CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO jobs (id, name, owner_id, spec, state, priority,"
                    " cancel_requested, step, steps, num_blocks, last_loss, devices, partition,"
                    " attempt, runner_cursor, created_at, updated_at)"
                    " VALUES ('j1', 'kept', 1, '{}', 'RUNNING', 0, false, 7, 20, 3, 0.5, '[]',"
                    " '[]', 1, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO job_events (job_id, time, kind, message, data)"
                    " VALUES ('j1', CURRENT_TIMESTAMP, 'state', 'placed', '{}')"
                )
            )
        command.upgrade(config, "head")
        with engine.connect() as conn:
            row = conn.execute(sa.text("SELECT name, step, last_loss FROM jobs")).one()
            events = conn.execute(sa.text("SELECT kind, message FROM job_events")).all()
            user = conn.execute(sa.text("SELECT name, max_jobs, max_devices FROM users")).one()
        assert tuple(row) == ("kept", 7, 0.5) and tuple(user) == ("alice", None, None)
        assert [tuple(e) for e in events] == [("state", "placed")]
    finally:
        engine.dispose()
