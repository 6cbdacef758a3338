"""devices.draining (an admin or a preemption notice asked jobs to leave the device)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 08:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "devices",
        sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("devices", "draining")
