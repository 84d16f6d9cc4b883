"""Hardening: worker heartbeats, the pid of a running job, broken schedules, enum checks.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

- ``workers``: one row per worker process, keyed by ``(hostname, pid)`` (a
  prefork pool's children share one hostname), whose ``seen_at`` the
  process's status writer refreshes. The leader's rescuer acts on running
  jobs whose process stopped beating.
- ``jobs.worker_pid``: the process a ``running`` job runs in, with
  ``jobs.worker`` (its hostname).
- ``schedules.broken_at`` / ``broken_reason``: a schedule the planner cannot
  plan is set aside with its reason instead of failing every pass; the
  planner's index leaves broken schedules out.
- ``jobs_retrying_idx``: retrying jobs by shard and by when their retry is
  due (``dispatched_at``; small, partial), so the start-up check for rows in
  shards that no longer exist reads no big index, and the reconciler finds
  retries that never started (their message was lost) without a scan.
- CHECK constraints on the enum-like text columns of ``schedules``
  (``misfire``, ``overlap``); ``jobs.status``, ``schedules.kind`` and
  ``ledger.state`` already have theirs.

Every change adds a nullable column, a small table, a constraint or a small
partial index: nothing rewrites the jobs table. The CHECK constraints read the
schedules table once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    schema = _schema()
    op.add_column("jobs", sa.Column("worker_pid", sa.Integer, nullable=True), schema=schema)
    op.add_column(
        "schedules",
        sa.Column("broken_at", sa.DateTime(timezone=True), nullable=True),
        schema=schema,
    )
    op.add_column("schedules", sa.Column("broken_reason", sa.Text, nullable=True), schema=schema)
    op.create_check_constraint(
        "schedules_misfire_check",
        "schedules",
        "misfire IN ('skip', 'once', 'all')",
        schema=schema,
    )
    op.create_check_constraint(
        "schedules_overlap_check", "schedules", "overlap IN ('allow', 'skip')", schema=schema
    )
    op.drop_index("schedules_plan_idx", table_name="schedules", schema=schema)
    op.create_index(
        "schedules_plan_idx",
        "schedules",
        ["next_nominal_at", "id"],
        schema=schema,
        postgresql_where=sa.text("enabled AND NOT paused AND broken_at IS NULL"),
    )
    # Beat's start-up check for rows in shards a lowered shard count left
    # behind reads retrying jobs by this instead of scanning the table; the
    # reconciler reads a shard's retries in due order (dispatched_at).
    op.create_index(
        "jobs_retrying_idx",
        "jobs",
        ["shard", "dispatched_at"],
        schema=schema,
        postgresql_where=sa.text("status = 'retrying'"),
    )
    op.create_table(
        "workers",
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.PrimaryKeyConstraint("hostname", "pid", name="workers_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_table("workers", schema=schema)
    op.drop_index("jobs_retrying_idx", table_name="jobs", schema=schema)
    op.drop_index("schedules_plan_idx", table_name="schedules", schema=schema)
    op.create_index(
        "schedules_plan_idx",
        "schedules",
        ["next_nominal_at", "id"],
        schema=schema,
        postgresql_where=sa.text("enabled AND NOT paused"),
    )
    op.drop_constraint("schedules_overlap_check", "schedules", schema=schema, type_="check")
    op.drop_constraint("schedules_misfire_check", "schedules", schema=schema, type_="check")
    op.drop_column("schedules", "broken_reason", schema=schema)
    op.drop_column("schedules", "broken_at", schema=schema)
    op.drop_column("jobs", "worker_pid", schema=schema)
