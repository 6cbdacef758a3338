"""Alembic environment: migrates the URL given in the config (online mode only)."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from shoal.service.db.models import Base

config = context.config
connectable = engine_from_config(
    config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
)
with connectable.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
connectable.dispose()
