"""sweeps and their trials; jobs.pool (the sweep whose SHARP executor trains the job)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 16:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("owner_id", sa.Integer(), sa.ForeignKey("users.id"), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("max_trials", sa.Integer(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_sweeps_owner_id", "sweeps", ["owner_id"])
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "trials",
        sa.Column(
            "sweep_id",
            sa.String(32),
            sa.ForeignKey("sweeps.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, unique=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("intermediate", sa.JSON(), nullable=False),
        sa.Column("objective", sa.Double(), nullable=True),
        sa.Column("pruned", sa.Boolean(), nullable=False),
        sa.Column("told", sa.Boolean(), nullable=False),
        sa.Column("checkpoints_dropped", sa.Boolean(), nullable=False),
    )


    op.add_column("jobs", sa.Column("pool", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "pool")
    op.drop_table("trials")
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_index("ix_sweeps_owner_id", table_name="sweeps")
    op.drop_table("sweeps")
