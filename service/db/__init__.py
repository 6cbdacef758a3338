"""Persistence: SQLAlchemy models, engine/session factories, Alembic migrations."""
