"""How the PostgreSQL backends reach the database: connections, retries, errors.

:class:`Database` is the seam every backend of this package goes through (the
job store's roles and the idempotency ledger): it owns the SQLAlchemy engine
(pooled, created lazily, so constructing one connects to nothing), the
per-thread autocommit psycopg connections of the hot paths, the one retry
helper and the one translation of driver errors.

Driver exceptions stop here: connection losses and serialization failures are
retried (:func:`celery_sched.retry.call_with_retry`) and finally raised as
:class:`~celery_sched.errors.StoreUnavailable`; a missing schema becomes
:class:`~celery_sched.errors.SchemaMissing`; a unique violation
:class:`~celery_sched.errors.DuplicateJob`; everything else a
:class:`~celery_sched.errors.StoreError`.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from sqlalchemy import create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection, Engine

from celery_sched.errors import (
    CelerySchedError,
    DuplicateJob,
    SchemaMissing,
    StoreError,
    StoreUnavailable,
)
from celery_sched.retry import call_with_retry
from celery_sched.settings import Settings

T = TypeVar("T")

#: libpq connect timeout in seconds; a host that drops packets must not stall
#: a retry loop for minutes.
CONNECT_TIMEOUT = 10

#: The dialect statements are compiled for (SQLAlchemy's psycopg 3 dialect).
DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]

#: Per-thread connections inherited over a fork (see ``Database.raw_connection``).
_INHERITED: list[Any] = []

_UNIQUE_DETAIL = re.compile(r"Key \((?P<column>\w+)\)=\((?P<value>.*)\) already exists", re.S)


class TransientDatabaseError(Exception):
    """Retry marker wrapping a transient driver error; never escapes this package."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {_first_line(original)}")
        self.original = original


def _first_line(exc: BaseException) -> str:
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None else exc
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__


def _driver_error(exc: BaseException) -> BaseException:
    if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        return exc.orig
    return exc


def is_transient(exc: BaseException) -> bool:
    """Whether a driver error is worth retrying (the connection, not the statement, failed)."""
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, sa_exc.TimeoutError):  # pool exhausted for pool_timeout
        return True
    orig = _driver_error(exc)
    if isinstance(orig, psycopg.errors.QueryCanceled):
        # A statement timeout: retrying the same slow statement does not help.
        return False
    # OperationalError covers lost connections, admin shutdown, serialization
    # failures and deadlocks; InterfaceError a connection that is already closed.
    return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)


class RawStatement:
    """A Core statement precompiled for psycopg, run on a raw cursor.

    For the hot paths (claims, ledger, worker reports): SQLAlchemy's
    per-statement and per-row work costs several times the statement.
    """

    def __init__(self, stmt: Any) -> None:
        compiled = stmt.compile(dialect=DIALECT)
        self.sql: str = str(compiled)
        self.defaults: dict[str, Any] = dict(compiled.params)

    def params(self, **values: Any) -> dict[str, Any]:
        """The statement's bound defaults with ``values`` on top."""
        return {**self.defaults, **values}


@contextlib.contextmanager
def raw_cursor(conn: Connection) -> Iterator[psycopg.Cursor[Any]]:
    """A psycopg cursor on the driver connection of pooled ``conn`` (for a
    :class:`RawStatement` inside a SQLAlchemy transaction)."""
    raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    try:
        with raw.cursor() as cur:
            yield cur
    except psycopg.Error:
        if raw.closed or raw.broken:
            # SQLAlchemy did not see this failure; make sure the dead
            # connection is not returned to the pool.
            conn.invalidate()
        raise


