"""The PostgreSQL job store: every SQL statement of celery_sched's job path.

Statements are SQLAlchemy Core expressions built once per store in
:class:`_Queries`; bulk loads use psycopg 3's COPY directly. The engine is
created lazily, so constructing a store connects to nothing.

Driver exceptions stop here: connection losses and serialization failures are
retried (:func:`celery_sched.retry.call_with_retry`) and finally raised as
:class:`~celery_sched.errors.StoreUnavailable`; a missing schema becomes
:class:`~celery_sched.errors.SchemaMissing`; everything else a
:class:`~celery_sched.errors.StoreError`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import psycopg
import psycopg.errors
from psycopg import pq
from psycopg.adapt import Dumper
from psycopg.types.string import BytesBinaryDumper
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Integer,
    Interval,
    LargeBinary,
    MetaData,
    Row,
    Select,
    Table,
    Text,
    Update,
    Uuid,
    all_,
    and_,
    any_,
    bindparam,
    case,
    cast,
    create_engine,
    delete,
    exists,
    extract,
    func,
    literal,
    literal_column,
    not_,
    or_,
    select,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from celery_sched.errors import (
    CelerySchedError,
    DuplicateJob,
    InvalidSchedule,
    ScheduleExists,
    SchemaMissing,
    StaleEpoch,
    StoreError,
    StoreUnavailable,
    UnknownSchedule,
)
from celery_sched.interfaces import JobStore
from celery_sched.models import (
    FINISHED_STATUSES,
    JOB_FIELDS,
    NEW_JOB_ROW,
    UNFINISHED_STATUSES,
    Job,
    JobStatus,
    NewJob,
    NewJobRow,
    NewSchedule,
    PlanCommit,
    ReconcileResult,
    ScheduleAdvance,
    ScheduleRuns,
    StoredSchedule,
    SyncResult,
    WorkerUpdate,
    check_retry_in,
    id_of_key,
    jobs_from_rows,
)
from celery_sched.retry import call_with_retry
from celery_sched.settings import Settings
from celery_sched.store.schema import build_metadata
from celery_sched.timeutil import ensure_utc, to_bucket

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

#: First key of the advisory lock serializing migrations (the second key is a
#: hash of the schema name, so different schemas migrate independently).
MIGRATE_LOCK_CLASS = 0x5C4ED

#: libpq connect timeout in seconds; a host that drops packets must not stall
#: a retry loop for minutes.
CONNECT_TIMEOUT = 10

#: Per-thread connections inherited over a fork (see ``_raw_connection``).
_INHERITED: list[Any] = []

#: Rows per multi-row INSERT in insert_occurrences (keeps the statement under
#: Postgres's 65535 bind parameter limit).
OCCURRENCE_CHUNK = 1000

_UNIQUE_DETAIL = re.compile(r"Key \((?P<column>\w+)\)=\((?P<value>.*)\) already exists", re.S)

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

# Status literals are rendered into the SQL, not bound: a partial index
# (WHERE status = 'pending') is only usable when the planner can prove the
# predicate, which it cannot for a parameter in a generic prepared plan.
_PENDING: ColumnElement[str] = literal_column("'pending'")
_DISPATCHED: ColumnElement[str] = literal_column("'dispatched'")
_RUNNING: ColumnElement[str] = literal_column("'running'")
_RETRYING: ColumnElement[str] = literal_column("'retrying'")
_ONE_SECOND = literal_column("interval '1 second'", type_=Interval)
#: The physical address of a row version (claims lock and update by it).
_CTID: ColumnElement[Any] = literal_column("ctid")
_TEXT_OID = 25


_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]


#: Bulk loads of at least this many rows refresh the table's statistics.
ANALYZE_AFTER_ROWS = 10_000


class TransientDatabaseError(Exception):
    """Retry marker wrapping a transient driver error; never escapes this module."""

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


def _is_transient(exc: BaseException) -> bool:
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


def _seconds(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return value * _ONE_SECOND


def _minute_of(instant: ColumnElement[Any]) -> ColumnElement[int]:
    """The due bucket (whole minutes since the epoch) of a timestamptz expression."""
    return cast(func.floor(extract("epoch", instant) / 60), Integer)


class _Queries:
    """Every SQL statement of the store, built once from the metadata."""

    def __init__(self, schema: str) -> None:
        metadata = build_metadata(schema)
        jobs = metadata.tables[f"{schema}.jobs"]
        leaders = metadata.tables[f"{schema}.leaders"]
        self.jobs = jobs
        self.leaders = leaders
        c = jobs.c
        now = func.now()
        ids = bindparam("ids", type_=postgresql.ARRAY(c.id.type))
        finished = [status.value for status in FINISHED_STATUSES]

        self.now: Select[Any] = select(now)

        # -- leadership --
        self.epoch_for_share = (
            select(leaders.c.epoch)
            .where(leaders.c.shard == bindparam("p_shard"))
            .with_for_update(read=True)
        )
        self.current_epoch = select(leaders.c.epoch).where(leaders.c.shard == bindparam("p_shard"))
        upsert = pg_insert(leaders).values(
            shard=bindparam("p_shard"), epoch=1, holder=bindparam("p_holder"), acquired_at=now
        )
        self.acquire_epoch = upsert.on_conflict_do_update(
            index_elements=[leaders.c.shard],
            set_={
                "epoch": leaders.c.epoch + 1,
                "holder": upsert.excluded.holder,
                "acquired_at": now,
            },
        ).returning(leaders.c.epoch)

        # -- reading --
        # A job whose key is its id stores NULL in ``key`` (0003); every read
        # of a Job presents the id's text instead.
        self.job_key = func.coalesce(c.key, cast(c.id, Text)).label("key")
        self.job_columns = [self.job_key if column.name == "key" else column for column in c]
        # A key matches a row with that text key, or, when the key is a UUID
        # in canonical text (``p_key_id``, else NULL), the row with that id
        # and no text key of its own.
        self.key_matches = or_(
            c.key == bindparam("p_key"),
            and_(c.key.is_(None), c.id == bindparam("p_key_id", type_=c.id.type)),
        )
        self.get_by_key = select(*self.job_columns).where(self.key_matches)
        self.get_by_id = select(*self.job_columns).where(c.id == bindparam("p_id"))
        self.counts_by_status = select(c.status, func.count()).group_by(c.status)
        hour = func.date_trunc("hour", c.due_at, "UTC")
        self.counts_by_hour = select(hour, func.count()).group_by(hour)
        self.counts_by_hour_for_status = (
            select(hour, func.count()).where(c.status == bindparam("p_status")).group_by(hour)
        )

        # -- writing --
        self.insert = pg_insert(jobs).returning(*self.job_columns)
        # No conflict target: a taken key is a conflict on the key index or,
        # for a key that is an id, on the primary key.
        self.insert_or_nothing = (
            pg_insert(jobs).on_conflict_do_nothing().returning(*self.job_columns)
        )
        columns = ", ".join(f'"{name}"' for name, _ in COPY_COLUMNS)
        self.copy_sql = f'COPY "{schema}".jobs ({columns}) FROM STDIN (FORMAT BINARY)'
        self.analyze_sql = f'ANALYZE "{schema}".jobs'
        self.copy_types = [kind for _, kind in COPY_COLUMNS]
        assert tuple(name for name, _ in COPY_COLUMNS) == NEW_JOB_ROW

        # -- claims (the hot path) --
        # The scan walks the partial pending index of one shard in due order
        # and stops at the current minute, so future rows are never read.
        due_ids = (
            select(_CTID)
            .where(
                c.status == _PENDING,
                c.shard == bindparam("p_shard"),
                c.due_bucket <= _minute_of(now),
                c.due_at <= now,
            )
            .order_by(c.due_bucket, c.due_at)
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
            .subquery("due")
        )
        self.claim_due = self._claim(due_ids)
        self.claim_due_raw = _RawStatement(self.claim_due)
        # The ids are found by primary key only: with the status test in
        # this subquery the planner may pick the partial pending index
        # instead (it does on a freshly loaded table with no statistics) and
        # read the whole backlog per batch. The outer UPDATE re-checks
        # status and due-ness on the locked row.
        given_ids = (
            select(_CTID)
            .where(c.id == any_(ids), c.shard == bindparam("p_shard"))
            .with_for_update(skip_locked=True)
            .subquery("given")
        )
        self.claim_ids = self._claim(given_ids, c.status == _PENDING, c.due_at <= now)
        self.claim_ids_raw = _RawStatement(self.claim_ids)
        horizon = now + _seconds(bindparam("within", type_=postgresql.DOUBLE_PRECISION))
        soon = (
            c.status == _PENDING,
            c.shard == bindparam("p_shard"),
            c.due_bucket <= _minute_of(horizon),
            c.due_at <= horizon,
        )
        self.due_soon = (
            select(c.id, c.due_at)
            .where(*soon)
            .order_by(c.due_bucket, c.due_at)
            .limit(bindparam("p_limit"))
        )
        # Incremental staging: the lower bucket bound lets the index scan
        # start at ``after`` instead of at the oldest pending row.
        after = bindparam("after", type_=c.due_at.type)
        self.due_soon_after = (
            select(c.id, c.due_at)
            .where(*soon, c.due_bucket >= bindparam("after_bucket"), c.due_at > after)
            .order_by(c.due_bucket, c.due_at)
            .limit(bindparam("p_limit"))
        )

        # -- fenced dispatch transitions --
        fenced = (
            c.id == any_(ids),
            c.status == _DISPATCHED,
            c.leader_epoch == bindparam("p_epoch"),
        )
        self.release = update(jobs).where(*fenced).values(status="pending", dispatched_at=None)
        # Expiry re-checked by the database's clock: a leader whose clock ran
        # ahead (a wall-clock step) must not expire a job early.
        self.mark_expired = (
            update(jobs)
            .where(*fenced, c.expires_at <= now)
            .values(status="expired", finished_at=now, last_error=bindparam("reason"))
        )
        # A job whose own message could not be published: one attempt used,
        # as the reconciler counts one (the same rule for giving up). The
        # reasons come as an array parallel to the ids, unnested in lockstep.
        failed = (
            func.unnest(
                bindparam("f_ids", type_=postgresql.ARRAY(c.id.type)),
                bindparam("f_reasons", type_=postgresql.ARRAY(Text)),
            )
            .table_valued("id", "reason")
            .render_derived(name="failed", with_types=False)
        )
        self.fail_dispatch = (
            update(jobs)
            .where(
                c.id == failed.c.id,
                c.status == _DISPATCHED,
                c.leader_epoch == bindparam("p_epoch"),
            )
            .values(**self._requeue("not published: %s", failed.c.reason))
            .returning(c.status)
        )
        # Rows left in shards a lowered shard count no longer leads. One
        # branch per status, the literal status letting each use its partial
        # index (pending's leads with shard; the others are small).
        from_shard = bindparam("from_shard", type_=c.shard.type)
        self.unfinished_by_shard = union_all(
            *(
                select(c.shard, literal(status, type_=Text()), func.count())
                .where(c.status == literal_column(f"'{status}'"), c.shard >= from_shard)
                .group_by(c.shard)
                for status in sorted(UNFINISHED_STATUSES)
            )
        )

        # -- reconciler --
        gives_up = c.attempt + 1 >= c.max_attempts  # the rescuer gives up as _requeue does
        timeout = func.coalesce(
            c.visibility_timeout, bindparam("default_timeout", type_=postgresql.DOUBLE_PRECISION)
        )
        stale_dispatched = (
            select(c.id)
            .where(
                c.status == _DISPATCHED,
                c.shard == bindparam("p_shard"),
                c.dispatched_at < now - _seconds(timeout),
            )
            .order_by(c.dispatched_at)
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
            .subquery("stale")
        )
        self.requeue_dispatched = (
            update(jobs)
            .where(c.id == stale_dispatched.c.id)
            .values(**self._requeue("not started within %ss of dispatch", timeout))
            .returning(c.status)
        )
        # A retrying job's dispatched_at is when its retry message is due
        # (set by the retrying report): one that has not started a
        # visibility timeout later was lost with the broker, and nothing
        # else would ever send it again. A late retry message carries the
        # older attempt and is fenced on the worker.
        stale_retrying = (
            select(c.id)
            .where(
                c.status == _RETRYING,
                c.shard == bindparam("p_shard"),
                # Implied by the next test (timeouts are positive); bounds
                # the scan of jobs_retrying_idx to retries already due.
                c.dispatched_at < now,
                c.dispatched_at < now - _seconds(timeout),
            )
            .order_by(c.dispatched_at)
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
            .subquery("stale_retry")
        )
        self.requeue_retrying = (
            update(jobs)
            .where(c.id == stale_retrying.c.id)
            .values(
                **self._requeue(
                    "its retry did not start within %ss of its ETA %s", timeout, c.dispatched_at
                )
            )
            .returning(c.status)
        )
        overrunning = (
            select(c.id)
            .where(
                c.status == _RUNNING,
                c.shard == bindparam("p_shard"),
                c.max_runtime.is_not(None),
                c.started_at < now - _seconds(c.max_runtime),
            )
            .order_by(c.started_at)
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
            .subquery("overrunning")
        )
        self.requeue_running = (
            update(jobs)
            .where(c.id == overrunning.c.id)
            .values(
                **self._requeue(
                    "ran longer than max_runtime %ss on %s",
                    c.max_runtime,
                    func.coalesce(c.worker, "an unknown worker"),
                )
            )
            .returning(c.status)
        )

        # -- rescuer: running jobs whose worker process stopped beating --
        workers = metadata.tables[f"{schema}.workers"]
        ledger = metadata.tables[f"{schema}.ledger"]
        w = workers.c
        silent_since = now - _seconds(
            bindparam("p_worker_timeout", type_=postgresql.DOUBLE_PRECISION)
        )
        # A job started without a pid (an older worker) matches every
        # process of its host.
        its_process = and_(
            w.hostname == c.worker, or_(c.worker_pid.is_(None), w.pid == c.worker_pid)
        )
        # The ledger entry of a celery_sched.Task job records the job it
        # completed for; its key is the job key by default. A primary key
        # probe per rescued row.
        completed = exists().where(
            ledger.c.key == func.coalesce(c.key, cast(c.id, Text)),
            ledger.c.job_id == c.id,
            ledger.c.state == literal_column("'completed'"),
        )
        orphaned = (
            select(
                c.id,
                completed.label("done"),
                select(func.max(w.seen_at)).where(its_process).scalar_subquery().label("seen"),
            )
            .where(
                c.status == _RUNNING,
                c.shard == bindparam("p_shard"),
                # A job just started: its process may not have beaten yet.
                c.started_at < silent_since,
                or_(
                    # Taken over by an older copy (the delivery fence's
                    # adoption) whose process never reported its start.
                    c.worker.is_(None),
                    and_(
                        # No heartbeat row at all: a worker that does not
                        # beat (an older version); only max_runtime applies.
                        exists().where(its_process),
                        # A process that started after the job did is another
                        # one that reuses the pid (a restarted container).
                        ~exists().where(
                            its_process, w.seen_at >= silent_since, w.started_at <= c.started_at
                        ),
                    ),
                ),
            )
            .order_by(c.started_at)
            .limit(bindparam("p_limit"))
            .with_for_update(of=jobs, skip_locked=True)
            .subquery("orphaned")
        )
        done = orphaned.c.done
        self.rescue = (
            update(jobs)
            .where(c.id == orphaned.c.id)
            .values(
                status=case((done, "succeeded"), (gives_up, "dead"), else_="pending"),
                attempt=case((done, c.attempt), else_=c.attempt + 1),
                dispatched_at=case((done, c.dispatched_at), else_=None),
                started_at=case((done, c.started_at), else_=None),
                finished_at=case((done, now), (gives_up, now), else_=None),
                last_error=func.format(
                    "its worker %s (pid %s) stopped beating: last heartbeat at %s, "
                    "worker timeout %ss; %s",
                    c.worker,
                    func.coalesce(cast(c.worker_pid, Text), "unknown"),
                    orphaned.c.seen,
                    bindparam("p_worker_timeout", type_=postgresql.DOUBLE_PRECISION),
                    case(
                        (done, "its ledger entry records it completed"),
                        else_=func.format(
                            "requeued (attempt %s of %s)%s",
                            c.attempt + 1,
                            c.max_attempts,
                            case((gives_up, "; giving up"), else_=""),
                        ),
                    ),
                ),
            )
            .returning(c.status)
        )
        # A process's first beat (re)sets started_at: a reused pid is a new
        # process, and jobs started before it are not running in it.
        self.heartbeat = _RawStatement(
            pg_insert(workers)
            .values(hostname=bindparam("p_hostname"), pid=bindparam("p_pid"))
            .on_conflict_do_update(
                index_elements=[w.hostname, w.pid],
                set_={
                    "seen_at": now,
                    "started_at": case(
                        (bindparam("p_first", type_=Boolean), now), else_=w.started_at
                    ),
                },
            )
        )
        self.prune_workers = delete(workers).where(
            w.seen_at < now - _seconds(bindparam("older_than", type_=postgresql.DOUBLE_PRECISION))
        )

        # -- worker and user transitions --
        by_id = c.id == bindparam("p_id")
        # A running row without a worker was taken over by an older copy of
        # its message (the delivery fence's adoption, which runs before the
        # pool picks a process): its first start report names the process.
        adopted = and_(c.status == "running", c.worker.is_(None))
        self.mark_running = (
            update(jobs)
            .where(by_id, or_(c.status.in_(["dispatched", "retrying", "pending"]), adopted))
            .values(
                status="running",
                started_at=case((adopted, c.started_at), else_=now),
                worker=bindparam("p_worker"),
                worker_pid=bindparam("p_worker_pid", type_=Integer),
            )
        )
        self.mark_finished = (
            update(jobs)
            .where(by_id, c.status.not_in(finished))
            .values(
                status=bindparam("p_status"),
                finished_at=now,
                last_error=bindparam("error", type_=c.last_error.type),
            )
        )
        # A retrying job's dispatched_at is when its retry is due (the
        # reconciler requeues it once that is a visibility timeout past).
        self.mark_retrying = (
            update(jobs)
            .where(by_id, c.status == "running")
            .values(
                status="retrying",
                dispatched_at=now
                + _seconds(
                    func.coalesce(bindparam("p_retry_in", type_=postgresql.DOUBLE_PRECISION), 0.0)
                ),
                last_error=bindparam("error", type_=c.last_error.type),
            )
        )
        # The same transitions for batched worker reports: one statement per
        # kind, its rows passed as parallel arrays (one parameter each, so a
        # batch costs the client a few list appends per report, not a
        # statement). Each array holds an id at most once.
        ids = bindparam("p_ids", type_=postgresql.ARRAY(c.id.type))
        texts = postgresql.ARRAY(Text)

        def reported(**columns: Any) -> Any:
            # unnest(:p_ids, :p_x, ...) AS reported(id, x, ...): one row per report.
            arrays = [bindparam(param, type_=texts) for param in columns.values()]
            return (
                func.unnest(ids, *arrays)
                .table_valued("id", *columns)
                .render_derived(name="reported", with_types=False)
            )

        running = reported(worker="p_workers", worker_pid="p_pids", attempt="p_attempts")
        self.batch_running = _RawStatement(
            update(jobs)
            .where(
                c.id == running.c.id,
                or_(c.status == any_(_text_array("dispatched", "retrying", "pending")), adopted),
                # A delivery of an older attempt (the job was requeued since)
                # must not move the row: the new attempt could not be claimed.
                or_(running.c.attempt.is_(None), c.attempt <= cast(running.c.attempt, Integer)),
            )
            .values(
                status="running",
                started_at=case((adopted, c.started_at), else_=now),
                worker=running.c.worker,
                worker_pid=cast(running.c.worker_pid, Integer),
            )
        )
        retrying = reported(error="p_errors", retry_in="p_retry_ins")
        retry_in = cast(retrying.c.retry_in, postgresql.DOUBLE_PRECISION)
        self.batch_retrying = _RawStatement(
            update(jobs)
            .where(c.id == retrying.c.id, c.status == "running")
            .values(
                status="retrying",
                dispatched_at=now + _seconds(func.coalesce(retry_in, 0.0)),
                last_error=retrying.c.error,
            )
        )
        ended = reported(status="p_statuses", error="p_errors")
        self.batch_finished = _RawStatement(
            update(jobs)
            .where(c.id == ended.c.id, c.status != all_(_text_array(*sorted(finished))))
            .values(status=ended.c.status, finished_at=now, last_error=ended.c.error)
        )
        # A job whose start and finish arrive in one batch (a short task)
        # takes both transitions in one row update instead of two: the same
        # end state as running then finished, half the row versions.
        ran = reported(
            worker="p_workers", worker_pid="p_pids", status="p_statuses", error="p_errors"
        )
        was_running = c.status == "running"
        self.batch_ran = _RawStatement(
            update(jobs)
            .where(c.id == ran.c.id, c.status != all_(_text_array(*sorted(finished))))
            .values(
                status=ran.c.status,
                started_at=case((was_running, c.started_at), else_=now),
                worker=case((was_running & ~adopted, c.worker), else_=ran.c.worker),
                worker_pid=case(
                    (was_running & ~adopted, c.worker_pid),
                    else_=cast(ran.c.worker_pid, Integer),
                ),
                finished_at=now,
                last_error=ran.c.error,
            )
            # Whether the start applied too: it sets started_at to this
            # transaction's now(), as finished_at; a job already running
            # keeps an earlier started_at.
            .returning(c.started_at == c.finished_at)
        )
        # The process running (or about to run) the job was lost: requeue it
        # at once, unless the job has moved on (a later attempt).
        lost = reported(error="p_errors", attempt="p_attempts")
        self.batch_lost = _RawStatement(
            update(jobs)
            .where(
                c.id == lost.c.id,
                c.status == any_(_text_array("dispatched", "running")),
                or_(lost.c.attempt.is_(None), c.attempt == cast(lost.c.attempt, Integer)),
            )
            .values(**self._requeue("%s", lost.c.error))
        )
        self.cancel = (
            update(jobs)
            .where(self.key_matches, c.status == _PENDING)
            .values(status="cancelled", finished_at=now)
        )

        # -- housekeeping --
        prunable = (
            select(c.id)
            .where(
                c.finished_at
                < now - _seconds(bindparam("older_than", type_=postgresql.DOUBLE_PRECISION))
            )
            .limit(bindparam("batch"))
            .with_for_update(skip_locked=True)
        )
        self.prune = delete(jobs).where(c.id.in_(prunable.scalar_subquery()))

    def _requeue(self, why: str, *args: Any) -> dict[str, Any]:
        """The values of every requeue (reconciler, failed publish, lost
        process): pending again with ``attempt + 1``, or ``dead`` once that
        reaches ``max_attempts``; ``last_error`` is ``why`` (a ``format()``
        string over ``args``) with the attempt count after it."""
        c = self.jobs.c
        now = func.now()
        gives_up = c.attempt + 1 >= c.max_attempts
        return {
            "status": case((gives_up, "dead"), else_="pending"),
            "attempt": c.attempt + 1,
            "dispatched_at": None,
            "started_at": None,
            "finished_at": case((gives_up, now), else_=None),
            "last_error": func.format(
                f"{why} (attempt %s of %s)%s",
                *args,
                c.attempt + 1,
                c.max_attempts,
                case((gives_up, "; giving up"), else_=""),
            ),
        }

    def _claim(self, chosen: Any, *recheck: ColumnElement[bool]) -> Update:
        c = self.jobs.c
        # The subquery locked these exact row versions (FOR UPDATE), so
        # nobody can change them before this statement does: joining on the
        # physical row address (a TID scan) is safe and saves a primary key
        # probe per row. Should a row have been updated between the
        # statement's snapshot and its lock, the TID scan does not see the
        # new version and the row is simply not claimed this time.
        table = _DIALECT.identifier_preparer.format_table(self.jobs)
        # Options come back as text: most claimed jobs share a handful of
        # option sets, which _claimed_jobs decodes once per batch instead of
        # running the JSON loader per row.
        # In Job field order, so rows load without reordering.
        returned = [
            cast(c.options, Text).label("options")
            if name == "options"
            else self.job_key
            if name == "key"
            else c[name]
            for name in JOB_FIELDS
        ]
        return (
            update(self.jobs)
            .where(literal_column(f"{table}.ctid") == chosen.c.ctid, *recheck)
            .values(
                status="dispatched", dispatched_at=func.now(), leader_epoch=bindparam("p_epoch")
            )
            .returning(*returned)
        )


def _text_array(*values: str) -> Any:
    return postgresql.array([literal(value, type_=Text()) for value in values])


def _job(row: Row[Any]) -> Job:
    return Job(**row._mapping)


class _RawStatement:
    """A Core statement precompiled for psycopg, run on a raw cursor.

    For the hot paths (claims, ledger, worker reports): SQLAlchemy's
    per-statement and per-row work costs several times the statement.
    :meth:`jobs` loads claimed rows straight into :class:`Job` with
    psycopg's C row loading.
    """

    def __init__(self, stmt: Any) -> None:
        compiled = stmt.compile(dialect=_DIALECT)
        self.sql: str = str(compiled)
        self.defaults: dict[str, Any] = dict(compiled.params)

    def params(self, **values: Any) -> dict[str, Any]:
        """The statement's bound defaults with ``values`` on top."""
        return {**self.defaults, **values}

    def jobs(self, conn: Connection, params: dict[str, Any]) -> list[Job]:
        raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
        try:
            with raw.cursor() as cur:
                cur.execute(self.sql, self.params(**params))
                names = [column.name for column in cur.description or ()]
                rows = cur.fetchall()
                options_at = names.index("options")
                if cur.description[options_at].type_code != _TEXT_OID:  # type: ignore[index]
                    return jobs_from_rows(names, rows)
                return jobs_from_rows(names, _decode_options(rows, options_at))
        except psycopg.Error:
            if raw.closed or raw.broken:
                # SQLAlchemy did not see this failure; make sure the dead
                # connection is not returned to the pool.
                conn.invalidate()
            raise


