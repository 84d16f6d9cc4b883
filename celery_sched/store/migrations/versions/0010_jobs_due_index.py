"""Every job in due order: ``jobs_due_idx``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05

- ``jobs_due_idx (due_at, id)``: the web console's jobs list (and ``sched
  jobs``) pages every job, or those of a task or a due range, in
  ``(due_at, id)`` order by keyset. Without it each page sorts the whole
  table (290 ms at 1M rows, seconds at 10M); with it a page is an index
  range of its own size, a task's page a filtered walk of it.

Not partial, so every inserted job takes one more index entry (measure with
``benchmarks/index_ab.py --index jobs_due_idx``); claims and other status
changes leave it alone, as they never change ``due_at`` or ``id``. Building
it reads the jobs table once.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    op.create_index("jobs_due_idx", "jobs", ["due_at", "id"], schema=_schema())


def downgrade() -> None:
    op.drop_index("jobs_due_idx", table_name="jobs", schema=_schema())
