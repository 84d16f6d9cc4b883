"""What every role of the PostgreSQL job store shares: its database, its
statements, its lifecycle (migrations) and its clock."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from celery_sched.errors import MissingPartition
from celery_sched.interfaces import StoreLifecycle
from celery_sched.settings import Settings
from celery_sched.store.postgres.connection import Database
from celery_sched.store.postgres.keys import JobKeys
from celery_sched.store.postgres.partitioning import Partitions
from celery_sched.store.postgres.statements import Statements
from celery_sched.timeutil import ensure_utc

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

#: First key of the advisory lock serializing migrations (the second key is a
#: hash of the schema name, so different schemas migrate independently).
MIGRATE_LOCK_CLASS = 0x5C4ED

_NOW = select(func.now())


class PostgresStoreBase(StoreLifecycle):
    """:class:`~celery_sched.interfaces.StoreLifecycle` on PostgreSQL, and the
    state every role shares: one :class:`Database` and one
    :class:`~celery_sched.store.postgres.statements.Statements` per store."""

    def __init__(self, settings: Settings) -> None:
        self.database = Database(settings)
        self.statements = Statements(settings.db_schema)
        #: The jobs table's partitions (created before the rows that need them).
        self.partitions = Partitions(self.database)
        #: Caller-chosen keys, unique across the partitions.
        self.job_keys = JobKeys(self.statements.tables)

    @property
    def settings(self) -> Settings:
        """The settings this store was built with."""
        return self.database.settings

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, created on first use."""
        return self.database.engine

    def migrate(self, revision: str = "head") -> None:
        """Upgrade the schema to ``revision`` (the latest by default; an
        earlier one for tests and benchmarks of a migration)."""
        from alembic import command
        from alembic.config import Config

        schema = self.database.schema

        def run() -> None:
            with self.engine.connect() as conn, conn.begin():
                # Transaction-scoped advisory lock: a second migrator waits here,
                # then finds the committed version table and has nothing to do.
                conn.execute(
                    select(func.pg_advisory_xact_lock(MIGRATE_LOCK_CLASS, func.hashtext(schema)))
                )
                config = Config()
                config.set_main_option("script_location", str(MIGRATIONS_DIR))
                config.attributes["connection"] = conn
                config.attributes["schema"] = schema
                command.upgrade(config, revision)

        self.database.retry(run, "migrate")
        self.partitions.forget()
        logger.info("celery_sched schema %r is up to date", schema)

    def with_partitions(self, write: Callable[[], T]) -> T:
        """Run ``write``; once more after reading the partition list again
        should a partition it counted on be gone (:class:`MissingPartition`)."""
        try:
            return write()
        except MissingPartition:
            self.partitions.forget()
            return write()

    def close(self) -> None:
        self.database.close()

    def now(self) -> dt.datetime:
        value = self.database.transaction("now", lambda conn: conn.execute(_NOW).scalar_one())
        return ensure_utc(value)
