"""users.max_jobs and users.max_devices (per-user quotas an admin sets)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 22:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("users", sa.Column("max_jobs", sa.Integer(), nullable=True))
    op.add_column("users", sa.Column("max_devices", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("users", "max_devices")
    op.drop_column("users", "max_jobs")
