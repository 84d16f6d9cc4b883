"""Initial schema: jobs, schedules, ledger, leaders.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written out in full rather than generated from ``schema.build_metadata`` so
that later changes to the metadata cannot silently rewrite this revision; a
test checks that the migrated database matches the metadata.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_STATUSES = (
    "'pending', 'dispatched', 'running', 'retrying', 'succeeded', "
    "'failed', 'dead', 'cancelled', 'expired'"
)

# Why these values: see JOBS_STORAGE in celery_sched/store/schema.py.
_JOBS_STORAGE = {
    "fillfactor": "80",
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_limit": "2000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
}


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _ts(name: str, *, nullable: bool = True, now_default: bool = False) -> sa.Column[object]:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        nullable=nullable,
        server_default=sa.text("now()") if now_default else None,
    )


def upgrade() -> None:
    schema = _schema()
    op.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))

    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(as_uuid=True), primary_key=True),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("content_encoding", sa.Text, nullable=False),
        sa.Column("argsrepr", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("kwargsrepr", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column(
            "options",
            postgresql.JSONB,
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
        _ts("due_at", nullable=False),
        sa.Column("due_bucket", sa.Integer, nullable=False),
        _ts("expires_at"),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("attempt", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default=sa.text("5")),
        sa.Column("shard", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("schedule_id", sa.BigInteger, nullable=True),
        sa.Column("leader_epoch", sa.BigInteger, nullable=True),
        sa.Column("visibility_timeout", sa.Double, nullable=True),
        sa.Column("max_runtime", sa.Double, nullable=True),
        _ts("created_at", nullable=False, now_default=True),
        _ts("dispatched_at"),
        _ts("started_at"),
        _ts("finished_at"),
        sa.Column("worker", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.UniqueConstraint("key", name="jobs_key_key"),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name="jobs_status_check"),
        schema=schema,
        postgresql_with=_JOBS_STORAGE,
    )
    op.create_index(
        "jobs_pending_due_idx",
        "jobs",
        ["shard", "due_bucket", "due_at"],
        schema=schema,
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "jobs_dispatched_idx",
        "jobs",
        ["dispatched_at"],
        schema=schema,
        postgresql_where=sa.text("status = 'dispatched'"),
    )
    op.create_index(
        "jobs_running_idx",
        "jobs",
        ["started_at"],
        schema=schema,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index(
        "jobs_finished_idx",
        "jobs",
        ["finished_at"],
        schema=schema,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index(
        "jobs_schedule_idx",
        "jobs",
        ["schedule_id", "status"],
        schema=schema,
        postgresql_where=sa.text("schedule_id IS NOT NULL"),
    )

    op.create_table(
        "schedules",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("spec", postgresql.JSONB, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("content_encoding", sa.Text, nullable=False),
        sa.Column("argsrepr", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("kwargsrepr", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column(
            "options",
            postgresql.JSONB,
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
        sa.Column("timezone", sa.Text, nullable=False, server_default=sa.text("'UTC'")),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.text("true")),
        sa.Column("source", sa.Text, nullable=False, server_default=sa.text("'dynamic'")),
        sa.Column("misfire", sa.Text, nullable=True),
        sa.Column("overlap", sa.Text, nullable=True),
        sa.Column("catchup_window", sa.Double, nullable=True),
        sa.Column("max_catchup", sa.Integer, nullable=True),
        sa.Column("relative", sa.Boolean, nullable=False, server_default=sa.text("false")),
        _ts("last_nominal_at"),
        _ts("next_nominal_at"),
        _ts("created_at", nullable=False, now_default=True),
        _ts("updated_at", nullable=False, now_default=True),
        _ts("disabled_at"),
        sa.UniqueConstraint("name", name="schedules_name_key"),
        sa.CheckConstraint(
            "kind IN ('crontab', 'interval', 'solar', 'clocked')", name="schedules_kind_check"
        ),
        sa.CheckConstraint("source IN ('static', 'dynamic')", name="schedules_source_check"),
        schema=schema,
    )

    op.create_table(
        "ledger",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("job_id", sa.Uuid(as_uuid=True), nullable=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("owner", sa.Text, nullable=True),
        _ts("lease_expires_at"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("result", postgresql.JSONB, nullable=True),
        _ts("created_at", nullable=False, now_default=True),
        _ts("completed_at"),
        sa.CheckConstraint("state IN ('running', 'completed')", name="ledger_state_check"),
        schema=schema,
    )
    op.create_index("ledger_completed_idx", "ledger", ["completed_at"], schema=schema)

    op.create_table(
        "leaders",
        sa.Column("shard", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=True),
        _ts("acquired_at"),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    for table in ("leaders", "ledger", "schedules", "jobs"):
        op.drop_table(table, schema=schema)
