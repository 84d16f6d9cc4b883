"""Custom schedules: ``schedules.kind`` may be ``custom``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

A custom schedule class (any object beat drives through ``is_due``) lives in
the code; its row records the class and repr (``spec``) and the planner
evaluates the object. Only the kind's CHECK constraint changes; it reads the
schedules table once.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _kinds(schema: str, kinds: str) -> None:
    op.drop_constraint("schedules_kind_check", "schedules", schema=schema, type_="check")
    op.create_check_constraint(
        "schedules_kind_check", "schedules", f"kind IN ({kinds})", schema=schema
    )


def upgrade() -> None:
    _kinds(_schema(), "'crontab', 'interval', 'solar', 'clocked', 'custom'")


def downgrade() -> None:
    # A stored custom row would violate the old constraint: disable nothing
    # silently, let the constraint creation fail and name the rows' kind.
    _kinds(_schema(), "'crontab', 'interval', 'solar', 'clocked'")
