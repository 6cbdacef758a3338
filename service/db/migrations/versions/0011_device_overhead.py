"""devices.overhead_mb (what a device holds for a worker before its stage, as measured)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 08:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("devices", sa.Column("overhead_mb", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("devices", "overhead_mb")
