"""Alembic environment of celery_sched, driven only programmatically.

:meth:`celery_sched.store.postgres.PostgresJobStore.migrate` builds the Alembic
config in code and passes an open connection (``connection``) and the target
Postgres schema (``schema``) through ``config.attributes``; there is no
alembic.ini.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from celery_sched.store.schema import build_metadata


def run_migrations_online() -> None:
    config = context.config
    connection: Connection | None = config.attributes.get("connection")
    schema: str | None = config.attributes.get("schema")
    if connection is None or schema is None:
        raise RuntimeError(
            "celery_sched migrations run through PostgresJobStore.migrate(), "
            "not the alembic command line"
        )
    # Alembic creates its version table before running the first migration,
    # and that table lives in our schema, so the schema must exist first.
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    context.configure(
        connection=connection,
        target_metadata=build_metadata(schema),
        version_table="alembic_version",
        version_table_schema=schema,
        include_schemas=False,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("celery_sched migrations do not support offline (SQL script) mode")
run_migrations_online()
