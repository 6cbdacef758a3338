"""The Alembic migrations produce exactly the schema of the models, on every backend."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service.db.models import Base
from service.db.session import make_engine, migrate

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