class Database:
    """One PostgreSQL database as the backends of this package reach it.

    Thread-safe; one per store (the ledger shares its store's).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._local = threading.local()
        self._raw_lock = threading.Lock()
        self._raw_conns: list[psycopg.Connection[Any]] = []

    @property
    def settings(self) -> Settings:
        """The settings this database was opened with."""
        return self._settings

    @property
    def schema(self) -> str:
        """The PostgreSQL schema of celery_sched's tables."""
        return self._settings.db_schema

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, created on first use."""
        if self._engine is None:
            with self._engine_lock:
                if self._engine is None:
                    self._engine = self._create_engine()
        return self._engine

    def _create_engine(self) -> Engine:
        s = self._settings
        # A leader paused (SIGSTOP, GC, VM freeze) inside a claim holds the
        # FOR SHARE lock on its shard's leaders row, which the next leader's
        # epoch bump must wait for. Ending sessions idle in a transaction for
        # longer than the lease TTL bounds that wait; the paused claim rolls
        # back and, on waking, meets the new epoch.
        # SQLAlchemy opens connections on demand and keeps up to pool_size of
        # them, so pool_max_size bounds the pool and nothing is opened early.
        return create_engine(
            s.sqlalchemy_url(),
            pool_size=max(s.pool_max_size, s.pool_min_size),
            max_overflow=0,
            pool_timeout=max(s.statement_timeout, 1.0),
            # Pooled connections killed while idle (failover, pg_terminate_backend)
            # are detected at checkout instead of failing the next statement.
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": CONNECT_TIMEOUT,
                "application_name": f"celery_sched[{self.schema}]"[:63],
                "options": self._session_options(),
            },
        )

    def _session_options(self) -> str:
        s = self._settings
        idle_ms = max(1000, round(s.lease_ttl * 1000))
        return (
            f"-c statement_timeout={round(s.statement_timeout * 1000)} -c TimeZone=UTC "
            f"-c idle_in_transaction_session_timeout={idle_ms}"
        )

    # -- running statements -------------------------------------------------

    def transaction(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction, retried whole on transient failures."""

        def attempt() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        return self.retry(attempt, what)

    def rowcount(self, what: str, stmt: Any, params: dict[str, Any]) -> int:
        """Run ``stmt`` in its own transaction (retried); return the rows it changed."""
        return self.transaction(what, lambda conn: conn.execute(stmt, params).rowcount)

    def run_raw(self, what: str, fn: Callable[[psycopg.Cursor[Any]], T]) -> T:
        """Run ``fn`` with a cursor of this thread's own autocommit psycopg connection.

        For the per-task hot paths (ledger, status reports): a pool checkout
        with its pre-ping and SQLAlchemy's per-statement work cost several
        times a small statement, and so does a new cursor per statement; the
        cursor is kept with its connection. Retried whole on transient
        failures, with a broken connection replaced, so ``fn`` must be safe
        to repeat.
        """
        return self.retry(lambda: self._on_raw_cursor(fn), what)

    def run_raw_once(self, what: str, fn: Callable[[psycopg.Cursor[Any]], T]) -> T:
        """:meth:`run_raw` tried once: an unreachable database raises
        :class:`~celery_sched.errors.StoreUnavailable` at once."""
        try:
            return self.guard(lambda: self._on_raw_cursor(fn), what)
        except TransientDatabaseError as exc:
            raise self.unavailable(exc) from exc

    def _on_raw_cursor(self, fn: Callable[[psycopg.Cursor[Any]], T]) -> T:
        conn = self.raw_connection()
        cursor: psycopg.Cursor[Any] | None = getattr(self._local, "cursor", None)
        if cursor is None or cursor.connection is not conn:
            cursor = self._local.cursor = conn.cursor()
        try:
            return fn(cursor)
        except psycopg.Error:
            if conn.closed or conn.broken:
                self._local.conn = None
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            raise

    def raw_connection(self) -> psycopg.Connection[Any]:
        """This thread's autocommit psycopg connection, opened on first use
        (and again after a fork or once it is closed)."""
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        pid = os.getpid()
        if conn is not None and getattr(self._local, "pid", pid) != pid:
            # Inherited over a fork: never used or closed by the child
            # (closing would end the parent's session), just kept referenced.
            _INHERITED.append(conn)
            conn = None
        if conn is None or conn.closed:
            conn = psycopg.connect(
                self._settings.libpq_conninfo(),
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT,
                application_name=f"celery_sched[{self.schema}] worker"[:63],
                options=self._session_options(),
            )
            self._local.conn = conn
            self._local.pid = pid
            with self._raw_lock:
                self._raw_conns = [c for c in self._raw_conns if not c.closed]
                self._raw_conns.append(conn)
        return conn

    # -- retries and errors -------------------------------------------------

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` under :meth:`guard`, retried on transient failures."""
        return self.with_retries(lambda: self.guard(fn, what), what)

    def with_retries(self, attempt: Callable[[], T], what: str) -> T:
        """The retry policy alone: run ``attempt`` again while it raises
        :class:`TransientDatabaseError` (see :meth:`guard`), at most
        ``connect_retries`` times with backoff, logging each retry; then raise
        :class:`~celery_sched.errors.StoreUnavailable`."""
        return call_with_retry(
            attempt,
            transient=(TransientDatabaseError,),
            translate=self.unavailable,
            what=what,
            url=self._settings.safe_database_url,
            attempts=self._settings.connect_retries,
            backoff=self._settings.retry_backoff,
        )

    def guard(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` once, turning driver errors into retry markers or our errors."""
        try:
            return fn()
        except (sa_exc.SQLAlchemyError, psycopg.Error) as exc:
            if is_transient(exc):
                raise TransientDatabaseError(exc) from exc
            raise self.translate(exc, what) from exc

    def unavailable(self, exc: BaseException) -> CelerySchedError:
        """The error of a database that stayed unreachable (``exc``: the last failure)."""
        original = exc.original if isinstance(exc, TransientDatabaseError) else exc
        return StoreUnavailable(
            f"PostgreSQL at {self._settings.safe_database_url} is unavailable: "
            f"{type(_driver_error(original)).__name__}: {_first_line(original)}"
        )

    def translate(self, exc: BaseException, what: str) -> CelerySchedError:
        """Map a non-transient driver error to a celery_sched error."""
        orig = _driver_error(exc)
        if isinstance(orig, psycopg.errors.UniqueViolation):
            detail = orig.diag.message_detail or ""
            match = _UNIQUE_DETAIL.search(detail)
            # A key that is an id is taken when the id is (primary key).
            if match and match["column"] in ("key", "id"):
                return DuplicateJob(key=match["value"])
            if match:
                return DuplicateJob(f"a job with {match['column']} {match['value']} already exists")
            return DuplicateJob(f"duplicate job: {detail or _first_line(exc)}")
        if isinstance(orig, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
            return SchemaMissing(
                f"celery_sched schema {self.schema!r} is missing or out of date in "
                f"{self._settings.safe_database_url} ({_first_line(exc)}); "
                "run `celery -A proj sched migrate`"
            )
        if isinstance(orig, psycopg.errors.QueryCanceled):
            return StoreError(
                f"{what} exceeded the statement timeout of {self._settings.statement_timeout}s"
            )
        return StoreError(f"{what} failed: {type(orig).__name__}: {_first_line(exc)}")

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Close every connection this database opened; it reopens on next use."""
        with self._raw_lock:
            conns, self._raw_conns = self._raw_conns, []
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        with self._engine_lock:
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None