def _decode_options(rows: list[tuple[Any, ...]], at: int) -> Iterator[list[Any]]:
    """Rows with the JSON text at index ``at`` decoded, each distinct text once."""
    decoded: dict[str, dict[str, Any]] = {}
    flat: dict[str, bool] = {}
    for row in rows:
        values = list(row)
        text = values[at]
        if text == "{}":
            values[at] = {}
        else:
            options = decoded.get(text)
            if options is None:
                options = decoded[text] = json.loads(text)
                flat[text] = not any(isinstance(v, (dict, list)) for v in options.values())
            # Every job gets its own mapping; a shallow copy is a copy only
            # when no value is itself a container.
            values[at] = dict(options) if flat[text] else json.loads(text)
        yield values


def _sort_due(jobs: list[Job]) -> list[Job]:
    # RETURNING gives no order guarantee; callers publish oldest first.
    jobs.sort(key=lambda job: (job.due_at, job.id))
    return jobs


class PostgresJobStore(JobStore):
    """:class:`~celery_sched.interfaces.JobStore` on PostgreSQL (psycopg 3)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._schema = settings.db_schema
        self._q = _Queries(settings.db_schema)
        self._sq = _ScheduleQueries(settings.db_schema)
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._local = threading.local()
        self._raw_lock = threading.Lock()
        self._raw_conns: list[psycopg.Connection[Any]] = []

    # -- plumbing -----------------------------------------------------------

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
                "application_name": f"celery_sched[{self._schema}]"[:63],
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

    def run_raw(self, what: str, fn: Callable[[psycopg.Cursor[Any]], T]) -> T:
        """Run ``fn`` with a cursor of this thread's own autocommit psycopg connection.

        For the per-task hot paths (ledger, status reports): a pool checkout
        with its pre-ping and SQLAlchemy's per-statement work cost several
        times a small statement, and so does a new cursor per statement; the
        cursor is kept with its connection. Retried whole on transient
        failures, with a broken connection replaced, so ``fn`` must be safe
        to repeat.
        """

        def attempt() -> T:
            conn = self._raw_connection()
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

        return self._retry(attempt, what)

    def _raw_connection(self) -> psycopg.Connection[Any]:
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
                application_name=f"celery_sched[{self._schema}] worker"[:63],
                options=self._session_options(),
            )
            self._local.conn = conn
            self._local.pid = pid
            with self._raw_lock:
                self._raw_conns = [c for c in self._raw_conns if not c.closed]
                self._raw_conns.append(conn)
        return conn

    def _unavailable(self, exc: BaseException) -> CelerySchedError:
        original = exc.original if isinstance(exc, TransientDatabaseError) else exc
        return StoreUnavailable(
            f"PostgreSQL at {self._settings.safe_database_url} is unavailable: "
            f"{type(_driver_error(original)).__name__}: {_first_line(original)}"
        )

    def _translate(self, exc: BaseException, what: str) -> CelerySchedError:
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
                f"celery_sched schema {self._schema!r} is missing or out of date in "
                f"{self._settings.safe_database_url} ({_first_line(exc)}); "
                "run `celery -A proj sched migrate`"
            )
        if isinstance(orig, psycopg.errors.QueryCanceled):
            return StoreError(
                f"{what} exceeded the statement timeout of {self._settings.statement_timeout}s"
            )
        return StoreError(f"{what} failed: {type(orig).__name__}: {_first_line(exc)}")

    def _guard(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` once, turning driver errors into retry markers or our errors."""
        try:
            return fn()
        except (sa_exc.SQLAlchemyError, psycopg.Error) as exc:
            if _is_transient(exc):
                raise TransientDatabaseError(exc) from exc
            raise self._translate(exc, what) from exc

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        return call_with_retry(
            lambda: self._guard(fn, what),
            transient=(TransientDatabaseError,),
            translate=self._unavailable,
            what=what,
            url=self._settings.safe_database_url,
            attempts=self._settings.connect_retries,
            backoff=self._settings.retry_backoff,
        )

    def _tx(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction, retried whole on transient failures."""

        def attempt() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        return self._retry(attempt, what)

    def _fence(self, conn: Connection, shard: int, epoch: int) -> None:
        # FOR SHARE on the shard's leaders row: acquire_epoch's UPDATE of that
        # row must wait until this claim commits, and a claim that starts after
        # the bump reads the new epoch and is refused. So once acquire_epoch
        # returns, no transaction of an older epoch can still be moving rows.
        current = conn.execute(self._q.epoch_for_share, {"p_shard": shard}).scalar_one_or_none()
        # No leaders row means no leader was ever elected: nobody may claim.
        if current is None or current != epoch:
            raise StaleEpoch(
                f"epoch {epoch} is stale for shard {shard}: the current epoch is {current or 0}"
            )

    # -- lifecycle ----------------------------------------------------------

    def migrate(self) -> None:
        from alembic import command
        from alembic.config import Config

        def run() -> None:
            with self.engine.connect() as conn, conn.begin():
                # Transaction-scoped advisory lock: a second migrator waits here,
                # then finds the committed version table and has nothing to do.
                conn.execute(
                    select(
                        func.pg_advisory_xact_lock(MIGRATE_LOCK_CLASS, func.hashtext(self._schema))
                    )
                )
                config = Config()
                config.set_main_option("script_location", str(MIGRATIONS_DIR))
                config.attributes["connection"] = conn
                config.attributes["schema"] = self._schema
                command.upgrade(config, "head")

        self._retry(run, "migrate")
        logger.info("celery_sched schema %r is up to date", self._schema)

    def close(self) -> None:
        with self._raw_lock:
            conns, self._raw_conns = self._raw_conns, []
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        with self._engine_lock:
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None

    def now(self) -> dt.datetime:
        value = self._tx("now", lambda conn: conn.execute(self._q.now).scalar_one())
        return ensure_utc(value)

    # -- writing jobs -------------------------------------------------------

    def insert(self, job: NewJob, *, if_exists: Literal["raise", "return"] = "raise") -> Job:
        values = _row_values(job)
        attempts = 0

        def write(conn: Connection) -> Job:
            if if_exists == "return":
                # A racing delete of the existing row could leave nothing to
                # return; try the insert again in that case.
                for _ in range(3):
                    row = conn.execute(self._q.insert_or_nothing, values).first()
                    if row is None:
                        row = conn.execute(self._q.get_by_key, _key_params(job.key)).first()
                    if row is not None:
                        return _job(row)
                raise StoreError(f"could not insert or read job {job.key!r}")
            return _job(conn.execute(self._q.insert, values).one())

        def attempt() -> Job:
            nonlocal attempts
            attempts += 1
            try:
                return self._guard(lambda: self._in_tx(write), "insert")
            except DuplicateJob:
                # A retry after a lost commit acknowledgement finds our own
                # row (same id): that is success, not a duplicate.
                if attempts > 1:
                    existing = self.get(job.key)
                    if existing is not None and existing.id == job.id:
                        return existing
                raise

        return call_with_retry(
            attempt,
            transient=(TransientDatabaseError,),
            translate=self._unavailable,
            what="insert",
            url=self._settings.safe_database_url,
            attempts=self._settings.connect_retries,
            backoff=self._settings.retry_backoff,
        )

    def _in_tx(self, fn: Callable[[Connection], T]) -> T:
        with self.engine.begin() as conn:
            return fn(conn)

    def insert_many(self, jobs: Iterable[NewJob]) -> int:
        return self.insert_rows(map(_stored_row, jobs))

    def insert_rows(self, rows: Iterable[NewJobRow]) -> int:
        """:meth:`insert_many` for jobs given as :data:`~celery_sched.models.NEW_JOB_ROW`
        tuples (already validated: ``JobBuilder.build_row`` output), written
        to COPY unchanged. Same atomicity and errors as :meth:`insert_many`.
        """
        # Only checking out a connection is retried: once COPY has consumed
        # part of a (possibly one-shot) iterator, it cannot be replayed.
        conn = self._retry(self._checkout, "insert_many")
        try:
            with conn.begin():
                raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
                with raw.cursor() as cur:
                    # A bulk load lasts as long as the caller's input takes to
                    # produce, so the per-statement timeout does not fit it; a
                    # lock wait (a concurrent insert of the same key) still
                    # must not hang forever.
                    lock_ms = str(round(self._settings.statement_timeout * 1000))
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
                    with cur.copy(self._q.copy_sql) as copy:
                        copy.set_types(self._q.copy_types)
                        write_row = copy.write_row
                        for row in rows:
                            write_row(row)
                            count += 1
        except (sa_exc.SQLAlchemyError, psycopg.Error) as exc:
            raw_conn = conn.connection.driver_connection if not conn.closed else None
            if isinstance(raw_conn, psycopg.Connection) and raw_conn.closed:
                conn.invalidate()
            if _is_transient(exc):
                raise self._unavailable(exc) from exc
            raise self._translate(exc, "insert_many") from exc
        finally:
            conn.close()
        logger.debug("inserted %d jobs with COPY", count)
        if count >= ANALYZE_AFTER_ROWS:
            # Fresh statistics after a bulk load keep the planner on the
            # indexes the claims were written for; ANALYZE samples a fixed
            # number of rows, so this costs well under a second at any size.
            self._tx("analyze", lambda c: c.exec_driver_sql(self._q.analyze_sql))
        return count

    def _checkout(self) -> Connection:
        return self.engine.connect()

    def insert_occurrences(self, jobs: Sequence[NewJob]) -> list[uuid.UUID]:
        if not jobs:
            return []
        rows = [_row_values(job) for job in jobs]
        table = self._q.jobs

        def write(conn: Connection) -> list[uuid.UUID]:
            written: list[uuid.UUID] = []
            for start in range(0, len(rows), OCCURRENCE_CHUNK):
                stmt = _skip_taken_keys(
                    pg_insert(table).values(rows[start : start + OCCURRENCE_CHUNK])
                ).returning(table.c.id)
                written.extend(conn.execute(stmt).scalars())
            return written

        return self._tx("insert_occurrences", write)

    # -- reading ------------------------------------------------------------

    def get(self, key: str) -> Job | None:
        params = _key_params(key)
        row = self._tx("get", lambda conn: conn.execute(self._q.get_by_key, params).first())
        return None if row is None else _job(row)

    def get_by_id(self, job_id: uuid.UUID) -> Job | None:
        row = self._tx(
            "get_by_id", lambda conn: conn.execute(self._q.get_by_id, {"p_id": job_id}).first()
        )
        return None if row is None else _job(row)

    def counts_by_status(self) -> dict[JobStatus, int]:
        rows = self._tx(
            "counts_by_status", lambda conn: conn.execute(self._q.counts_by_status).all()
        )
        return {JobStatus(status): count for status, count in rows}

    def counts_by_hour(self, status: JobStatus | None = None) -> dict[dt.datetime, int]:
        def read(conn: Connection) -> list[tuple[dt.datetime, int]]:
            if status is None:
                result = conn.execute(self._q.counts_by_hour)
            else:
                result = conn.execute(self._q.counts_by_hour_for_status, {"p_status": status.value})
            return [(row[0], row[1]) for row in result]

        return {ensure_utc(hour): count for hour, count in self._tx("counts_by_hour", read)}

    # -- user transitions ---------------------------------------------------

    def cancel(self, key: str) -> bool:
        return self._rowcount("cancel", self._q.cancel, _key_params(key)) > 0

    # -- leadership fencing -------------------------------------------------

    def acquire_epoch(self, shard: int, holder: str) -> int:
        epoch: int = self._tx(
            "acquire_epoch",
            lambda conn: conn.execute(
                self._q.acquire_epoch, {"p_shard": shard, "p_holder": holder}
            ).scalar_one(),
        )
        logger.info("shard %d: epoch %d acquired by %s", shard, epoch, holder)
        return epoch

    def current_epoch(self, shard: int) -> int:
        value = self._tx(
            "current_epoch",
            lambda conn: conn.execute(
                self._q.current_epoch, {"p_shard": shard}
            ).scalar_one_or_none(),
        )
        return int(value or 0)

    # -- dispatch transitions -----------------------------------------------

    def due_soon(
        self,
        *,
        shard: int,
        within: float,
        limit: int,
        after: dt.datetime | None = None,
    ) -> list[tuple[uuid.UUID, dt.datetime]]:
        params: dict[str, Any] = {"p_shard": shard, "within": within, "p_limit": limit}
        stmt = self._q.due_soon
        if after is not None:
            after = ensure_utc(after, name="after")
            stmt = self._q.due_soon_after
            params.update(after=after, after_bucket=to_bucket(after))
        rows = self._tx("due_soon", lambda conn: conn.execute(stmt, params).all())
        return [(job_id, ensure_utc(due_at)) for job_id, due_at in rows]

    def claim_due(self, *, shard: int, epoch: int, limit: int) -> list[Job]:
        if limit <= 0:
            return []

        def claim(conn: Connection) -> list[Job]:
            self._fence(conn, shard, epoch)
            params = {"p_shard": shard, "p_epoch": epoch, "p_limit": limit}
            return self._q.claim_due_raw.jobs(conn, params)

        return _sort_due(self._tx("claim_due", claim))

    def claim_ids(self, ids: Sequence[uuid.UUID], *, shard: int, epoch: int) -> list[Job]:
        id_list = list(ids)

        def claim(conn: Connection) -> list[Job]:
            self._fence(conn, shard, epoch)
            if not id_list:
                return []
            params = {"ids": id_list, "p_shard": shard, "p_epoch": epoch}
            return self._q.claim_ids_raw.jobs(conn, params)

        return _sort_due(self._tx("claim_ids", claim))

    def release(self, ids: Sequence[uuid.UUID], *, epoch: int) -> int:
        if not ids:
            return 0
        return self._rowcount("release", self._q.release, {"ids": list(ids), "p_epoch": epoch})

    def mark_expired(self, ids: Sequence[uuid.UUID], *, epoch: int, reason: str) -> int:
        if not ids:
            return 0
        return self._rowcount(
            "mark_expired",
            self._q.mark_expired,
            {"ids": list(ids), "p_epoch": epoch, "reason": reason},
        )

    def fail_dispatch(
        self, failures: Sequence[tuple[uuid.UUID, str]], *, epoch: int
    ) -> ReconcileResult:
        if not failures:
            return ReconcileResult()
        # One reason per id: the last one given wins, as in the memory store.
        reasons = dict(failures)
        params = {"f_ids": list(reasons), "f_reasons": list(reasons.values()), "p_epoch": epoch}
        statuses = self._tx(
            "fail_dispatch",
            lambda conn: list(conn.execute(self._q.fail_dispatch, params).scalars()),
        )
        dead = sum(1 for status in statuses if status == JobStatus.DEAD.value)
        return ReconcileResult(requeued=len(statuses) - dead, dead=dead)

    def unfinished_by_shard(self, *, from_shard: int) -> dict[int, dict[JobStatus, int]]:
        rows = self._tx(
            "unfinished_by_shard",
            lambda conn: conn.execute(
                self._q.unfinished_by_shard, {"from_shard": from_shard}
            ).all(),
        )
        found: dict[int, dict[JobStatus, int]] = {}
        for shard, status, count in rows:
            found.setdefault(int(shard), {})[JobStatus(status)] = int(count)
        return found

    def reconcile(
        self, *, shard: int, epoch: int, limit: int, default_visibility_timeout: float
    ) -> ReconcileResult:
        """Requeue stale dispatched jobs, retrying jobs whose retry is
        overdue, and running jobs past their max_runtime.

        ``requeued`` and ``dead`` count every job moved; ``timed_out`` counts
        those of them that were running past their ``max_runtime`` (the rest
        never started). At most ``limit`` rows in all, stale dispatched jobs
        first, then overdue retries.
        """
        timeout = default_visibility_timeout

        def run(conn: Connection) -> ReconcileResult:
            self._fence(conn, shard, epoch)
            params = {"p_shard": shard, "p_limit": limit, "default_timeout": timeout}
            moved = list(conn.execute(self._q.requeue_dispatched, params).scalars())
            if len(moved) < limit:
                params["p_limit"] = limit - len(moved)
                moved += conn.execute(self._q.requeue_retrying, params).scalars()
            overran: list[str] = []
            if len(moved) < limit:
                params["p_limit"] = limit - len(moved)
                overran = list(conn.execute(self._q.requeue_running, params).scalars())
            dead = sum(1 for status in (*moved, *overran) if status == JobStatus.DEAD.value)
            return ReconcileResult(
                requeued=len(moved) + len(overran) - dead, dead=dead, timed_out=len(overran)
            )

        if limit <= 0:
            # Still fenced: a stale leader must learn it is stale.
            self._tx("reconcile", lambda conn: self._fence(conn, shard, epoch))
            return ReconcileResult()
        result = self._tx("reconcile", run)
        if result.requeued or result.dead or result.timed_out:
            logger.info(
                "shard %d: reconciler requeued %d, marked %d dead, timed out %d",
                shard,
                result.requeued,
                result.dead,
                result.timed_out,
            )
        return result

    def rescue(
        self, *, shard: int, epoch: int, limit: int, worker_timeout: float
    ) -> ReconcileResult:
        if limit <= 0:
            # Still fenced: a stale leader must learn it is stale.
            self._tx("rescue", lambda conn: self._fence(conn, shard, epoch))
            return ReconcileResult()
        params = {"p_shard": shard, "p_limit": limit, "p_worker_timeout": worker_timeout}

        def run(conn: Connection) -> list[str]:
            self._fence(conn, shard, epoch)
            return list(conn.execute(self._q.rescue, params).scalars())

        statuses = self._tx("rescue", run)
        succeeded = statuses.count(JobStatus.SUCCEEDED.value)
        dead = statuses.count(JobStatus.DEAD.value)
        result = ReconcileResult(
            requeued=len(statuses) - succeeded - dead,
            dead=dead,
            rescued=len(statuses),
            succeeded=succeeded,
        )
        if statuses:
            logger.warning(
                "shard %d: rescued %d running jobs of stopped workers: %d requeued, %d dead, "
                "%d succeeded by the ledger",
                shard,
                len(statuses),
                result.requeued,
                dead,
                succeeded,
            )
        return result

    def prune_workers(self, *, older_than: float) -> int:
        return self._rowcount("prune_workers", self._q.prune_workers, {"older_than": older_than})

    # -- worker transitions -------------------------------------------------

    def heartbeat(self, hostname: str, pid: int, *, first: bool = False) -> None:
        stmt = self._q.heartbeat
        params = stmt.params(p_hostname=hostname, p_pid=pid, p_first=first)
        self.run_raw("heartbeat", lambda cur: cur.execute(stmt.sql, params))

    def mark_running(
        self, job_id: uuid.UUID, *, worker: str, worker_pid: int | None = None
    ) -> bool:
        params = {"p_id": job_id, "p_worker": worker, "p_worker_pid": worker_pid}
        return self._rowcount("mark_running", self._q.mark_running, params) > 0

    def mark_finished(
        self, job_id: uuid.UUID, status: JobStatus, *, error: str | None = None
    ) -> bool:
        status = JobStatus(status)
        if not status.finished:
            raise ValueError(f"mark_finished needs a finished status, got {status.value!r}")
        params = {"p_id": job_id, "p_status": status.value, "error": error}
        return self._rowcount("mark_finished", self._q.mark_finished, params) > 0

    def mark_retrying(
        self, job_id: uuid.UUID, *, error: str | None = None, retry_in: float | None = None
    ) -> bool:
        params = {"p_id": job_id, "error": error, "p_retry_in": check_retry_in(retry_in)}
        return self._rowcount("mark_retrying", self._q.mark_retrying, params) > 0

    def apply_worker_updates(self, updates: Sequence[WorkerUpdate]) -> int:
        # One transaction, one statement per kind of transition, applied in
        # the order a job moves: running, retrying, running again (a retry
        # that started within the same batch), finished, lost. Per job that
        # is the order the worker reported them in. Of two reports of one
        # kind for a job only one could apply (the transition's own status
        # test refuses the other), so only the first is sent (of two starts,
        # the one of the later attempt).
        running: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
        retrying: dict[uuid.UUID, tuple[str | None, str | None]] = {}
        finished: dict[uuid.UUID, tuple[str, str | None]] = {}
        lost: dict[uuid.UUID, tuple[str | None, str | None]] = {}
        resumed: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
        for u in updates:
            if u.status == JobStatus.RUNNING:
                pid = None if u.worker_pid is None else str(u.worker_pid)
                attempt = None if u.attempt is None else str(u.attempt)
                if u.job_id in retrying:
                    # The retry started: it must not stay "retrying" (the
                    # reconciler would requeue it while it runs).
                    resumed.setdefault(u.job_id, (u.worker or "", pid, attempt))
                    continue
                earlier = running.get(u.job_id)
                # A delivery that took its job over as a new attempt reports
                # its start again: the later attempt is the one that applies.
                if earlier is None or (
                    u.attempt is not None and earlier[2] is not None and u.attempt > int(earlier[2])
                ):
                    running[u.job_id] = (u.worker or "", pid, attempt)
            elif u.status == JobStatus.RETRYING:
                retry_in = None if u.retry_in is None else repr(u.retry_in)
                retrying.setdefault(u.job_id, (u.error, retry_in))
            elif u.status.finished:
                finished.setdefault(u.job_id, (u.status.value, u.error))
            elif u.status == JobStatus.PENDING:
                attempt = None if u.attempt is None else str(u.attempt)
                lost.setdefault(u.job_id, (u.error or "its worker process was lost", attempt))
        # Started and finished in this batch, with no retry between: one
        # combined transition (the common case of a short task).
        ran = {
            job_id: (*started[:2], *finished.pop(job_id))
            for job_id, started in running.items()
            if job_id in finished and job_id not in retrying
        }
        for job_id in ran:
            del running[job_id]
        batches: list[tuple[_RawStatement, dict[str, Any]]] = []
        params: dict[str, Any]
        if ran:
            params = {
                "p_ids": list(ran),
                "p_workers": [worker for worker, _, _, _ in ran.values()],
                "p_pids": [pid for _, pid, _, _ in ran.values()],
                "p_statuses": [status for _, _, status, _ in ran.values()],
                "p_errors": [error for _, _, _, error in ran.values()],
            }
            batches.append((self._q.batch_ran, params))
        if running:
            params = {
                "p_ids": list(running),
                "p_workers": [worker for worker, _, _ in running.values()],
                "p_pids": [pid for _, pid, _ in running.values()],
                "p_attempts": [attempt for _, _, attempt in running.values()],
            }
            batches.append((self._q.batch_running, params))
        if retrying:
            params = {
                "p_ids": list(retrying),
                "p_errors": [error for error, _ in retrying.values()],
                "p_retry_ins": [retry_in for _, retry_in in retrying.values()],
            }
            batches.append((self._q.batch_retrying, params))
        if resumed:
            params = {
                "p_ids": list(resumed),
                "p_workers": [worker for worker, _, _ in resumed.values()],
                "p_pids": [pid for _, pid, _ in resumed.values()],
                "p_attempts": [attempt for _, _, attempt in resumed.values()],
            }
            batches.append((self._q.batch_running, params))
        if finished:
            params = {
                "p_ids": list(finished),
                "p_statuses": [status for status, _ in finished.values()],
                "p_errors": [error for _, error in finished.values()],
            }
            batches.append((self._q.batch_finished, params))
        if lost:
            params = {
                "p_ids": list(lost),
                "p_errors": [error for error, _ in lost.values()],
                "p_attempts": [attempt for _, attempt in lost.values()],
            }
            batches.append((self._q.batch_lost, params))

        if not batches:
            return 0

        def apply(cursor: psycopg.Cursor[Any]) -> int:
            # One transaction, sent in one round trip (pipeline mode); one
            # cursor per statement, each keeps its own row count.
            conn = cursor.connection
            with conn.pipeline():
                cursors = [
                    conn.execute(stmt.sql, stmt.params(**params)) for stmt, params in batches
                ]
            changed = sum(max(0, cur.rowcount) for cur in cursors)
            if ran:
                # A combined row counts its start and its finish, as the
                # single transitions would.
                changed += sum(1 for (started,) in cursors[0].fetchall() if started)
            return changed

        return self.run_raw("apply_worker_updates", apply)

    # -- housekeeping -------------------------------------------------------

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        total = 0
        for _ in itertools.repeat(None) if max_batches is None else range(max_batches):
            # One transaction per batch keeps locks and WAL bursts small.
            deleted = self._rowcount(
                "prune", self._q.prune, {"older_than": older_than, "batch": batch}
            )
            total += deleted
            if deleted < batch:
                break
        if total:
            logger.info("pruned %d finished jobs", total)
        return total

    # -- diagnostics --------------------------------------------------------

    def explain_claim(self, *, shard: int = 0, limit: int = 1000) -> str:
        """The query plan of :meth:`claim_due` (EXPLAIN, nothing is claimed)."""
        compiled = self._q.claim_due.compile(dialect=self.engine.dialect)
        sql = "EXPLAIN " + str(compiled)
        params = compiled.construct_params({"p_shard": shard, "p_epoch": 0, "p_limit": limit})
        rows = self._tx("explain_claim", lambda conn: conn.exec_driver_sql(sql, params).all())
        return "\n".join(row[0] for row in rows)

    def _rowcount(self, what: str, stmt: Any, params: dict[str, Any]) -> int:
        return self._tx(what, lambda conn: conn.execute(stmt, params).rowcount)

    # == periodic schedules =================================================
    #
    # Statements live in _ScheduleQueries (below). A user's change and the
    # planner's commit both lock the schedule row first (UPDATE / FOR
    # UPDATE), then touch its jobs; claims never lock schedule rows.

    def add_schedules(self, schedules: Sequence[NewSchedule]) -> int:
        rows = [_schedule_values(schedule) for schedule in schedules]
        if not rows:
            return 0
        _refuse_duplicate_names(rows)
        names = [row["name"] for row in rows]

        def write(conn: Connection) -> int:
            taken = conn.execute(self._sq.names_taken, {"names": names}).scalars().first()
            if taken is not None:
                raise ScheduleExists(name=taken)
            self._sq.copy_rows(conn, self._sq.copy_schedules_sql, rows)
            return len(rows)

        try:
            count = self._tx("add_schedules", write)
        except DuplicateJob as exc:
            # A concurrent add of the same name won the unique index.
            raise ScheduleExists(f"a schedule with that name already exists ({exc})") from exc
        logger.info("added %d schedules", count)
        return count

    def get_schedule(self, name: str) -> StoredSchedule | None:
        row = self._tx(
            "get_schedule", lambda conn: conn.execute(self._sq.get, {"p_name": name}).first()
        )
        return None if row is None else _stored_schedule(row)

    def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[StoredSchedule]:
        table = self._sq.schedules
        stmt = select(table).order_by(table.c.name)
        if after is not None:
            stmt = stmt.where(table.c.name > after)
        if limit is not None:
            stmt = stmt.limit(max(limit, 0))
        rows = self._tx("list_schedules", lambda conn: conn.execute(stmt).all())
        return [_stored_schedule(row) for row in rows]

    def count_schedules(self) -> dict[str, int]:
        rows = self._tx("count_schedules", lambda conn: conn.execute(self._sq.counts).all())
        return {state: count for state, count in rows}

    def schedule_runs(self, schedule_ids: Sequence[int]) -> dict[int, ScheduleRuns]:
        ids = list(dict.fromkeys(schedule_ids))
        if not ids:
            return {}
        rows = self._tx(
            "schedule_runs", lambda conn: conn.execute(self._sq.runs, {"ids": ids}).all()
        )
        return {
            schedule_id: ScheduleRuns(
                next_due_at=next_due, last_due_at=last_due, last_status=last_status
            )
            for schedule_id, next_due, last_due, last_status in rows
            if next_due is not None or last_due is not None
        }

    def replace_schedule(
        self, schedule: NewSchedule, *, expected_version: int, restart: bool
    ) -> StoredSchedule | None:
        values = _definition_values(schedule)

        def write(conn: Connection) -> StoredSchedule | None:
            row = conn.execute(self._sq.get_for_update, {"p_name": schedule.name}).first()
            if row is None:
                raise UnknownSchedule(name=schedule.name)
            if row.version != expected_version:
                return None
            changes: dict[str, Any] = {**values, **_UNBROKEN}
            if restart:
                changes.update(last_nominal_at=None, next_nominal_at=schedule.next_nominal_at)
            conn.execute(
                update(self._sq.schedules)
                .where(self._sq.schedules.c.id == row.id)
                .values(
                    **changes,
                    version=self._sq.schedules.c.version + 1,
                    updated_at=func.now(),
                )
            )
            self._withdraw(conn, [row.id], roll_back=set() if restart else {row.id})
            return _stored_schedule(conn.execute(self._sq.get, {"p_name": schedule.name}).one())

        return self._tx("replace_schedule", write)

    def set_schedule_paused(self, name: str, paused: bool) -> StoredSchedule:
        def write(conn: Connection) -> StoredSchedule:
            row = conn.execute(self._sq.get_for_update, {"p_name": name}).first()
            if row is None:
                raise UnknownSchedule(name=name)
            # Resuming is how a user retries a broken schedule, paused or not.
            retry = not paused and row.broken_at is not None
            if row.paused != paused or retry:
                conn.execute(
                    update(self._sq.schedules)
                    .where(self._sq.schedules.c.id == row.id)
                    .values(
                        paused=paused,
                        version=self._sq.schedules.c.version + 1,
                        updated_at=func.now(),
                        **({} if paused else _UNBROKEN),
                    )
                )
                if paused:
                    self._withdraw(conn, [row.id], roll_back={row.id})
            return _stored_schedule(conn.execute(self._sq.get, {"p_name": name}).one())

        return self._tx("set_schedule_paused", write)

    def delete_schedule(self, name: str) -> bool:
        def write(conn: Connection) -> bool:
            row = conn.execute(self._sq.get_for_update, {"p_name": name}).first()
            if row is None:
                return False
            self._withdraw(conn, [row.id], roll_back=set())
            conn.execute(self._sq.delete, {"p_id": row.id})
            return True

        deleted = self._tx("delete_schedule", write)
        if deleted:
            logger.info("deleted schedule %s", name)
        return deleted

    def trigger_occurrence(self, job: NewJob, *, skip_if_busy: bool) -> Job | None:
        if job.schedule_id is None:
            raise ValueError("a triggered occurrence needs its schedule_id")
        values = _row_values(job)

        def write(conn: Connection) -> Job | None:
            locked = conn.execute(self._sq.lock_by_id, {"p_id": job.schedule_id}).first()
            if locked is None:
                raise UnknownSchedule(f"schedule {job.schedule_id} no longer exists")
            if skip_if_busy and conn.execute(self._sq.running, {"ids": [job.schedule_id]}).first():
                return None
            row = conn.execute(self._q.insert_or_nothing, values).first()
            if row is None:
                row = conn.execute(self._q.get_by_key, _key_params(job.key)).one()
            return _job(row)

        return self._tx("trigger_occurrence", write)

    def sync_static_schedules(self, schedules: Sequence[NewSchedule]) -> SyncResult:
        rows = [_schedule_values(schedule) for schedule in schedules]
        _refuse_duplicate_names(rows)
        for row in rows:
            row["source"] = "static"
        q = self._sq

        def write(conn: Connection) -> SyncResult:
            q.staged.create(conn)
            q.copy_rows(conn, q.copy_staged_sql, rows)
            conflicts = tuple(conn.execute(q.sync_conflicts).scalars())
            added = len(conn.execute(q.sync_insert).all())
            restarted = list(conn.execute(q.sync_restart).scalars())
            rolled = list(conn.execute(q.sync_change).scalars())
            disabled = list(conn.execute(q.sync_disable).scalars())
            self._withdraw(conn, [*restarted, *rolled, *disabled], roll_back=set(rolled))
            return SyncResult(
                added=added,
                updated=len(restarted) + len(rolled),
                disabled=len(disabled),
                unchanged=len(rows) - added - len(restarted) - len(rolled) - len(conflicts),
                conflicts=conflicts,
            )

        return self._tx("sync_static_schedules", write)

    def due_schedules(
        self,
        *,
        horizon: dt.datetime,
        shard: int,
        shards: int,
        limit: int,
        after: tuple[dt.datetime, int] | None = None,
    ) -> list[StoredSchedule]:
        if limit <= 0:
            return []
        params: dict[str, Any] = {
            "horizon": ensure_utc(horizon, name="horizon"),
            "p_shard": shard,
            "p_shards": max(shards, 1),
            "p_limit": limit,
        }
        stmt = self._sq.due
        if after is not None:
            stmt = self._sq.due_after
            params.update(after_next=ensure_utc(after[0], name="after"), after_id=after[1])
        rows = self._tx("due_schedules", lambda conn: conn.execute(stmt, params).all())
        return [_stored_schedule(row) for row in rows]

    def busy_schedules(self, schedule_ids: Sequence[int]) -> set[int]:
        ids = list(dict.fromkeys(schedule_ids))
        if not ids:
            return set()
        return set(
            self._tx(
                "busy_schedules",
                lambda conn: conn.execute(self._sq.busy, {"ids": ids}).scalars().all(),
            )
        )

    def commit_plans(self, advances: Sequence[ScheduleAdvance]) -> PlanCommit:
        if not advances:
            return PlanCommit()
        # Lock rows in id order, so two planners committing overlapping
        # batches (an old and a new leader) cannot deadlock.
        ordered = sorted(advances, key=lambda a: a.schedule_id)
        params = {
            "a_ids": [a.schedule_id for a in ordered],
            "a_versions": [a.version for a in ordered],
            "a_lasts": [a.last_nominal_at for a in ordered],
            "a_nexts": [a.next_nominal_at for a in ordered],
        }

        def write(conn: Connection) -> PlanCommit:
            applied = set(conn.execute(self._sq.advance, params).scalars())
            guarded = [
                a.schedule_id for a in ordered if a.skip_if_busy and a.schedule_id in applied
            ]
            busy_ids: set[int] = set()
            if guarded:
                busy_ids = set(conn.execute(self._sq.busy, {"ids": guarded}).scalars())
            jobs: list[NewJob] = []
            busy = 0
            for advance in ordered:
                if advance.schedule_id not in applied:
                    continue
                if advance.schedule_id in busy_ids:
                    busy += len(advance.occurrences)
                    continue
                jobs.extend(advance.occurrences)
            written: list[tuple[uuid.UUID, dt.datetime, int]] = []
            for start in range(0, len(jobs), OCCURRENCE_CHUNK):
                chunk = _occurrence_arrays(jobs[start : start + OCCURRENCE_CHUNK])
                result = conn.execute(self._sq.insert_occurrences, chunk)
                written.extend((job_id, ensure_utc(due), shard) for job_id, due, shard in result)
            return PlanCommit(written=written, stale=len(ordered) - len(applied), busy=busy)

        return self._tx("commit_plans", write)

    def mark_schedule_broken(self, schedule_id: int, *, version: int, reason: str) -> bool:
        marked = self._rowcount(
            "mark_schedule_broken",
            self._sq.mark_broken,
            {"p_id": schedule_id, "p_version": version, "p_reason": reason},
        )
        return marked > 0

    def _withdraw(self, conn: Connection, ids: Sequence[int], *, roll_back: set[int]) -> None:
        """Delete the not-yet-due pending occurrences of schedules ``ids``; for
        those in ``roll_back``, point the cursor at the earliest one deleted."""
        if not ids:
            return
        earliest: dict[int, dt.datetime] = {}
        for schedule_id, due_at in conn.execute(self._sq.withdraw, {"ids": list(ids)}):
            if schedule_id not in earliest or due_at < earliest[schedule_id]:
                earliest[schedule_id] = due_at
        rollbacks = [
            {"p_id": schedule_id, "p_next": due_at}
            for schedule_id, due_at in sorted(earliest.items())
            if schedule_id in roll_back
        ]
        if rollbacks:
            conn.execute(self._sq.roll_back, rollbacks)
        if earliest:
            logger.debug("withdrew future occurrences of %d schedules", len(earliest))


def _stored_key(job: NewJob) -> str | None:
    """What ``jobs.key`` holds for ``job``: None when the key is its id's text
    (``NewJob`` guarantees that a key which is a UUID's text is its id)."""
    return None if id_of_key(job.key) is not None else job.key


def _skip_taken_keys(stmt: Any) -> Any:
    """``stmt`` (an INSERT into jobs) skipping rows whose caller-chosen key is
    taken: the conflict target is the partial unique index ``jobs_key_key``."""
    key = stmt.table.c.key
    return stmt.on_conflict_do_nothing(index_elements=[key], index_where=key.is_not(None))


def _stored_row(job: NewJob) -> NewJobRow:
    row = job.as_row()
    key = _stored_key(job)
    return row if key is not None else (row[0], None, *row[2:])


def _key_params(key: str) -> dict[str, Any]:
    return {"p_key": key, "p_key_id": id_of_key(key)}


def _row_values(job: NewJob) -> dict[str, Any]:
    return {
        "id": job.id,
        "key": _stored_key(job),
        "task": job.task,
        "body": job.body,
        "content_type": job.content_type,
        "content_encoding": job.content_encoding,
        "argsrepr": job.argsrepr,
        "kwargsrepr": job.kwargsrepr,
        "options": dict(job.options),
        "due_at": job.due_at,
        "due_bucket": job.due_bucket,
        "expires_at": job.expires_at,
        "max_attempts": job.max_attempts,
        "shard": job.shard,
        "schedule_id": job.schedule_id,
        "visibility_timeout": job.visibility_timeout,
        "max_runtime": job.max_runtime,
    }


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


# == periodic schedules =======================================================

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

#: What a user defines (the static sync compares these); the first four
#: decide *when* a schedule fires, so a change in them restarts it from now.
TIMING_COLUMNS = ("kind", "spec", "timezone", "relative")
DEFINITION_COLUMNS = (
    *TIMING_COLUMNS,
    "task",
    "body",
    "content_type",
    "content_encoding",
    "argsrepr",
    "kwargsrepr",
    "options",
    "misfire",
    "overlap",
    "catchup_window",
    "max_catchup",
    "enabled",
)

#: The job columns of an occurrence insert and the array type each travels
#: in (options as JSON text, cast on the server).
OCCURRENCE_ARRAYS: tuple[tuple[str, str], ...] = (
    ("id", "uuid"),
    ("key", "text"),
    ("task", "text"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("argsrepr", "text"),
    ("kwargsrepr", "text"),
    ("options", "text"),
    ("due_at", "timestamptz"),
    ("due_bucket", "int4"),
    ("expires_at", "timestamptz"),
    ("max_attempts", "int4"),
    ("shard", "int4"),
    ("schedule_id", "int8"),
    ("visibility_timeout", "float8"),
    ("max_runtime", "float8"),
)

_UNFINISHED = sorted(status.value for status in UNFINISHED_STATUSES)
#: What a user's change writes besides the change: the planner tries a broken
#: schedule again.
_UNBROKEN: dict[str, Any] = {"broken_at": None, "broken_reason": None}
_STAGED_TABLE = "celery_sched_static_sync"


class _ScheduleQueries:
    """Every SQL statement of the schedules section, built once per store."""

    def __init__(self, schema: str) -> None:
        metadata = build_metadata(schema)
        s = metadata.tables[f"{schema}.schedules"]
        jobs = metadata.tables[f"{schema}.jobs"]
        self.schedules = s
        self.jobs = jobs
        now = func.now()
        ids = bindparam("ids", type_=postgresql.ARRAY(BigInteger))
        columns = ", ".join(f'"{name}"' for name, _ in SCHEDULE_COPY_COLUMNS)
        self.copy_types = [kind for _, kind in SCHEDULE_COPY_COLUMNS]
        self.copy_schedules_sql = (
            f'COPY "{schema}".schedules ({columns}) FROM STDIN (FORMAT BINARY)'
        )
        self.copy_staged_sql = f"COPY {_STAGED_TABLE} ({columns}) FROM STDIN (FORMAT BINARY)"

        # -- reading --
        self.names_taken = (
            select(s.c.name)
            .where(s.c.name == any_(bindparam("names", type_=postgresql.ARRAY(Text))))
            .limit(1)
        )
        self.get = select(s).where(s.c.name == bindparam("p_name"))
        self.get_for_update = self.get.with_for_update()
        self.lock_by_id = select(s.c.id).where(s.c.id == bindparam("p_id")).with_for_update()
        state = case(
            (not_(s.c.enabled), "disabled"),
            (s.c.paused, "paused"),
            (s.c.broken_at.is_not(None), "broken"),
            else_="active",
        ).label("state")
        self.counts = select(state, func.count()).group_by(state)

        # Per schedule: its earliest pending occurrence not yet due, and its
        # latest occurrence due so far; both walk jobs_schedule_due_idx.
        x = func.unnest(ids).table_valued("id").render_derived(name="x")
        next_due = (
            select(func.min(jobs.c.due_at))
            .where(
                jobs.c.schedule_id == x.c.id,
                jobs.c.status == _PENDING,
                jobs.c.due_at > now,
            )
            .scalar_subquery()
        )
        last = (
            select(jobs.c.due_at, jobs.c.status)
            .where(jobs.c.schedule_id == x.c.id, jobs.c.due_at <= now)
            .order_by(jobs.c.due_at.desc())
            .limit(1)
            .lateral("last")
        )
        self.runs = select(x.c.id, next_due, last.c.due_at, last.c.status).select_from(
            x.outerjoin(last, true())
        )

        # -- planning --
        stamp = DateTime(timezone=True)
        due = (
            select(s)
            .where(
                # The predicate of schedules_plan_idx, whole, so the scan uses it.
                s.c.enabled,
                not_(s.c.paused),
                s.c.broken_at.is_(None),
                s.c.next_nominal_at <= bindparam("horizon", type_=stamp),
                (s.c.id % bindparam("p_shards", type_=BigInteger))
                == bindparam("p_shard", type_=BigInteger),
            )
            .order_by(s.c.next_nominal_at, s.c.id)
            .limit(bindparam("p_limit"))
        )
        self.due = due
        self.due_after = due.where(
            tuple_(s.c.next_nominal_at, s.c.id)
            > tuple_(bindparam("after_next", type_=stamp), bindparam("after_id", type_=BigInteger))
        )
        adv = select(
            func.unnest(bindparam("a_ids", type_=postgresql.ARRAY(BigInteger))).label("id"),
            func.unnest(bindparam("a_versions", type_=postgresql.ARRAY(BigInteger))).label(
                "version"
            ),
            func.unnest(bindparam("a_lasts", type_=postgresql.ARRAY(stamp))).label("last"),
            func.unnest(bindparam("a_nexts", type_=postgresql.ARRAY(stamp))).label("next"),
        ).subquery("adv")
        # A planner that read the row before another one advanced it (an old
        # leader) must not move the cursor back: it would only plan again
        # what exists.
        self.advance = (
            update(s)
            .where(
                s.c.id == adv.c.id,
                s.c.version == adv.c.version,
                s.c.enabled,
                not_(s.c.paused),
                s.c.broken_at.is_(None),
                or_(
                    s.c.last_nominal_at.is_(None),
                    adv.c.last.is_(None),
                    s.c.last_nominal_at <= adv.c.last,
                ),
            )
            .values(last_nominal_at=adv.c.last, next_nominal_at=adv.c.next)
            .returning(s.c.id)
        )
        # Fenced by the version the planner read, so a user's change that
        # lands first (possibly the fix) is not marked broken after it.
        self.mark_broken = (
            update(s)
            .where(
                s.c.id == bindparam("p_id", type_=BigInteger),
                s.c.version == bindparam("p_version", type_=BigInteger),
                s.c.broken_at.is_(None),
            )
            .values(broken_at=now, broken_reason=bindparam("p_reason", type_=Text))
        )
        self.busy = (
            select(jobs.c.schedule_id)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == any_(_text_array(*_UNFINISHED)),
            )
            .distinct()
        )
        # Due or running: a pending occurrence not yet due does not count.
        self.running = (
            select(jobs.c.schedule_id)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == any_(_text_array(*_UNFINISHED)),
                or_(jobs.c.status != _PENDING, jobs.c.due_at <= now),
            )
            .limit(1)
        )
        # One short statement over array parameters, unnested in lockstep: a
        # multi-row VALUES list of a thousand rows costs more to build and
        # parse on the client than the insert costs the server.
        unnested = select(
            *(
                func.unnest(bindparam(f"u_{name}", type_=postgresql.ARRAY(_sql_type(kind)))).label(
                    name
                )
                for name, kind in OCCURRENCE_ARRAYS
            )
        ).subquery("u")
        self.insert_occurrences = _skip_taken_keys(
            pg_insert(jobs).from_select(
                [name for name, _ in OCCURRENCE_ARRAYS],
                select(
                    *(
                        cast(unnested.c[name], postgresql.JSONB)
                        if name == "options"
                        else unnested.c[name]
                        for name, _ in OCCURRENCE_ARRAYS
                    )
                ),
            )
        ).returning(jobs.c.id, jobs.c.due_at, jobs.c.shard)

        # -- changes --
        self.withdraw = (
            delete(jobs)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == _PENDING,
                jobs.c.due_at > now,
            )
            .returning(jobs.c.schedule_id, jobs.c.due_at)
        )
        self.roll_back = (
            update(s)
            .where(s.c.id == bindparam("p_id"))
            .values(last_nominal_at=None, next_nominal_at=bindparam("p_next", type_=stamp))
        )
        self.delete = delete(s).where(s.c.id == bindparam("p_id"))

        # -- the static sync, through a temporary table of the code's definitions --
        kinds = {name: kind for name, kind in SCHEDULE_COPY_COLUMNS}
        t = Table(
            _STAGED_TABLE,
            MetaData(),
            *(
                Column(name, _sql_type(kinds[name]), nullable=name not in ("name",))
                for name, _ in SCHEDULE_COPY_COLUMNS
            ),
            prefixes=["TEMPORARY"],
            postgresql_on_commit="DROP",
        )
        self.staged = t
        same_name = s.c.name == t.c.name
        static = s.c.source == "static"
        definition_changed = tuple_(*(s.c[n] for n in DEFINITION_COLUMNS)).is_distinct_from(
            tuple_(*(t.c[n] for n in DEFINITION_COLUMNS))
        )
        timing_changed = tuple_(*(s.c[n] for n in TIMING_COLUMNS)).is_distinct_from(
            tuple_(*(t.c[n] for n in TIMING_COLUMNS))
        )
        define: dict[str, Any] = {n: t.c[n] for n in DEFINITION_COLUMNS}
        define["disabled_at"] = case((t.c.enabled, None), else_=func.coalesce(s.c.disabled_at, now))
        self.sync_conflicts = select(t.c.name).where(
            exists().where(same_name, s.c.source == "dynamic")
        )
        self.sync_insert = (
            pg_insert(s)
            .from_select(
                [name for name, _ in SCHEDULE_COPY_COLUMNS],
                select(*(t.c[name] for name, _ in SCHEDULE_COPY_COLUMNS)),
            )
            .on_conflict_do_nothing(index_elements=[s.c.name])
            .returning(s.c.id)
        )
        # A timing change, or a schedule back in the code, starts over from
        # the definition's first instant; this statement runs first, so the
        # next one only sees the rows whose timing stayed the same.
        self.sync_restart = (
            update(s)
            .where(
                same_name,
                static,
                or_(and_(not_(s.c.enabled), t.c.enabled), timing_changed),
            )
            .values(
                **define,
                **_UNBROKEN,
                last_nominal_at=None,
                next_nominal_at=t.c.next_nominal_at,
                version=s.c.version + 1,
                updated_at=now,
            )
            .returning(s.c.id)
        )
        self.sync_change = (
            update(s)
            .where(same_name, static, definition_changed)
            .values(**define, **_UNBROKEN, version=s.c.version + 1, updated_at=now)
            .returning(s.c.id)
        )
        self.sync_disable = (
            update(s)
            .where(static, s.c.enabled, ~exists().where(t.c.name == s.c.name))
            .values(enabled=False, disabled_at=now, version=s.c.version + 1, updated_at=now)
            .returning(s.c.id)
        )

    def copy_rows(self, conn: Connection, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        """COPY schedule rows (``SCHEDULE_COPY_COLUMNS`` keys) inside ``conn``'s transaction."""
        raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
        names = [name for name, _ in SCHEDULE_COPY_COLUMNS]
        with raw.cursor() as cur:
            cur.adapters.register_dumper(None, _OptionsDumper)
            with cur.copy(sql) as copy:
                copy.set_types(self.copy_types)
                for row in rows:
                    copy.write_row([row[name] for name in names])


def _sql_type(kind: str) -> Any:
    return {
        "uuid": Uuid(as_uuid=True),
        "int8": BigInteger,
        "text": Text,
        "jsonb": postgresql.JSONB,
        "bytea": LargeBinary,
        "float8": Double,
        "int4": Integer,
        "bool": Boolean,
        "timestamptz": DateTime(timezone=True),
    }[kind]


def _occurrence_arrays(jobs: Sequence[NewJob]) -> dict[str, list[Any]]:
    """The ``u_<column>`` array parameters of ``insert_occurrences``."""
    options: dict[int, str] = {}

    def as_json(value: Any) -> str:
        # Occurrences of one schedule share their options mapping.
        text = options.get(id(value))
        if text is None:
            text = options[id(value)] = json.dumps(dict(value)) if value else "{}"
        return text

    return {
        "u_id": [job.id for job in jobs],
        "u_key": [_stored_key(job) for job in jobs],
        "u_task": [job.task for job in jobs],
        "u_body": [job.body for job in jobs],
        "u_content_type": [job.content_type for job in jobs],
        "u_content_encoding": [job.content_encoding for job in jobs],
        "u_argsrepr": [job.argsrepr for job in jobs],
        "u_kwargsrepr": [job.kwargsrepr for job in jobs],
        "u_options": [as_json(job.options) for job in jobs],
        "u_due_at": [job.due_at for job in jobs],
        "u_due_bucket": [job.due_bucket for job in jobs],
        "u_expires_at": [job.expires_at for job in jobs],
        "u_max_attempts": [job.max_attempts for job in jobs],
        "u_shard": [job.shard for job in jobs],
        "u_schedule_id": [job.schedule_id for job in jobs],
        "u_visibility_timeout": [job.visibility_timeout for job in jobs],
        "u_max_runtime": [job.max_runtime for job in jobs],
    }


def _schedule_values(schedule: NewSchedule) -> dict[str, Any]:
    return {
        "name": schedule.name,
        "task": schedule.task,
        "kind": schedule.kind,
        "spec": dict(schedule.spec),
        "body": schedule.body,
        "content_type": schedule.content_type,
        "content_encoding": schedule.content_encoding,
        "argsrepr": schedule.argsrepr,
        "kwargsrepr": schedule.kwargsrepr,
        "options": dict(schedule.options),
        "timezone": schedule.timezone,
        "misfire": schedule.misfire,
        "overlap": schedule.overlap,
        "catchup_window": schedule.catchup_window,
        "max_catchup": schedule.max_catchup,
        "relative": schedule.relative,
        "enabled": schedule.enabled,
        "source": schedule.source,
        "next_nominal_at": schedule.next_nominal_at,
    }


def _definition_values(schedule: NewSchedule) -> dict[str, Any]:
    """What ``replace_schedule`` writes: the definition without ``enabled``."""
    values = _schedule_values(schedule)
    return {name: values[name] for name in DEFINITION_COLUMNS if name != "enabled"}


def _refuse_duplicate_names(rows: Sequence[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for row in rows:
        if row["name"] in seen:
            raise InvalidSchedule(f"schedule name {row['name']!r} is given twice")
        seen.add(row["name"])


def _stored_schedule(row: Row[Any]) -> StoredSchedule:
    values = dict(row._mapping)
    values["overlap"] = values["overlap"] or "allow"
    return StoredSchedule(**values)
