"""``jobs`` range-partitioned by due time; caller keys unique in ``job_keys``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

- ``jobs`` becomes ``PARTITION BY RANGE (due_at)``: a partition per UTC day
  within 31 days of now, per month within a year, per year beyond
  (``celery_sched/store/partitions.py``); no DEFAULT partition. The primary
  key becomes ``(id, due_at)`` (a unique index of a partitioned table must
  hold the partition key); every other index is kept, partitioned, except
  the unique ``jobs_key_key``, now the plain ``jobs_key_idx``.
- ``job_keys (key PRIMARY KEY, job_id)``: every stored caller-chosen key,
  unique across all partitions (``DuplicateJob``, ``if_exists``, occurrence
  keys).

Not online: the old table is renamed, its rows copied into the partitions
(then its indexes are built per partition), and it is dropped, all in the
migration's one transaction, which holds an ACCESS EXCLUSIVE lock on the
jobs throughout. Stop the beats first; it takes about 6 s per million
stored jobs on the development machine (README, "Storage that stays flat").
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import context, op

from celery_sched.store.partitions import PartitionRange, ranges_for
from celery_sched.store.postgres.partitioning import name_indexes

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None

# Why these values: see JOBS_STORAGE in celery_sched/store/schema.py (frozen here).
_STORAGE = (
    "fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01, "
    "autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, "
    "autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_insert_scale_factor = 0.05"
)
_OLD = "jobs_unpartitioned"


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _literal(at: dt.datetime) -> str:
    return f"'{at.astimezone(dt.UTC).isoformat()}'"


def _index_definitions(conn: sa.Connection, schema: str, table: str) -> list[tuple[str, str]]:
    rows = conn.execute(
        sa.text(
            "SELECT indexname, indexdef FROM pg_indexes "
            "WHERE schemaname = :schema AND tablename = :table ORDER BY indexname"
        ),
        {"schema": schema, "table": table},
    )
    return [(name, definition) for name, definition in rows]


def _partition(conn: sa.Connection, schema: str, rng: PartitionRange) -> None:
    conn.exec_driver_sql(
        f'CREATE TABLE "{schema}"."{rng.name}" PARTITION OF "{schema}".jobs '
        f"FOR VALUES FROM ({_literal(rng.lower)}) TO ({_literal(rng.upper)}) "
        f"WITH ({_STORAGE})"
    )


def _set_aside(conn: sa.Connection, schema: str, aside: str, layout: str) -> list[tuple[str, str]]:
    """Rename ``jobs`` (and its indexes) to ``aside`` and create an empty
    ``jobs`` like it (``layout``: what follows the column list); return the
    definitions of the old indexes, to build them again on the new table."""
    definitions = _index_definitions(conn, schema, "jobs")
    conn.exec_driver_sql(f'ALTER TABLE "{schema}".jobs RENAME TO {aside}')
    for name, _ in definitions:
        conn.exec_driver_sql(f'ALTER INDEX "{schema}"."{name}" RENAME TO "{name}_old"')
    conn.exec_driver_sql(
        f'CREATE TABLE "{schema}".jobs (LIKE "{schema}".{aside} '
        f"INCLUDING DEFAULTS INCLUDING CONSTRAINTS) {layout}"
    )
    return definitions


def upgrade() -> None:
    schema = _schema()
    conn = op.get_bind()
    definitions = _set_aside(conn, schema, _OLD, "PARTITION BY RANGE (due_at)")

    # A partition for every day a stored job is due (the leader and the
    # inserts create the others as they need them).
    now = conn.execute(sa.text("SELECT now()")).scalar_one()
    days = conn.execute(
        sa.text(f"SELECT DISTINCT date_trunc('day', due_at, 'UTC') FROM \"{schema}\".{_OLD}")
    ).scalars()
    ranges = ranges_for(days, now)
    for rng in ranges:
        _partition(conn, schema, rng)

    # Rows first, indexes after: one sorted build per partition and index
    # instead of an index insert per row.
    conn.exec_driver_sql(f'INSERT INTO "{schema}".jobs SELECT * FROM "{schema}".{_OLD}')
    conn.exec_driver_sql(
        f'ALTER TABLE "{schema}".jobs ADD CONSTRAINT jobs_pkey PRIMARY KEY (id, due_at)'
    )
    for name, definition in definitions:
        if name in {"jobs_pkey", "jobs_key_key"}:
            continue
        conn.exec_driver_sql(definition)
    conn.exec_driver_sql(
        f'CREATE INDEX jobs_key_idx ON "{schema}".jobs (key) WHERE key IS NOT NULL'
    )
    for rng in ranges:
        name_indexes(conn, schema, rng.name)

    conn.exec_driver_sql(
        f'CREATE TABLE "{schema}".job_keys (key text PRIMARY KEY, job_id uuid NOT NULL)'
    )
    conn.exec_driver_sql(
        f'INSERT INTO "{schema}".job_keys (key, job_id) '
        f'SELECT key, id FROM "{schema}".{_OLD} WHERE key IS NOT NULL'
    )
    conn.exec_driver_sql(f'DROP TABLE "{schema}".{_OLD}')
    conn.exec_driver_sql(f'ANALYZE "{schema}".jobs')


def downgrade() -> None:
    schema = _schema()
    conn = op.get_bind()
    definitions = _set_aside(conn, schema, "jobs_partitioned", f"WITH ({_STORAGE})")
    conn.exec_driver_sql(f'INSERT INTO "{schema}".jobs SELECT * FROM "{schema}".jobs_partitioned')
    conn.exec_driver_sql(f'ALTER TABLE "{schema}".jobs ADD PRIMARY KEY (id)')
    for name, definition in definitions:
        if name in {"jobs_pkey", "jobs_key_idx"}:
            continue
        conn.exec_driver_sql(definition.replace(" ON ONLY ", " ON "))
    conn.exec_driver_sql(
        f'CREATE UNIQUE INDEX jobs_key_key ON "{schema}".jobs (key) WHERE key IS NOT NULL'
    )
    conn.exec_driver_sql(f'DROP TABLE "{schema}".jobs_partitioned CASCADE')
    conn.exec_driver_sql(f'DROP TABLE "{schema}".job_keys')
