"""devices.drain_reason (why a device is draining: an admin, its node's preemption notice,
or a worker that failed on it)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 08:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("devices", sa.Column("drain_reason", sa.String(500), nullable=True))


def downgrade() -> None:
    op.drop_column("devices", "drain_reason")
