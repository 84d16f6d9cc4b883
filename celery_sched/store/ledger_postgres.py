"""The idempotency ledger on PostgreSQL: every SQL statement of the ``ledger`` table.

Statements are SQLAlchemy Core expressions built once in
:class:`_LedgerQueries`. Driver exceptions stop here, as in the job store:
the ledger reuses its :class:`~celery_sched.store.postgres.PostgresJobStore`'s
retry helper and error translation, and runs everything but the hot path on
the store's connection pool.

The hot path is one statement on each side of a task execution.
:meth:`PostgresLedger.acquire` is a single ``INSERT ... ON CONFLICT DO UPDATE
... WHERE <the lease expired> RETURNING`` (a new key, or one taken over from
a dead holder); only when it returns nothing is the row read, to tell a
completed key from a held one. :meth:`PostgresLedger.complete` is one
``UPDATE`` (durable; the acquire commits without waiting for its WAL
flush, see :class:`_LedgerQueries`). Both run precompiled on the store's
autocommit psycopg connection of the calling thread
(:meth:`~celery_sched.store.postgres.PostgresJobStore.run_raw`): a worker
pays for them twice per task. Single statements need no ``BEGIN``/``COMMIT``:
each is atomic.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy import (
    Interval,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    delete,
    extract,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from celery_sched.errors import CelerySchedError, LedgerConflict
from celery_sched.interfaces import Ledger
from celery_sched.models import ClaimOutcome, LedgerClaim, LedgerEntry, LedgerState
from celery_sched.store.postgres import (
    PostgresJobStore,
    TransientDatabaseError,
    _RawStatement,
)
from celery_sched.store.schema import build_metadata
from celery_sched.timeutil import ensure_utc

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How often acquire re-tries its insert when the row it conflicted with
#: disappears before it can be read (released by a failing holder meanwhile).
ACQUIRE_ROUNDS = 3

# Constants are rendered into the SQL rather than bound: fewer parameters to
# send per statement on the hot path.
_RUNNING: ColumnElement[str] = literal_column("'running'")
_COMPLETED: ColumnElement[str] = literal_column("'completed'")
_ONE_SECOND = literal_column("interval '1 second'", type_=Interval)
_DOUBLE = postgresql.DOUBLE_PRECISION


def _sql(text: str) -> ColumnElement[Any]:
    return literal_column(text)


def _seconds(name: str) -> ColumnElement[Any]:
    return bindparam(name, type_=_DOUBLE) * _ONE_SECOND


class _LedgerQueries:
    """Every statement of the ledger, built once from the metadata."""

    def __init__(self, schema: str) -> None:
        ledger = build_metadata(schema).tables[f"{schema}.ledger"]
        c = ledger.c
        now = func.now()
        lease_until = now + _seconds("p_lease")
        key = c.key == bindparam("p_key")
        owner = c.owner == bindparam("p_owner")

        # The take commits without waiting for its WAL flush (synchronous_commit
        # off for this statement's own transaction only): other sessions see
        # it at once, so exactly one taker wins; only a PostgreSQL crash in
        # the next fraction of a second could forget it. Completions, which
        # the guarantee rests on, stay durable.
        no_fsync = select(
            func.set_config(_sql("'synchronous_commit'"), _sql("'off'"), _sql("true")).label("off")
        ).cte("no_fsync")
        row = select(
            bindparam("p_key", type_=Text),
            bindparam("p_job_id", type_=c.job_id.type),
            _RUNNING,
            bindparam("p_owner", type_=Text),
            lease_until,
            _sql("1"),
        ).select_from(no_fsync)
        new = pg_insert(ledger).from_select(
            ["key", "job_id", "state", "owner", "lease_expires_at", "attempts"], row
        )
        # The WHERE of DO UPDATE sees the existing row: only a running key
        # whose holder stopped renewing its lease is taken over. A completed
        # key or a live lease makes the statement return nothing.
        self.acquire = new.on_conflict_do_update(
            index_elements=[c.key],
            set_={
                "owner": new.excluded.owner,
                "lease_expires_at": new.excluded.lease_expires_at,
                "attempts": c.attempts + _sql("1"),
                "job_id": func.coalesce(new.excluded.job_id, c.job_id),
            },
            where=and_(c.state == _RUNNING, c.lease_expires_at <= now),
        ).returning(c.attempts)
        self.inspect = select(
            c.state,
            c.owner,
            c.attempts,
            c.result,
            c.result.is_not(None).label("recorded"),
            extract("epoch", c.lease_expires_at - now).label("retry_in"),
            c.completed_at,
        ).where(key)
        self.renew = (
            update(ledger)
            .where(
                c.key == any_(bindparam("p_keys", type_=postgresql.ARRAY(Text))),
                c.owner == any_(bindparam("p_owners", type_=postgresql.ARRAY(Text))),
                c.state == _RUNNING,
            )
            .values(lease_expires_at=lease_until)
            .returning(c.key)
        )
        # Owner tokens are unique per execution, so matching the owner is
        # enough: a repeat by the same owner (a retry after a lost reply)
        # finds its own completed row and only refreshes the result.
        self.complete = (
            update(ledger)
            .where(key, owner)
            .values(
                state=_COMPLETED,
                lease_expires_at=null(),
                completed_at=func.coalesce(c.completed_at, now),
                result=cast(bindparam("p_result", type_=Text), JSONB),
            )
        )
        self.complete_keep_result = (
            update(ledger)
            .where(key, owner)
            .values(
                state=_COMPLETED,
                lease_expires_at=null(),
                completed_at=func.coalesce(c.completed_at, now),
            )
        )
        self.release = delete(ledger).where(key, owner, c.state == _RUNNING)
        self.get = select(ledger, c.result.is_not(None).label("recorded")).where(key)
        older_than = now - _seconds("p_older_than")
        old_completed = (
            select(c.key)
            .where(c.completed_at < older_than, c.state == _COMPLETED)
            .limit(bindparam("p_batch"))
            .with_for_update(skip_locked=True)
        )
        self.prune_completed = delete(ledger).where(c.key.in_(old_completed.scalar_subquery()))
        abandoned = (
            select(c.key)
            .where(c.state == _RUNNING, c.lease_expires_at < older_than)
            .limit(bindparam("p_batch"))
            .with_for_update(skip_locked=True)
        )
        self.prune_abandoned = delete(ledger).where(c.key.in_(abandoned.scalar_subquery()))


class PostgresLedger(Ledger):
    """:class:`~celery_sched.interfaces.Ledger` on PostgreSQL, sharing a job store's pool.

    ``owns_store``: close the store with the ledger (the store was built for
    the ledger alone).
    """

    def __init__(self, store: PostgresJobStore, *, owns_store: bool = False) -> None:
        self.store = store
        self._settings = store._settings
        self._q = _LedgerQueries(store._settings.db_schema)
        self._acquire = _RawStatement(self._q.acquire)
        self._inspect = _RawStatement(self._q.inspect)
        self._complete = _RawStatement(self._q.complete)
        self._complete_keep = _RawStatement(self._q.complete_keep_result)
        self._owns_store = owns_store
        self._autocommit: Engine | None = None

    # -- plumbing -----------------------------------------------------------

    @property
    def _engine(self) -> Engine:
        # The store's pool, with connections switched to autocommit while
        # this ledger uses them (SQLAlchemy restores the mode on return).
        engine = self.store.engine
        if self._autocommit is None or self._autocommit.pool is not engine.pool:
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        return self._autocommit

    def _run(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` on a pooled autocommit connection, retried on transient
        failures (every caller is safe to repeat: see each statement)."""

        def attempt() -> T:
            with self._engine.connect() as conn:
                return fn(conn)

        return self.store._retry(attempt, what)

    # -- the Ledger interface -----------------------------------------------

    def acquire(
        self, key: str, *, owner: str, lease: float, job_id: uuid.UUID | None = None
    ) -> LedgerClaim:
        params = self._acquire.params(p_key=key, p_owner=owner, p_lease=lease, p_job_id=job_id)
        inspect = self._inspect.params(p_key=key)

        def attempt(cur: psycopg.Cursor[Any]) -> LedgerClaim:
            for _ in range(ACQUIRE_ROUNDS):
                taken = cur.execute(self._acquire.sql, params).fetchone()
                if taken is not None:
                    return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=taken[0])
                row = cur.execute(self._inspect.sql, inspect).fetchone()
                if row is None:
                    continue  # released between the two statements: insert again
                state, holder, attempts, result, recorded, retry_in, completed_at = row
                if state == LedgerState.COMPLETED.value:
                    return LedgerClaim(
                        outcome=ClaimOutcome.COMPLETED,
                        attempts=attempts,
                        holder=holder,
                        result=result,
                        result_recorded=bool(recorded),
                        completed_at=_utc_or_none(completed_at),
                    )
                if holder == owner:
                    # Our own insert committed but its reply was lost.
                    return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=attempts)
                return LedgerClaim(
                    outcome=ClaimOutcome.HELD,
                    attempts=attempts,
                    holder=holder,
                    retry_in=max(0.0, float(retry_in or 0.0)),
                )
            raise LedgerConflict(
                f"idempotency key {key!r} kept changing hands while being acquired"
            )

        return self.store.run_raw("ledger acquire", attempt)

    def renew(self, held: Sequence[tuple[str, str]], *, lease: float) -> set[str]:
        if not held:
            return set()
        params = {
            "p_keys": [key for key, _ in held],
            "p_owners": [owner for _, owner in held],
            "p_lease": lease,
        }
        return self._run(
            "ledger renew", lambda conn: set(conn.execute(self._q.renew, params).scalars())
        )

    def complete(self, key: str, *, owner: str, result: str | None = None) -> bool:
        if result is None:
            stmt, params = self._complete_keep, self._complete_keep.params(p_key=key, p_owner=owner)
        else:
            stmt = self._complete
            params = stmt.params(p_key=key, p_owner=owner, p_result=result)
        done = self.store.run_raw(
            "ledger complete", lambda cur: cur.execute(stmt.sql, params).rowcount
        )
        return done > 0

    def release(self, key: str, *, owner: str) -> bool:
        params = {"p_key": key, "p_owner": owner}
        rows = self._run("ledger release", lambda conn: conn.execute(self._q.release, params))
        return bool(rows.rowcount)

    @contextlib.contextmanager
    def transaction(self, key: str, *, owner: str) -> Iterator[Connection]:
        store = self.store
        conn = store._retry(store.engine.connect, "ledger transaction")
        try:
            tx = conn.begin()
            # The caller's statements are its own business: no statement
            # timeout. A transaction left idle (a frozen worker) ends about
            # when its lease would, instead of holding its locks for good.
            idle_ms = str(max(1000, round(self._settings.ledger_lease * 1000)))
            limits = select(
                func.set_config("statement_timeout", "0", True),
                func.set_config("idle_in_transaction_session_timeout", idle_ms, True),
            )
            self._in_tx(tx, lambda: conn.execute(limits))
            try:
                yield conn
            except BaseException:
                _quiet_rollback(tx)
                raise
            params = {"p_key": key, "p_owner": owner, "p_result": None}
            done = self._in_tx(tx, lambda: conn.execute(self._q.complete_keep_result, params))
            if done.rowcount != 1:
                _quiet_rollback(tx)
                raise LedgerConflict(
                    f"idempotency key {key!r} was taken over by another execution (this "
                    "one's lease expired); its transaction was rolled back"
                )
            # If the commit's outcome is unknown (connection lost), the key
            # and the caller's writes still agree: both landed or neither.
            self._in_tx(tx, tx.commit)
        finally:
            conn.close()

    def _in_tx(self, tx: Any, fn: Callable[[], T]) -> T:
        """Run one step of :meth:`transaction`; on failure roll back and translate."""
        try:
            return self.store._guard(fn, "ledger transaction")
        except TransientDatabaseError as exc:
            _quiet_rollback(tx)
            raise self.store._unavailable(exc) from exc
        except CelerySchedError:
            _quiet_rollback(tx)
            raise

    def get(self, key: str) -> LedgerEntry | None:
        row = self._run(
            "ledger get", lambda conn: conn.execute(self._q.get, {"p_key": key}).first()
        )
        if row is None:
            return None
        values = dict(row._mapping)
        values["result_recorded"] = bool(values.pop("recorded"))
        return LedgerEntry(**values)

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        params = {"p_older_than": older_than, "p_batch": batch}
        total = 0
        batches = 0
        for stmt in (self._q.prune_completed, self._q.prune_abandoned):

            def delete_batch(conn: Connection, stmt: Any = stmt) -> int:
                return conn.execute(stmt, params).rowcount

            while max_batches is None or batches < max_batches:
                # One autocommit statement per batch keeps locks and WAL
                # bursts small, like the job store's prune.
                deleted = self._run("ledger prune", delete_batch)
                total += deleted
                batches += 1
                if deleted < batch:
                    break
        if total:
            logger.info("pruned %d idempotency ledger entries", total)
        return total

    def close(self) -> None:
        # The hot-path connections are the store's (see run_raw).
        if self._owns_store:
            self.store.close()


def _quiet_rollback(tx: Any) -> None:
    # The connection may already be broken; closing it afterwards discards
    # the transaction either way.
    with contextlib.suppress(sa_exc.SQLAlchemyError, psycopg.Error):
        tx.rollback()


def _utc_or_none(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else ensure_utc(value)
