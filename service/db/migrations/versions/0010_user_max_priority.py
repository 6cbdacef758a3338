"""users.max_priority (the highest job priority an admin granted a user)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 11:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("users", sa.Column("max_priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("users", "max_priority")
