"""jobs.block_costs (each block's traced cost) and jobs.stage_times (the latest step's)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("block_costs", sa.JSON(), nullable=True))
    op.add_column("jobs", sa.Column("stage_times", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "stage_times")
    op.drop_column("jobs", "block_costs")
