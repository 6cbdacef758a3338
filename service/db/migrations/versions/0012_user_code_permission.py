"""users.may_upload_code (an admin's grant to send code of one's own with jobs)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 03:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "users",
        sa.Column("may_upload_code", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("users", "may_upload_code")
