"""Bulk loads with psycopg 3's binary COPY: new jobs, and new schedule rows.

COPY writes rows without a statement per row or per chunk, which is what
``load_jobs`` (millions of jobs) and the static sync (thousands of
schedules) need; the rows come as tuples already in column order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Dumper
from psycopg.types.string import BytesBinaryDumper
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from celery_sched.models import NEW_JOB_ROW, NewJobRow
from celery_sched.store.postgres.connection import Database, is_transient

logger = logging.getLogger(__name__)

#: Bulk loads of at least this many rows refresh the table's statistics.
ANALYZE_AFTER_ROWS = 10_000

# The columns COPY writes, in order, with their binary COPY types. The rest
# (status, attempt, created_at, ...) take their server defaults.
COPY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "uuid"),
    ("key", "text"),
    ("task", "text"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("argsrepr", "text"),
    ("kwargsrepr", "text"),
    ("options", "jsonb"),
    ("due_at", "timestamptz"),
    ("due_bucket", "int4"),
    ("expires_at", "timestamptz"),
    ("max_attempts", "int4"),
    ("shard", "int2"),
    ("schedule_id", "int8"),
    ("visibility_timeout", "float8"),
    ("max_runtime", "float8"),
)
assert tuple(name for name, _ in COPY_COLUMNS) == NEW_JOB_ROW

#: The columns a new schedule row is written with (COPY), with their binary
#: COPY types. The rest (id, paused, version, timestamps) take their defaults.
SCHEDULE_COPY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "text"),
    ("task", "text"),
    ("kind", "text"),
    ("spec", "jsonb"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("argsrepr", "text"),
    ("kwargsrepr", "text"),
    ("options", "jsonb"),
    ("timezone", "text"),
    ("misfire", "text"),
    ("overlap", "text"),
    ("catchup_window", "float8"),
    ("max_catchup", "int4"),
    ("relative", "bool"),
    ("enabled", "bool"),
    ("source", "text"),
    ("next_nominal_at", "timestamptz"),
)


def copy_sql(table: str, columns: tuple[tuple[str, str], ...]) -> str:
    """``COPY <table> (<columns>) FROM STDIN (FORMAT BINARY)``; ``table`` is
    rendered as given (quote it)."""
    names = ", ".join(f'"{name}"' for name, _ in columns)
    return f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)"


class _OptionsDumper(Dumper):
    """Binary jsonb for the options column of the bulk load.

    psycopg's own jsonb dumper runs ``json.dumps`` per row; almost every
    bulk-loaded job has no options, and their value is a constant.
    """

    format = pq.Format.BINARY
    oid = psycopg.adapters.types["jsonb"].oid

    def dump(self, obj: Any) -> bytes:
        if not obj:
            return b"\x01{}"
        # jsonb's binary input: format version 1, then the JSON text.
        return b"\x01" + json.dumps(dict(obj)).encode()


class JobCopy:
    """COPY of new job rows into one schema's ``jobs`` table."""

    def __init__(self, database: Database) -> None:
        self._database = database
        schema = database.schema
        self.sql = copy_sql(f'"{schema}".jobs', COPY_COLUMNS)
        self.analyze_sql = f'ANALYZE "{schema}".jobs'
        self.types = [kind for _, kind in COPY_COLUMNS]

    def write(self, rows: Iterable[NewJobRow]) -> int:
        """COPY ``rows`` (``NEW_JOB_ROW`` tuples, keys as stored) in one
        transaction; return how many. All or nothing."""
        db = self._database
        # Only checking out a connection is retried: once COPY has consumed
        # part of a (possibly one-shot) iterator, it cannot be replayed.
        conn = db.retry(lambda: db.engine.connect(), "load_jobs")
        try:
            with conn.begin():
                raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
                with raw.cursor() as cur:
                    # A bulk load lasts as long as the caller's input takes to
                    # produce, so the per-statement timeout does not fit it; a
                    # lock wait (a concurrent insert of the same key) still
                    # must not hang forever.
                    lock_ms = str(round(db.settings.statement_timeout * 1000))
                    cur.execute(
                        "SELECT set_config('statement_timeout', '0', true), "
                        "set_config('lock_timeout', %s, true)",
                        (lock_ms,),
                    )
                    count = 0
                    cur.adapters.register_dumper(None, _OptionsDumper)
                    # By type oid, bytea maps to psycopg's DB-API dumper, a
                    # Python subclass; the plain bytes dumper runs in C.
                    cur.adapters.register_dumper(None, BytesBinaryDumper)
                    with cur.copy(self.sql) as copy:
                        copy.set_types(self.types)
                        write_row = copy.write_row
                        for row in rows:
                            write_row(row)
                            count += 1
        except (sa_exc.SQLAlchemyError, psycopg.Error) as exc:
            raw_conn = conn.connection.driver_connection if not conn.closed else None
            if isinstance(raw_conn, psycopg.Connection) and raw_conn.closed:
                conn.invalidate()
            if is_transient(exc):
                raise db.unavailable(exc) from exc
            raise db.translate(exc, "load_jobs") from exc
        finally:
            conn.close()
        logger.debug("inserted %d jobs with COPY", count)
        if count >= ANALYZE_AFTER_ROWS:
            # Fresh statistics after a bulk load keep the planner on the
            # indexes the claims were written for; ANALYZE samples a fixed
            # number of rows, so this costs well under a second at any size.
            db.transaction("analyze", lambda c: c.exec_driver_sql(self.analyze_sql))
        return count


def copy_schedule_rows(conn: Connection, sql: str, rows: Sequence[dict[str, Any]]) -> None:
    """COPY schedule rows (``SCHEDULE_COPY_COLUMNS`` keys) with ``sql``
    inside ``conn``'s transaction."""
    raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    names = [name for name, _ in SCHEDULE_COPY_COLUMNS]
    types = [kind for _, kind in SCHEDULE_COPY_COLUMNS]
    with raw.cursor() as cur:
        cur.adapters.register_dumper(None, _OptionsDumper)
        with cur.copy(sql) as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row([row[name] for name in names])
