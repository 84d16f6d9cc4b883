"""The idempotency ledger on PostgreSQL: every SQL statement of the ``ledger`` table.

Statements are SQLAlchemy Core expressions built once in
:class:`_LedgerQueries`. Driver exceptions stop here, as in the job store:
the ledger reuses its :class:`~celery_sched.store.postgres.PostgresJobStore`'s
retry helper and error translation, and runs everything but the hot path on
the store's connection pool.

The hot path is one statement on each side of a task execution.
:meth:`PostgresLedger.acquire` is a single statement: it reads the job row
by primary key (the delivery fence) and, unless the delivery is fenced,
runs ``INSERT ... ON CONFLICT DO UPDATE ... WHERE <the lease expired> RETURNING``
(a new key, or one taken over from a dead holder or from an earlier job
that used the same key); only when it takes nothing and is not fenced is
the ledger row read, to tell a completed key from a held one.
:meth:`PostgresLedger.complete` is one upsert (durable; the acquire commits
without waiting for its WAL flush, see :class:`_LedgerQueries`, so a lost
take is re-created by the completion). Both run precompiled on the store's
autocommit psycopg connection of the calling thread
(:meth:`~celery_sched.store.postgres.PostgresJobStore.run_raw`): a worker
pays for them twice per task. Single statements need no ``BEGIN``/``COMMIT``:
each is atomic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy import (
    Boolean,
    Integer,
    Interval,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    extract,
    func,
    literal_column,
    null,
    or_,
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
from celery_sched.models import (
    ADOPTABLE_STATUSES,
    FENCED_STATUSES,
    ClaimOutcome,
    DeliveryCheck,
    JobStatus,
    LedgerClaim,
    LedgerEntry,
    LedgerState,
    delivery_fence,
)
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


def _literals(statuses: Iterable[JobStatus]) -> list[ColumnElement[Any]]:
    # Rendered into the SQL, so the planner sees the values.
    return [literal_column(f"'{status.value}'") for status in sorted(statuses)]


def _seconds(name: str) -> ColumnElement[Any]:
    return bindparam(name, type_=_DOUBLE) * _ONE_SECOND


class _LedgerQueries:
    """Every statement of the ledger, built once from the metadata."""

    def __init__(self, schema: str) -> None:
        metadata = build_metadata(schema)
        ledger = metadata.tables[f"{schema}.ledger"]
        jobs = metadata.tables[f"{schema}.jobs"]
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
        # The delivery fence (models.delivery_fence, in SQL): the job row by
        # primary key, read in the same statement as the take. No job row
        # (pruned, or not a celery_sched message) fences nothing.
        job_id = bindparam("p_job_id", type_=jobs.c.id.type)
        delivered = bindparam("p_attempt", type_=Integer)
        job = select(jobs.c.status, jobs.c.attempt).where(jobs.c.id == job_id).cte("job")
        # The adoption (see Ledger.check_delivery): a copy of an older attempt
        # takes over a job nobody has started since its requeue. Only while
        # the row still has the attempt this statement read: a racing older
        # copy re-checks the updated row (EvalPlanQual) and adopts nothing.
        adopted = (
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.status.in_(_literals(ADOPTABLE_STATUSES)),
                jobs.c.attempt > delivered,
                jobs.c.attempt == select(job.c.attempt).scalar_subquery(),
            )
            # Running from now, without a worker until this copy's process
            # reports its start: later copies find it started and are fenced.
            .values(
                status=_sql("'running'"),
                attempt=jobs.c.attempt + 1,
                started_at=now,
                worker=null(),
                worker_pid=null(),
            )
            .returning(jobs.c.attempt)
            .cte("adopted")
        )
        fenced = exists().where(
            or_(
                job.c.status.in_(_literals(FENCED_STATUSES)),
                and_(job.c.attempt > delivered, ~exists(select(adopted.c.attempt))),
            )
        )
        row = (
            select(
                bindparam("p_key", type_=Text),
                bindparam("p_job_id", type_=c.job_id.type),
                _RUNNING,
                bindparam("p_owner", type_=Text),
                lease_until,
                _sql("1"),
            )
            .select_from(no_fsync)
            .where(~fenced)
        )
        new = pg_insert(ledger).from_select(
            ["key", "job_id", "state", "owner", "lease_expires_at", "attempts"], row
        )
        completed = c.state == _COMPLETED
        # The WHERE of DO UPDATE sees the existing row: a running key whose
        # holder stopped renewing its lease is taken over, and (with
        # p_take_completed: the key is the job key) a key completed for
        # another job, an earlier one that used the same key and was pruned
        # since; it starts afresh. A key completed for this job, or a live
        # lease, makes the take return nothing.
        take = new.on_conflict_do_update(
            index_elements=[c.key],
            set_={
                "state": _RUNNING,
                "owner": new.excluded.owner,
                "lease_expires_at": new.excluded.lease_expires_at,
                "attempts": case((completed, _sql("1")), else_=c.attempts + _sql("1")),
                "job_id": func.coalesce(new.excluded.job_id, c.job_id),
                "result": null(),
                "completed_at": null(),
            },
            where=or_(
                and_(c.state == _RUNNING, c.lease_expires_at <= now),
                and_(
                    bindparam("p_take_completed", type_=Boolean),
                    completed,
                    c.job_id != new.excluded.job_id,
                ),
            ),
        ).returning(c.attempts)
        taken = take.cte("taken")
        # One row always: the attempts if taken, and the job row's status and
        # attempt, from which a fenced delivery's reason is told.
        verdict = (
            select(job.c.status).scalar_subquery().label("job_status"),
            select(job.c.attempt).scalar_subquery().label("job_attempt"),
            select(adopted.c.attempt).scalar_subquery().label("adopted"),
        )
        self.acquire = select(select(taken.c.attempts).scalar_subquery().label("taken"), *verdict)
        # The same fence and adoption for a delivery that takes no key.
        self.check_delivery = select(*verdict)
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
        # finds its own completed row and only refreshes the result. An
        # upsert: a row that is missing although this owner took it (the
        # take's asynchronous commit was lost in a crash) is created
        # completed; only a row of another owner refuses (no row changed).
        def completion(recorded: bool) -> Any:
            result = cast(bindparam("p_result", type_=Text), JSONB) if recorded else null()
            done = pg_insert(ledger).values(
                key=bindparam("p_key", type_=Text),
                job_id=bindparam("p_job_id", type_=c.job_id.type),
                state=_COMPLETED,
                owner=bindparam("p_owner", type_=Text),
                attempts=_sql("1"),
                result=result,
                completed_at=now,
            )
            values = {
                "state": _COMPLETED,
                "lease_expires_at": null(),
                "completed_at": func.coalesce(c.completed_at, now),
            }
            if recorded:
                values["result"] = done.excluded.result
            # RETURNING: a row back means completed (an upsert's row count is
            # not reported through SQLAlchemy).
            return done.on_conflict_do_update(
                index_elements=[c.key], set_=values, where=c.owner == done.excluded.owner
            ).returning(c.key)

        self.complete = completion(recorded=True)
        self.complete_keep_result = completion(recorded=False)
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
        self._check_delivery = _RawStatement(self._q.check_delivery)
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
        self,
        key: str,
        *,
        owner: str,
        lease: float,
        job_id: uuid.UUID | None = None,
        attempt: int | None = None,
        take_completed: bool = False,
    ) -> LedgerClaim:
        params = self._acquire.params(
            p_key=key,
            p_owner=owner,
            p_lease=lease,
            p_job_id=job_id,
            p_attempt=attempt,
            p_take_completed=take_completed,
        )
        inspect = self._inspect.params(p_key=key)

        # Kept across the rounds (and run_raw's retries): an adoption that
        # committed stays this delivery's.
        adopted: int | None = None

        def once(cur: psycopg.Cursor[Any]) -> LedgerClaim:
            claim = take(cur)
            return claim if adopted is None else dataclasses.replace(claim, adopted=adopted)

        def take(cur: psycopg.Cursor[Any]) -> LedgerClaim:
            nonlocal adopted
            for _ in range(ACQUIRE_ROUNDS):
                # Scalar subqueries only: always exactly one row.
                answer: tuple[Any, ...] = cur.execute(self._acquire.sql, params).fetchone() or ()
                taken, job_status, job_attempt, adopted_now = answer
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

        return self.store.run_raw("ledger acquire", once)

    def check_delivery(self, job_id: uuid.UUID, attempt: int | None) -> DeliveryCheck:
        store = self.store
        params = self._check_delivery.params(p_job_id=job_id, p_attempt=attempt)

        def read() -> Any:
            # One try, no retry loop: the caller (a worker's consumer) must
            # not stall while the database is away; it runs the delivery.
            conn = store._raw_connection()
            try:
                return conn.execute(self._check_delivery.sql, params).fetchone()
            except psycopg.Error:
                if conn.closed or conn.broken:
                    store._local.conn = None
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                raise

        try:
            row = store._guard(read, "delivery fence")
        except TransientDatabaseError as exc:
            raise store._unavailable(exc) from exc
        status, job_attempt, adopted = row
        if status is None or adopted is not None:
            return DeliveryCheck(adopted=adopted)
        return DeliveryCheck(reason=delivery_fence(status, int(job_attempt), attempt))

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
        done = self.store.run_raw(
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
            # A missing row (the take was lost) is re-created completed by
            # the same upsert: only another owner's row refuses.
            params = {"p_key": key, "p_owner": owner, "p_job_id": job_id}
            done = self._in_tx(
                tx, lambda: conn.execute(self._q.complete_keep_result, params).first()
            )
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
