"""Dead jobs in due order: ``jobs_dead_idx``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05

- ``jobs_dead_idx (due_at, id) WHERE status = 'dead'``: ``sched dead`` pages
  through dead jobs in due order, and ``sched requeue --all-dead`` takes
  them a batch at a time, each page or batch an index range of its own
  size, however many finished jobs the table keeps.

Partial, so it costs the hot paths nothing: COPY writes pending rows and a
claim writes dispatched ones, neither of which takes an entry; a row enters
only when it dies. Building it reads the jobs table once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    op.create_index(
        "jobs_dead_idx",
        "jobs",
        ["due_at", "id"],
        schema=_schema(),
        postgresql_where=sa.text("status = 'dead'"),
    )


def downgrade() -> None:
    op.drop_index("jobs_dead_idx", table_name="jobs", schema=_schema())
