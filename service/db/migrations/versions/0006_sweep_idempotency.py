"""sweeps.idempotency_key (a retried submission returns the first sweep)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 19:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sweeps", sa.Column("idempotency_key", sa.String(length=200), nullable=True))
    op.create_index(
        "uq_sweeps_owner_idempotency", "sweeps", ["owner_id", "idempotency_key"], unique=True
    )


def downgrade() -> None:
    op.drop_index("uq_sweeps_owner_idempotency", table_name="sweeps")
    op.drop_column("sweeps", "idempotency_key")
