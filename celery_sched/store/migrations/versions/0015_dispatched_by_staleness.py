"""Dispatched jobs by when they go stale: ``jobs_dispatched_idx`` rebuilt.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07

``jobs_dispatched_idx`` was ``(dispatched_at) WHERE status = 'dispatched'``.
The reconciler's test, ``dispatched_at < now() - coalesce(visibility_timeout,
default)``, has a per-row bound the index cannot range over, so each pass
walked every dispatched row of every shard (twice: the requeue and the
untracked statements), even when none was stale: 140-165 ms per pass with
300,000 in flight, on the leader's loop. Untracked jobs stay dispatched for
their whole visibility timeout (0006), so that is 10,000 jobs/s x 30 s.

It becomes ``(shard, CAST(visibility_timeout IS NULL AS integer),
date_part('epoch', dispatched_at - epoch) + coalesce(visibility_timeout, 0))
WHERE status = 'dispatched'``: per shard, the jobs without a timeout of their
own in dispatch order, then those with one in the order they go stale, so
both kinds of stale rows are one index range each (see
``store/schema.py``, ``dispatched_keys``). Each dispatched row is still one
entry of one index (its key is 10 bytes wider). The start-up check for rows
in shards past the count (``shard >= n``) reads it by its first column.

Building it reads every partition (SHARE lock: writes to the jobs table wait
for it); the partial index itself holds only the jobs in flight.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_sched.store.postgres.partitioning import name_indexes

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None

_NEW = (
    "shard, CAST(visibility_timeout IS NULL AS integer), "
    "(date_part('epoch', dispatched_at - timestamptz '1970-01-01 00:00:00+00') "
    "+ coalesce(visibility_timeout, 0))"
)
_OLD = "dispatched_at"


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def _rebuild(columns: str) -> None:
    schema = _schema()
    conn = op.get_bind()
    conn.exec_driver_sql(f'DROP INDEX "{schema}".jobs_dispatched_idx')
    conn.exec_driver_sql(
        f'CREATE INDEX jobs_dispatched_idx ON "{schema}".jobs ({columns}) '
        "WHERE status = 'dispatched'"
    )
    # Each partition's index after the partitioned one, as partitions made
    # at run time are (PostgreSQL would name them after their columns).
    partitions = conn.execute(
        sa.text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:table AS regclass)"
        ),
        {"table": f'"{schema}".jobs'},
    ).scalars()
    for partition in list(partitions):
        name_indexes(conn, schema, partition)


def upgrade() -> None:
    _rebuild(_NEW)


def downgrade() -> None:
    _rebuild(_OLD)
