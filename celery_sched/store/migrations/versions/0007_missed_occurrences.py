"""Missed occurrences: status ``missed``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

- ``jobs.status`` may be ``missed``: an occurrence of a schedule that was
  materialized ahead of time and, at its first dispatch, was late by more
  than the misfire grace, and that the schedule's misfire policy does not
  run (``skip``; ``once`` when a later occurrence was missed too; ``all``
  outside the catch-up window or past ``max_catchup``). It was never sent;
  it is finished and prunable.

A CHECK constraint only: nothing rewrites the jobs table; the constraint
reads it once.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0007"
down_revision: str | None = "0006"
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
    "sent",
)


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _statuses(schema: str, statuses: tuple[str, ...]) -> None:
    listed = ", ".join(f"'{status}'" for status in statuses)
    op.drop_constraint("jobs_status_check", "jobs", schema=schema, type_="check")
    op.create_check_constraint("jobs_status_check", "jobs", f"status IN ({listed})", schema=schema)


def upgrade() -> None:
    _statuses(_schema(), (*_BEFORE, "missed"))


def downgrade() -> None:
    # Fails, naming the constraint, while rows are `missed`: nothing is
    # rewritten silently.
    _statuses(_schema(), _BEFORE)
