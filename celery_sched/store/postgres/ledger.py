"""The idempotency ledger on PostgreSQL (the ``ledger`` table).

The ledger shares a job store's :class:`~celery_sched.store.postgres.connection.Database`
(its retry helper, error translation and connection pool) and runs
everything but the hot path on that pool.

The hot path is one statement on each side of a task execution, both named
in :mod:`~celery_sched.store.postgres.statements`.
:meth:`PostgresLedger.acquire` is a single statement: it reads the job row
by primary key (the delivery fence) and, unless the delivery is fenced,
runs ``INSERT ... ON CONFLICT DO UPDATE ... WHERE <the lease expired> RETURNING``
(a new key, or one taken over from a dead holder or from an earlier job
that used the same key); only when it takes nothing and is not fenced is
the ledger row read, to tell a completed key from a held one. A delivery
with the due header reads its row from the partition that holds its due
time (``ledger_acquire_in``: a plain table, so the statement is prepared,
planned once per connection; 351 -> 77 us a take on one connection, issue
#31), and only an older copy of a job nobody started, which may adopt the
job, runs the full ``ledger_acquire`` (planned per call, see
:func:`~celery_sched.store.postgres.statements.due_between`).
:meth:`PostgresLedger.check_delivery` reads the same way.
:meth:`PostgresLedger.complete` is one upsert (durable; the acquire commits
without waiting for its WAL flush, see
:func:`~celery_sched.store.postgres.statements.ledger_acquire`, so a lost
take is re-created by the completion). Both run precompiled on an
autocommit psycopg connection of the store's hot-path pool
(:meth:`~celery_sched.store.postgres.connection.Database.run_raw`): a worker
pays for them twice per task. Single statements need no ``BEGIN``/``COMMIT``:
each is atomic.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Text, any_, bindparam, delete, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from celery_sched.errors import CelerySchedError, LedgerConflict
from celery_sched.interfaces import Ledger
from celery_sched.models import (
    ADOPTABLE_STATUSES,
    ClaimOutcome,
    DeliveryCheck,
    LedgerClaim,
    LedgerEntry,
    LedgerState,
    delivery_fence,
)
from celery_sched.store.partitions import PartitionRange
from celery_sched.store.postgres.base import PostgresStoreBase
from celery_sched.store.postgres.connection import RawStatement, TransientDatabaseError
from celery_sched.store.postgres.statements import (
    LEDGER_COMPLETED,
    LEDGER_RUNNING,
    Tables,
    delivery_job_in,
    ledger_acquire_in,
    seconds_param,
)
from celery_sched.timeutil import ensure_utc

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds the fence's listing of partitions is trusted (see
#: ``PostgresLedger._job_row``).
PARTITIONS_TTL = 60.0

_ADOPTABLE = frozenset(status.value for status in ADOPTABLE_STATUSES)

#: How often acquire re-tries its insert when the row it conflicted with
#: disappears before it can be read (released by a failing holder meanwhile).
ACQUIRE_ROUNDS = 3


class LedgerQueries:
    """The ledger's statements that run per call or per batch, not per task."""

    def __init__(self, tables: Tables) -> None:
        ledger = tables.ledger
        c = ledger.c
        key = c.key == bindparam("p_key")
        owner = c.owner == bindparam("p_owner")
        self.renew = (
            update(ledger)
            .where(
                c.key == any_(bindparam("p_keys", type_=postgresql.ARRAY(Text))),
                c.owner == any_(bindparam("p_owners", type_=postgresql.ARRAY(Text))),
                c.state == LEDGER_RUNNING,
            )
            .values(lease_expires_at=func.now() + seconds_param("p_lease"))
            .returning(c.key)
        )
        self.release = delete(ledger).where(key, owner, c.state == LEDGER_RUNNING)
        self.get = select(ledger, c.result.is_not(None).label("recorded")).where(key)
        older_than = func.now() - seconds_param("p_older_than")
        old_completed = (
            select(c.key)
            .where(c.completed_at < older_than, c.state == LEDGER_COMPLETED)
            .limit(bindparam("p_batch"))
            .with_for_update(skip_locked=True)
        )
        self.prune_completed = delete(ledger).where(c.key.in_(old_completed.scalar_subquery()))
        abandoned = (
            select(c.key)
            .where(c.state == LEDGER_RUNNING, c.lease_expires_at < older_than)
            .limit(bindparam("p_batch"))
            .with_for_update(skip_locked=True)
        )
        self.prune_abandoned = delete(ledger).where(c.key.in_(abandoned.scalar_subquery()))


