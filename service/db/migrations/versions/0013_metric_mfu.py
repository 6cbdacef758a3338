"""job_metrics.mfu and jobs.last_mfu (model FLOPs utilization per step, and the latest)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 06:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job_metrics", sa.Column("mfu", sa.Double(), nullable=True))
    op.add_column("jobs", sa.Column("last_mfu", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "last_mfu")
    op.drop_column("job_metrics", "mfu")
