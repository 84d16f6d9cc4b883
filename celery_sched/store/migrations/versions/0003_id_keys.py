"""Keys that are the job's id are not stored twice.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

A job scheduled without a key (the common case) has its id as its key. Until
this revision that key was also written as text into ``jobs.key``, whose
unique index then took a second B-tree entry for every row: on every insert
and on every status change, since no update of a job is HOT. Now such a job
stores NULL in ``jobs.key`` (readers present ``id::text``) and its
uniqueness is the primary key's; the unique index on ``key`` only holds the
keys callers chose (``WHERE key IS NOT NULL``).

Rows written before this revision keep their text keys; lookups match a key
either way, so nothing is rewritten. One case is not covered: a row from
before this revision whose caller-chosen key was a UUID's canonical text but
whose id differs (a key now always becomes the id) still answers to its key,
yet a new job with the same key would not be refused as its duplicate.

Replacing the unique constraint by the partial unique index reads the jobs
table once and blocks writes to it while it runs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    schema = _schema()
    op.alter_column("jobs", "key", nullable=True, schema=schema)
    # One transaction: no moment exists without a unique index on key.
    op.drop_constraint("jobs_key_key", "jobs", schema=schema, type_="unique")
    op.create_index(
        "jobs_key_key",
        "jobs",
        ["key"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("key IS NOT NULL"),
    )


def downgrade() -> None:
    schema = _schema()
    op.execute(sa.text(f'UPDATE "{schema}".jobs SET key = id::text WHERE key IS NULL'))
    op.drop_index("jobs_key_key", "jobs", schema=schema)
    op.create_unique_constraint("jobs_key_key", "jobs", ["key"], schema=schema)
    op.alter_column("jobs", "key", nullable=False, schema=schema)
