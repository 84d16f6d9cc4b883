"""How the PostgreSQL backends reach the database: connections, retries, errors.

:class:`Database` is the seam every backend of this package goes through (the
job store's roles and the idempotency ledger): it owns the SQLAlchemy engine
(pooled, created lazily, so constructing one connects to nothing), the
pool of autocommit psycopg connections of the hot paths, the one retry
helper and the one translation of driver errors.

Each process holds at most ``pool_max_size`` connections in each of its two
pools, however many threads or greenlets use them: an operation checks a
connection out and returns it when done. The hot-path pool is
:class:`HotPool`, not ``psycopg_pool.ConnectionPool``: that pool opens
connections in background threads, so a caller waiting for one while the
database is unreachable learns nothing until its wait times out (then
``PoolTimeout``, not the connection error), which would turn the delivery
fence's single fail-fast try (:meth:`Database.run_raw_once`) and every retry
into a wait of the whole timeout.

Behind PgBouncer in transaction pooling mode (``celery_sched_pgbouncer``),
consecutive transactions of one client run on different server sessions, and
PgBouncer refuses the start-up ``options`` parameter: nothing may rely on
session state. Connections then carry no ``options`` and prepare no
statements, and every transaction sets the session settings for itself
(``set_config(..., true)``, i.e. ``SET LOCAL``). Every statement names its
schema, so no ``search_path`` is needed; ``application_name`` is a start-up
parameter PgBouncer accepts and passes on.

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
from sqlalchemy import create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from celery_sched.errors import (
    CelerySchedError,
    DuplicateJob,
    MissingPartition,
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

#: The session setting by which a writer says which schema revision it
#: writes for, and this code's value (migration 0014 reads it, by name).
WRITER_SETTING = "celery_sched.writer_revision"
WRITER_REVISION = "0014"

#: The dialect statements are compiled for (SQLAlchemy's psycopg 3 dialect).
DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]

#: Hot-path pools inherited over a fork (see :meth:`Database.hot_pool`).
_INHERITED: list[Any] = []

#: A unique violation's detail: one column, or the primary key of jobs,
#: (id, due_at), whose first value (a UUID) holds no comma.
_UNIQUE_DETAIL = re.compile(
    r"Key \((?:(?P<column>\w+)\)=\((?P<value>.*)"
    r"|(?P<first>\w+), \w+\)=\((?P<first_value>[^,]*), .*)\) already exists",
    re.S,
)


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


class HotConnection(psycopg.Connection[Any]):
    """A connection of the hot-path pool, keeping its one cursor: a new
    cursor per statement costs a good part of a small statement."""

    hot_cursor: psycopg.Cursor[Any] | None = None


class HotPool:
    """At most ``size`` autocommit connections, shared by the threads (or
    greenlets) of one process; most recently returned first out.

    A connection is opened in the calling thread when none is idle and the
    bound allows, so a connection failure is raised at once; when all
    ``size`` are checked out, :meth:`getconn` waits up to ``timeout``
    seconds, then raises :class:`TransientDatabaseError` (retried like a
    lost connection). Idle connections stay open until :meth:`close`.
    """

    def __init__(self, connect: Callable[[], HotConnection], *, size: int, timeout: float) -> None:
        self._connect = connect
        self._size = size
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[HotConnection] = []
        self._closed = False

    def getconn(self) -> HotConnection:
        """A connection of this pool; give it back with :meth:`putconn`."""
        if not self._slots.acquire(timeout=self._timeout):
            raise TransientDatabaseError(
                TimeoutError(
                    f"all {self._size} hot-path connections stayed busy for {self._timeout}s"
                )
            )
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            return conn if conn is not None and not conn.closed else self._connect()
        except BaseException:
            self._slots.release()
            raise

    def putconn(self, conn: HotConnection) -> None:
        """Take ``conn`` back: kept if healthy, else closed. After a broken
        one the idle ones are closed too: they likely share its fate (a
        failover, a restart), and each would cost a failed retry."""
        try:
            broken = conn.broken or conn.closed
            healthy = (
                not broken and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            )
            with self._lock:
                keep = healthy and not self._closed
                if keep:
                    self._idle.append(conn)
                stale, self._idle = (self._idle, []) if broken else ([], self._idle)
            if not keep:
                stale.append(conn)
            for old in stale:
                with contextlib.suppress(psycopg.Error):
                    old.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections, and the others as they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                conn.close()


class Database:
    """One PostgreSQL database as the backends of this package reach it.

    Thread-safe; one per store (the ledger shares its store's).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._pool: HotPool | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._apart_engine: Engine | None = None
        #: One connection apart at a time (see :meth:`apart`).
        self._apart_lock = threading.Lock()
        idle_ms = max(1000, round(settings.lease_ttl * 1000))
        self._session_settings = {
            "statement_timeout": str(round(settings.statement_timeout * 1000)),
            "TimeZone": "UTC",
            "idle_in_transaction_session_timeout": str(idle_ms),
            # Every statement here touches a few thousand rows at most, but a
            # claim on the partitioned jobs table is planned over every
            # partition, and its cost estimate crosses jit_above_cost once
            # the future holds millions of rows: compiling it took ~200 ms
            # per claim of 1,000 rows at 5M future jobs (3 ms without).
            "jit": "off",
            # The schema revision this code writes for: migration 0014's
            # trigger refuses keyed jobs from writers that do not say it
            # (clients from before 0012 still running after the migration).
            WRITER_SETTING: WRITER_REVISION,
        }
        # Behind PgBouncer: the settings as the first statement of every
        # transaction (one statement, one round trip).
        self._local_settings = "SELECT " + ", ".join(
            f"set_config('{name}', '{value}', true)"
            for name, value in self._session_settings.items()
        )

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
        engine = create_engine(
            s.sqlalchemy_url(),
            pool_size=self.pool_bound,
            max_overflow=0,
            pool_timeout=max(s.statement_timeout, 1.0),
            # Pooled connections killed while idle (failover, pg_terminate_backend)
            # are detected at checkout instead of failing the next statement.
            pool_pre_ping=True,
            connect_args=self._connect_args(f"celery_sched[{self.schema}]"),
        )
        if s.pgbouncer:
            event.listen(engine, "begin", self._set_local_settings)
        return engine

    @property
    def pool_bound(self) -> int:
        """The most connections each of this process's two pools opens."""
        return max(self._settings.pool_max_size, self._settings.pool_min_size, 1)

    def _connect_args(self, application_name: str) -> dict[str, Any]:
        """psycopg's arguments for a new connection, beyond the URL."""
        args: dict[str, Any] = {
            "connect_timeout": CONNECT_TIMEOUT,
            "application_name": application_name[:63],
        }
        if self._settings.pgbouncer:
            # PgBouncer 1.18 in transaction mode cannot route a prepared
            # statement to the server session that prepared it.
            args["prepare_threshold"] = None
        else:
            # The cheapest place for the session settings: the start-up
            # packet (PgBouncer refuses it, see the module docstring).
            args["options"] = " ".join(
                f"-c {name}={value}" for name, value in self._session_settings.items()
            )
        return args

    def _set_local_settings(self, conn: Connection) -> None:
        # SQLAlchemy's "begin" event, behind PgBouncer: the driver has not
        # begun yet; this statement begins its transaction. An autocommit
        # connection (the ledger's single statements) has no transaction to
        # set them in: it runs with the role's defaults.
        driver: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
        if not driver.autocommit:
            driver.execute(self._local_settings)

    # -- running statements -------------------------------------------------

    def transaction(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction, retried whole on transient failures."""

        def attempt() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        return self.retry(attempt, what)

    def apart(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction on a connection of its own, opened
        for it and closed after, outside the pool; retried whole on transient
        failures. One such connection at a time per database.

        For a commit its caller must not wait on: the partitions an insert
        needs are created this way while the caller holds a pooled
        connection in its own transaction (a second pooled connection could
        wait for the pool forever once every connection is held the same
        way). Whoever holds this connection waits for no pooled one.
        """
        wait = max(self._settings.statement_timeout, 1.0)

        def attempt() -> T:
            if not self._apart_lock.acquire(timeout=wait):
                raise StoreError(f"{what}: waited {wait}s for another {what} to finish")
            try:
                with self._apart().begin() as conn:
                    return fn(conn)
            finally:
                self._apart_lock.release()

        return self.retry(attempt, what)

    def _apart(self) -> Engine:
        if self._apart_engine is None:
            # Rarely used (a day's first partition): not worth an idle
            # connection per process.
            engine = create_engine(
                self._settings.sqlalchemy_url(),
                poolclass=NullPool,
                connect_args=self._connect_args(f"celery_sched[{self.schema}] ddl"),
            )
            if self._settings.pgbouncer:
                event.listen(engine, "begin", self._set_local_settings)
            self._apart_engine = engine
        return self._apart_engine

    def rowcount(self, what: str, stmt: Any, params: dict[str, Any]) -> int:
        """Run ``stmt`` in its own transaction (retried); return the rows it changed."""
        return self.transaction(what, lambda conn: conn.execute(stmt, params).rowcount)

    def run_raw(self, what: str, fn: Callable[[psycopg.Cursor[Any]], T]) -> T:
        """Run ``fn`` with a cursor of an autocommit psycopg connection of
        the hot-path pool (:meth:`hot_pool`), checked out for this call.

        For the per-task hot paths (ledger, status reports): SQLAlchemy's
        checkout with its pre-ping and its per-statement work cost several
        times a small statement, and so does a new cursor per statement; the
        cursor is kept with its connection. Retried whole on transient
        failures, with a broken connection replaced, so ``fn`` must be safe
        to repeat. Behind PgBouncer ``fn`` runs in a transaction of its own
        (see the module docstring).
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
        pool = self.hot_pool()
        conn = pool.getconn()
        try:
            cursor = conn.hot_cursor
            if cursor is None:
                cursor = conn.hot_cursor = conn.cursor()
            if not self._settings.pgbouncer:
                return fn(cursor)
            with conn.transaction():
                cursor.execute(self._local_settings)
                return fn(cursor)
        finally:
            pool.putconn(conn)

    def hot_pool(self) -> HotPool:
        """This process's pool of autocommit psycopg connections for
        :meth:`run_raw` (at most :attr:`pool_bound`; a caller waits up to
        the statement timeout for one), new after a fork."""
        pool = self._pool
        pid = os.getpid()
        if pool is not None and self._pool_pid == pid:
            return pool
        with self._pool_lock:
            if self._pool is not None and self._pool_pid != pid:
                # Inherited over a fork: never used or closed by the child
                # (closing would end the parent's sessions), just kept referenced.
                _INHERITED.append(self._pool)
                self._pool = None
            if self._pool is None:
                conninfo = self._settings.libpq_conninfo()
                kwargs = self._connect_args(f"celery_sched[{self.schema}] worker")
                self._pool = HotPool(
                    lambda: HotConnection.connect(conninfo, autocommit=True, **kwargs),
                    size=self.pool_bound,
                    timeout=max(self._settings.statement_timeout, 1.0),
                )
                self._pool_pid = pid
            return self._pool

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
            column = match and (match["column"] or match["first"])
            value = match and (match["value"] or match["first_value"])
            # A key that is an id is taken when the id is (primary key).
            if column in ("key", "id"):
                return DuplicateJob(key=value)
            if match:
                return DuplicateJob(f"a job with {column} {value} already exists")
            return DuplicateJob(f"duplicate job: {detail or _first_line(exc)}")
        if isinstance(orig, psycopg.errors.CheckViolation) and "no partition of relation" in str(
            orig
        ):
            return MissingPartition(f"{what}: {_first_line(exc)}")
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
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.close()
        elif pool is not None:
            _INHERITED.append(pool)
        with self._engine_lock:
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None


def probe(settings: Settings, *, timeout: float) -> None:
    """Connect to the database of ``settings`` once, on a connection of its
    own, and run ``SELECT 1``; raise :class:`StoreUnavailable` if that fails.

    For the readiness probe: no retries, and no pooled connection taken from
    the leader. libpq waits at least 2 seconds for a connection.
    """
    try:
        with psycopg.connect(
            settings.libpq_conninfo(),
            connect_timeout=max(2, int(timeout + 0.999)),
            autocommit=True,
            application_name="celery_sched-probe",
            prepare_threshold=None,
        ) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise StoreUnavailable(
            f"PostgreSQL at {settings.safe_database_url} is unavailable: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc
