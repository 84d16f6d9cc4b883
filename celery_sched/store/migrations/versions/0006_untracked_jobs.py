"""Untracked jobs: status ``sent``, and the tasks each worker process tracks.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

- ``workers.tasks``: the task names whose jobs a worker process tracks
  (``tracking.install``), written with every heartbeat. NULL, as in the rows
  of workers of before, counts as every task.
- ``jobs.status`` may be ``sent``: a dispatched job whose task no worker
  tracks is not requeued by the reconciler (nothing would report that it
  ran, so a requeue could only run it twice); a visibility timeout after
  dispatch it becomes ``sent``, finished and prunable.

A nullable column and a CHECK constraint: nothing rewrites the jobs table; the
constraint reads it once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

_BEFORE = (
    "pending",
    "dispatched",
    "running",
    "retrying",
    "succeeded",
    "failed",
    "dead",
    "cancelled",
    "expired",
)


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _statuses(schema: str, statuses: tuple[str, ...]) -> None:
    listed = ", ".join(f"'{status}'" for status in statuses)
    op.drop_constraint("jobs_status_check", "jobs", schema=schema, type_="check")
    op.create_check_constraint("jobs_status_check", "jobs", f"status IN ({listed})", schema=schema)


def upgrade() -> None:
    schema = _schema()
    op.add_column(
        "workers", sa.Column("tasks", postgresql.ARRAY(sa.Text), nullable=True), schema=schema
    )
    _statuses(schema, (*_BEFORE, "sent"))


def downgrade() -> None:
    schema = _schema()
    # Fails, naming the constraint, while rows are `sent`: nothing is
    # rewritten silently.
    _statuses(schema, _BEFORE)
    op.drop_column("workers", "tasks", schema=schema)
