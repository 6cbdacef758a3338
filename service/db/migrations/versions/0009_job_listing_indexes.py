"""jobs listed newest first, everyone's or one owner's, read from an index instead of sorted

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 02:00:00
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_created", "jobs", ["created_at", "id"])
    op.create_index("ix_jobs_owner_created", "jobs", ["owner_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_created", table_name="jobs")
    op.drop_index("ix_jobs_created", table_name="jobs")