class PostgresLedger(Ledger):
    """:class:`~celery_sched.interfaces.Ledger` on PostgreSQL, sharing a job store's pool.

    ``owns_store``: close the store with the ledger (the store was built for
    the ledger alone).
    """

    def __init__(self, store: PostgresStoreBase, *, owns_store: bool = False) -> None:
        self.store = store
        self._database = store.database
        self._settings = store.settings
        s = self._statements = store.statements
        self._q = LedgerQueries(s.tables)
        # By the delivery's due time, run unprepared (statements.due_between),
        # and by the margin for a message without the due header.
        self._acquire = RawStatement(s.ledger_acquire)
        self._check_delivery = RawStatement(s.ledger_check_delivery)
        self._delivery_job = RawStatement(s.delivery_job)
        # The fence's read by partition (see _job_row).
        self._partitions: tuple[float, list[dt.datetime], list[PartitionRange]] = (0.0, [], [])
        self._by_partition: dict[str, RawStatement] = {}
        self._acquire_in: dict[str, RawStatement] = {}
        self._partitions_lock = threading.Lock()
        self._acquire_margin = RawStatement(s.by_margin.ledger_acquire)
        self._check_delivery_margin = RawStatement(s.by_margin.ledger_check_delivery)
        self._inspect = RawStatement(s.ledger_inspect)
        self._complete = RawStatement(s.ledger_complete)
        self._complete_keep = RawStatement(s.ledger_complete_keep_result)
        self._owns_store = owns_store
        self._autocommit: Engine | None = None

    # -- plumbing -----------------------------------------------------------

    @property
    def _engine(self) -> Engine:
        # The store's pool, with connections switched to autocommit while
        # this ledger uses them (SQLAlchemy restores the mode on return).
        engine = self._database.engine
        if self._autocommit is None or self._autocommit.pool is not engine.pool:
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        return self._autocommit

    def _run(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` on a pooled autocommit connection, retried on transient
        failures (every caller is safe to repeat: see each statement)."""

        def attempt() -> T:
            with self._engine.connect() as conn:
                return fn(conn)

        return self._database.retry(attempt, what)

    # -- the Ledger interface -----------------------------------------------

    def acquire(
        self,
        key: str,
        *,
        owner: str,
        lease: float,
        job_id: uuid.UUID | None = None,
        attempt: int | None = None,
        take_completed: bool = False,
        due_at: dt.datetime | None = None,
    ) -> LedgerClaim:
        stmt = self._acquire if due_at is not None else self._acquire_margin
        params = stmt.params(
            p_key=key,
            p_owner=owner,
            p_lease=lease,
            p_job_id=job_id,
            p_attempt=attempt,
            p_take_completed=take_completed,
            **_due_params(due_at),
        )
        prepare = False if due_at is not None else None
        inspect = self._inspect.params(p_key=key)

        # Kept across the rounds (and run_raw's retries): an adoption that
        # committed stays this delivery's.
        adopted: int | None = None

        def once(cur: psycopg.Cursor[Any]) -> LedgerClaim:
            claim = take(cur)
            return claim if adopted is None else dataclasses.replace(claim, adopted=adopted)

        by_partition = {
            "p_key": key,
            "p_owner": owner,
            "p_lease": lease,
            "p_job_id": job_id,
            "p_attempt": attempt,
            "p_take_completed": take_completed,
            "p_due": due_at,
        }

        def take_in_partition(cur: psycopg.Cursor[Any]) -> Any:
            """The take with the fence read from the job's partition, one
            prepared statement (``(taken, status, attempt)``), or None when
            the adopting statement must decide (or the partition is unknown)."""
            if due_at is None or job_id is None or adopted is not None:
                return None
            if self._settings.pgbouncer:
                return None
            partition = self._partition_of(due_at)
            if partition is None:
                return None
            stmt = self._acquire_in.get(partition)
            if stmt is None:
                stmt = RawStatement(ledger_acquire_in(self._statements.tables, partition))
                self._acquire_in[partition] = stmt
            answer: Any
            try:
                answer = cur.execute(stmt.sql, stmt.params(**by_partition)).fetchone()
            except psycopg.errors.UndefinedTable:
                self._forget_partitions()
                return None
            _, status, job_attempt = answer
            if (
                status is not None
                and attempt is not None
                and job_attempt > attempt
                and status in _ADOPTABLE
            ):
                return None  # it may adopt the job: the full statement decides
            return answer

        def take(cur: psycopg.Cursor[Any]) -> LedgerClaim:
            nonlocal adopted
            for _ in range(ACQUIRE_ROUNDS):
                answer: Any = take_in_partition(cur)
                if answer is not None:
                    answer = (*answer, None, None)
                else:
                    # Scalar subqueries only: always exactly one row.
                    answer = cur.execute(stmt.sql, params, prepare=prepare).fetchone()
                taken, job_status, job_attempt, adopted_now, _ = answer
                if adopted_now is not None:
                    adopted = adopted_now
                if taken is not None:
                    return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=taken)
                if job_status is not None and adopted is None:
                    reason = delivery_fence(job_status, int(job_attempt), attempt)
                    if reason is not None:
                        return LedgerClaim(outcome=ClaimOutcome.FENCED, reason=reason)
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

        return self._database.run_raw("ledger acquire", once)

    def _partition_of(self, due_at: dt.datetime) -> str | None:
        """The name of the ``jobs`` partition holding ``due_at``, from the
        store's cached listing (read again at most every
        :data:`PARTITIONS_TTL` seconds, or every second while missing one)."""
        now = time.monotonic()
        read_at, lowers, ranges = self._partitions
        at = bisect.bisect_right(lowers, due_at) - 1
        if at >= 0 and ranges[at].holds(due_at) and now - read_at < PARTITIONS_TTL:
            return ranges[at].name
        # One reader at a time (threads, greenlets); the others read on
        # ``jobs`` meanwhile rather than queue for the catalog.
        if now - read_at < 1.0 or not self._partitions_lock.acquire(blocking=False):
            return None
        try:
            partitions = self.store.partitions
            partitions.forget()
            known = partitions.known()
            lowers = [rng.lower for rng in known]
            self._partitions = (time.monotonic(), lowers, known)
        finally:
            self._partitions_lock.release()
        at = bisect.bisect_right(lowers, due_at) - 1
        return known[at].name if at >= 0 and known[at].holds(due_at) else None

    def _forget_partitions(self) -> None:
        # A partition was dropped since the listing was read (retention).
        self._partitions = (0.0, [], [])
        self._by_partition.clear()
        self._acquire_in.clear()

    def _job_row(self, cur: psycopg.Cursor[Any], job_id: uuid.UUID, due_at: dt.datetime) -> Any:
        """Job ``job_id``'s ``(status, attempt, due_at)`` at ``due_at``, or None.

        Read from its partition by a prepared statement when the partition
        is known (about a third of the server's time of the same read on
        ``jobs``, which is planned on every call); else, or behind
        PgBouncer (no prepared statements, and a failed statement would
        abort the transaction the pool wraps it in), on ``jobs``."""
        if not self._settings.pgbouncer:
            partition = self._partition_of(due_at)
            if partition is not None:
                stmt = self._by_partition.get(partition)
                if stmt is None:
                    stmt = RawStatement(delivery_job_in(self._statements.tables, partition))
                    self._by_partition[partition] = stmt
                try:
                    return cur.execute(stmt.sql, {"p_job_id": job_id, "p_due": due_at}).fetchone()
                except psycopg.errors.UndefinedTable:
                    self._forget_partitions()
        read = self._delivery_job
        params = read.params(p_job_id=job_id, **_due_params(due_at))
        return cur.execute(read.sql, params, prepare=False).fetchone()

    def check_delivery(
        self, job_id: uuid.UUID, attempt: int | None, *, due_at: dt.datetime | None = None
    ) -> DeliveryCheck:
        dated = self._check_delivery
        params = dated.params(p_job_id=job_id, p_attempt=attempt, **_due_params(due_at))
        margin = self._check_delivery_margin
        by_margin = margin.params(p_job_id=job_id, p_attempt=attempt)

        def check(cur: psycopg.Cursor[Any]) -> Any:
            if due_at is not None:
                # The plain read first: only a row whose attempt is newer
                # than the delivery's, still pending or dispatched, can be
                # adopted, and only then is the adopting statement (about
                # three times the planning) worth running.
                found = self._job_row(cur, job_id, due_at)
                if found is not None:
                    status, job_attempt, job_due = found
                    if attempt is None or job_attempt <= attempt or status not in _ADOPTABLE:
                        return (status, job_attempt, None, job_due)
                    row = cur.execute(dated.sql, params, prepare=False).fetchone()
                    if row is None or row[0] is not None:
                        return row
            # No due header, or no row at that due time: a requeue by hand
            # made the job due again since this message was sent (rare; the
            # row is then looked for among the jobs due by tomorrow).
            return cur.execute(margin.sql, by_margin).fetchone()

        # One try, no retry loop: the caller (a task about to run) must not
        # stall while the database is away; it runs the delivery.
        row: Any = self._database.run_raw_once("delivery fence", check)
        status, job_attempt, adopted, job_due = row
        moved = None if job_due is None or due_at is None or job_due == due_at else job_due
        if status is None or adopted is not None:
            return DeliveryCheck(adopted=adopted, due_at=_utc_or_none(moved))
        return DeliveryCheck(
            reason=delivery_fence(status, int(job_attempt), attempt), due_at=_utc_or_none(moved)
        )

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

    def complete(
        self,
        key: str,
        *,
        owner: str,
        result: str | None = None,
        job_id: uuid.UUID | None = None,
    ) -> bool:
        if result is None:
            stmt = self._complete_keep
            params = stmt.params(p_key=key, p_owner=owner, p_job_id=job_id)
        else:
            stmt = self._complete
            params = stmt.params(p_key=key, p_owner=owner, p_result=result, p_job_id=job_id)
        done = self._database.run_raw(
            "ledger complete", lambda cur: cur.execute(stmt.sql, params).fetchone()
        )
        return done is not None

    def release(self, key: str, *, owner: str) -> bool:
        params = {"p_key": key, "p_owner": owner}
        rows = self._run("ledger release", lambda conn: conn.execute(self._q.release, params))
        return bool(rows.rowcount)

    @contextlib.contextmanager
    def transaction(
        self, key: str, *, owner: str, job_id: uuid.UUID | None = None
    ) -> Iterator[Connection]:
        db = self._database
        conn = db.retry(db.engine.connect, "ledger transaction")
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
            # A missing row (the take was lost) is re-created completed by
            # the same upsert: only another owner's row refuses.
            params = {"p_key": key, "p_owner": owner, "p_job_id": job_id}
            completion = self._statements.ledger_complete_keep_result
            done = self._in_tx(tx, lambda: conn.execute(completion, params).first())
            if done is None:
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
            return self._database.guard(fn, "ledger transaction")
        except TransientDatabaseError as exc:
            _quiet_rollback(tx)
            raise self._database.unavailable(exc) from exc
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


def _due_params(due_at: dt.datetime | None) -> dict[str, Any]:
    """The bounds of :func:`~.statements.due_between` for one job due at ``due_at``."""
    if due_at is None:
        return {}
    due = ensure_utc(due_at, name="due_at")
    return {"p_due_from": due, "p_due_to": due}


def _quiet_rollback(tx: Any) -> None:
    # The connection may already be broken; closing it afterwards discards
    # the transaction either way.
    with contextlib.suppress(sa_exc.SQLAlchemyError, psycopg.Error):
        tx.rollback()


def _utc_or_none(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else ensure_utc(value)
