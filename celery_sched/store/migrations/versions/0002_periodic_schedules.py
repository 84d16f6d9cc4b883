"""Periodic schedules: pause switch, change version, planner and history indexes.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

``schedules.paused`` is the user's pause switch, distinct from ``enabled``
(false only for static schedules removed from the code). ``schedules.version``
grows with every change, so a planner that read an older definition writes
nothing. ``schedules_plan_idx`` serves the planner's scan for schedules whose
next instant enters the horizon; ``jobs_schedule_due_idx`` finds a schedule's
next and latest occurrence without reading its history.

Creating ``jobs_schedule_due_idx`` reads the whole jobs table once (no row
qualifies before this revision, so it writes almost nothing) and blocks writes
to ``jobs`` while it runs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    schema = _schema()
    op.add_column(
        "schedules",
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.text("false")),
        schema=schema,
    )
    op.add_column(
        "schedules",
        sa.Column("version", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        schema=schema,
    )
    op.create_index(
        "schedules_plan_idx",
        "schedules",
        ["next_nominal_at", "id"],
        schema=schema,
        postgresql_where=sa.text("enabled AND NOT paused"),
    )
    op.create_index(
        "jobs_schedule_due_idx",
        "jobs",
        ["schedule_id", "due_at"],
        schema=schema,
        postgresql_where=sa.text("schedule_id IS NOT NULL"),
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_index("jobs_schedule_due_idx", table_name="jobs", schema=schema)
    op.drop_index("schedules_plan_idx", table_name="schedules", schema=schema)
    op.drop_column("schedules", "version", schema=schema)
    op.drop_column("schedules", "paused", schema=schema)
