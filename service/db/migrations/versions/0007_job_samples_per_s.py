"""jobs.last_samples_per_s (the latest step's throughput, for the jobs table)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 22:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("last_samples_per_s", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "last_samples_per_s")
