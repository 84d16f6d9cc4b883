"""Failed and dead jobs by when they finished: ``jobs_failed_idx``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

- ``jobs_failed_idx (finished_at) WHERE status IN ('failed', 'dead')``: the
  web console's overview lists the most recent failures, newest first. The
  general ``jobs_finished_idx`` holds every finished job, so reading it
  backwards for the few that failed can walk a day of successes; this one
  holds only the failures.

Rows enter it only when they fail or die, so inserts, claims and successes
pay nothing. Building it reads the jobs table once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    op.create_index(
        "jobs_failed_idx",
        "jobs",
        ["finished_at"],
        schema=_schema(),
        postgresql_where=sa.text("status IN ('failed', 'dead')"),
    )


def downgrade() -> None:
    op.drop_index("jobs_failed_idx", table_name="jobs", schema=_schema())
