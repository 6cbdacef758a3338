"""job_metrics.grad_norm (the step's gradient norm before clipping)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 08:05:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job_metrics", sa.Column("grad_norm", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("job_metrics", "grad_norm")
