"""The statements people run ``EXPLAIN`` on, in one place, each named.

Claims, requeues (reconciler, rescuer, failed publishes, lost processes),
workers' reports and the idempotency ledger's take and completion: the
statements that run per job or per batch. Each is a function of the schema's
tables whose docstring says what it does; :class:`Statements` builds them
all once per schema (the schema name is substituted into the table names by
:func:`~celery_sched.store.schema.build_metadata`). The rest (reads, counts,
a user's changes, housekeeping, schedules) live beside the methods that run
them. The module is long on purpose: it is the one place to read them.

Why SQLAlchemy Core in one module rather than named blocks in a ``.sql``
file: the statements share pieces that must not drift apart. Every requeue
builds its values with :func:`requeue_values` (one rule for giving up at
``max_attempts``), the claims share the returned columns in ``Job`` field
order, and the ledger's take and the delivery check share the delivery
fence; a ``.sql`` file would spell each of those out again in every block.
Core also renders the bind casts from the table types and keeps the status
literals the partial indexes need in one spelling; and moving the statements
here left the SQL PostgreSQL receives unchanged, byte for byte. To read them as the SQL
PostgreSQL receives, ready to ``EXPLAIN`` (parameters as psycopg's
``%(name)s``, defaults listed below each)::

    python -m celery_sched.store.postgres [--schema NAME] [STATEMENT ...]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    Interval,
    Select,
    SmallInteger,
    Table,
    Text,
    Update,
    all_,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    extract,
    func,
    literal,
    literal_column,
    not_,
    null,
    or_,
    select,
    table,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.elements import ColumnElement

from celery_sched import models
from celery_sched.models import (
    ADOPTABLE_STATUSES,
    FENCED_STATUSES,
    FINISHED_STATUSES,
    JOB_FIELDS,
    UNFINISHED_STATUSES,
    JobStatus,
)
from celery_sched.store.postgres.connection import DIALECT
from celery_sched.store.schema import UNIX_EPOCH, build_metadata, dispatched_keys

# Status literals are rendered into the SQL, not bound: a partial index
# (WHERE status = 'pending') is only usable when the planner can prove the
# predicate, which it cannot for a parameter in a generic prepared plan.
PENDING: ColumnElement[str] = literal_column("'pending'")
DISPATCHED: ColumnElement[str] = literal_column("'dispatched'")
RUNNING: ColumnElement[str] = literal_column("'running'")
RETRYING: ColumnElement[str] = literal_column("'retrying'")
# The ledger's states, rendered too: fewer parameters per hot statement.
LEDGER_RUNNING: ColumnElement[str] = literal_column("'running'")
LEDGER_COMPLETED: ColumnElement[str] = literal_column("'completed'")
_ONE_SECOND = literal_column("interval '1 second'", type_=Interval)
#: The physical address of a row version (claims lock and update by it):
#: ``ctid`` is only unique within one partition, so with the partition's
#: ``tableoid``; and the row's due time, on which the claiming UPDATE prunes
#: every other partition at run time.
ROW_ADDRESS: tuple[ColumnElement[Any], ...] = (
    literal_column("tableoid").label("tableoid"),
    literal_column("ctid").label("ctid"),
)
_DOUBLE = postgresql.DOUBLE_PRECISION
_FINISHED = [status.value for status in FINISHED_STATUSES]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tables:
    """The tables of one schema."""

    jobs: Table
    job_keys: Table
    leaders: Table
    workers: Table
    ledger: Table
    schedules: Table
    placement: Table
    published_claims: Table

    @classmethod
    def of(cls, schema: str) -> Tables:
        tables = build_metadata(schema).tables
        return cls(
            **{field.name: tables[f"{schema}.{field.name}"] for field in dataclasses.fields(cls)}
        )


# -- the pieces ----------------------------------------------------------------


def seconds(value: ColumnElement[Any]) -> ColumnElement[Any]:
    """``value`` seconds as an interval."""
    return value * _ONE_SECOND


def seconds_param(name: str) -> ColumnElement[Any]:
    """The interval of ``name`` seconds, a double precision parameter."""
    return seconds(bindparam(name, type_=_DOUBLE))


def text_array(*values: str) -> Any:
    """``ARRAY[...]`` of text values (for ``= any`` / ``!= all`` tests)."""
    return postgresql.array([literal(value, type_=Text()) for value in values])


def _minute_of(instant: ColumnElement[Any]) -> ColumnElement[int]:
    """The due bucket (whole minutes since the epoch) of a timestamptz expression."""
    return cast(func.floor(extract("epoch", instant) / 60), Integer)


def job_key(jobs: Table) -> ColumnElement[str]:
    """A job's key as every read presents it.

    A job whose key is its id stores NULL in ``key`` (0003); reads present
    the id's text instead.
    """
    return func.coalesce(jobs.c.key, cast(jobs.c.id, Text)).label("key")


def job_columns(jobs: Table) -> list[Any]:
    """The columns of a :class:`~celery_sched.models.Job`, ``key`` as :func:`job_key`."""
    return [job_key(jobs) if column.name == "key" else column for column in jobs.c]


def key_matches(jobs: Table) -> ColumnElement[bool]:
    """The row of key ``p_key``: a row with that text key or, when the key is
    a UUID in canonical text (``p_key_id``, else NULL), the row with that id
    and no text key of its own."""
    c = jobs.c
    return or_(
        c.key == bindparam("p_key"),
        and_(c.key.is_(None), c.id == bindparam("p_key_id", type_=c.id.type)),
    )


def requeue_values(jobs: Table, why: str, *args: Any) -> dict[str, Any]:
    """The values of every requeue (reconciler, failed publish, lost
    process): pending again with ``attempt + 1``, or ``dead`` once that
    reaches ``max_attempts``; ``last_error`` is ``why`` (a ``format()``
    string over ``args``) with the attempt count after it."""
    c = jobs.c
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


#: :data:`celery_sched.models.SENT_DUE_MARGIN` in SQL: a job a worker
#: reports on by its id is due by now plus the margin.
SENT_DUE_MARGIN = literal_column(
    f"interval '{round(models.SENT_DUE_MARGIN.total_seconds())} seconds'", type_=Interval
)


def due_between(jobs: Table) -> ColumnElement[bool]:
    """``p_due_from <= due_at <= p_due_to``: the due times of the jobs a
    statement by id names (the leader's claimed jobs, a message's
    ``celery_sched_due`` header).

    The bounds are values, so the planner of an unprepared statement leaves
    every partition outside them out of the plan, and PostgreSQL locks only
    the partitions left (one, for one job) and their indexes. Prepared, the
    generic plan would hold every partition: ``now()`` or a parameter
    prunes only when the executor starts, after locking each partition and
    each of its indexes (1,700 locks with 133 partitions; 64 per connection
    fit the server's shared lock table by default). So these statements
    always run with ``prepare=False``."""
    due = jobs.c.due_at
    return and_(
        due >= bindparam("p_due_from", type_=due.type),
        due <= bindparam("p_due_to", type_=due.type),
    )


def sent_due(jobs: Table) -> ColumnElement[bool]:
    """The bound of :data:`SENT_DUE_MARGIN` on ``jobs.due_at``: for a worker's
    report or delivery check of a message without the ``celery_sched_due``
    header (sent before it existed). PostgreSQL skips the partitions of later
    days when the statement starts, but locks every partition first; these
    variants stay prepared (planning them over every partition each time
    would cost more than the locks)."""
    return jobs.c.due_at <= func.now() + SENT_DUE_MARGIN


#: The due-time test of a statement by id: :func:`due_between` or :func:`sent_due`.
DueTest = Callable[[Table], ColumnElement[bool]]


def claim_horizon(jobs: Table) -> ColumnElement[bool]:
    """``due_at <= p_horizon``: the database's now() as the epoch fence read
    it in the claim's transaction, as a value. Claims hold ``due_at <=
    now()`` too, and now() is the transaction's start, so the two bounds are
    the same instant; this one is a constant to the planner, which leaves
    every partition of a later day out of the claim's plan (``now()`` prunes
    only when the statement starts, after planning over all of them: ~30 ms
    a claim with a month of daily partitions). It was now plus
    :data:`SENT_DUE_MARGIN` (a day) until issue #31: tomorrow's partition,
    with a day of future jobs, stayed in every claim's plan and result
    relations."""
    return jobs.c.due_at <= bindparam("p_horizon", type_=jobs.c.due_at.type)


def same_row(jobs: Table, chosen: Any) -> tuple[ColumnElement[bool], ...]:
    """``jobs``' row is the one ``chosen`` (a subquery of :data:`ROW_ADDRESS`
    and ``due_at``) addressed: found by TID in its own partition, which the
    due time picks at run time (the others are never scanned)."""
    table = DIALECT.identifier_preparer.format_table(jobs)
    return (
        jobs.c.due_at == chosen.c.due_at,
        literal_column(f"{table}.tableoid") == chosen.c.tableoid,
        literal_column(f"{table}.ctid") == chosen.c.ctid,
    )


def _claim(jobs: Table, chosen: Any, *recheck: ColumnElement[bool]) -> Update:
    # Where a claim's server time goes (issue #31, 1M future jobs, 1,000
    # rows a claim, EXPLAIN (ANALYZE, BUFFERS, WAL) and the backends' CPU
    # in benchmarks/claim.py): ~0.5 ms finding and locking the rows, ~7 ms
    # updating them, ~8-9 us of server CPU per row in all, five WAL records
    # per row (the lock, the new row version, and an entry in each of the
    # three indexes it enters: the primary key, jobs_due_idx and
    # jobs_dispatched_idx). No claim is a HOT update and none can be while
    # it moves the row out of the partial pending index the next claim
    # scans: status (and dispatched_at) are index columns or predicates, and
    # a claim mark in an unindexed column would leave claimed rows in that
    # index for every later claim to walk past. A HOT claim needs the queue
    # out of jobs' indexes altogether (a narrow queue table the claim
    # deletes from, with jobs' status indexes rebuilt around it): left for a
    # schema change of its own.
    c = jobs.c
    # The subquery locked these exact row versions (FOR UPDATE), so
    # nobody can change them before this statement does: joining on the
    # physical row address (a TID scan in the row's own partition, found
    # by its due time) is safe and saves a primary key probe per row.
    # Should a row have been updated between the statement's snapshot
    # and its lock, the TID scan does not see the new version and the row
    # is simply not claimed this time.
    # Options come back as text: most claimed jobs share a handful of
    # option sets, which the store decodes once per batch instead of
    # running the JSON loader per row.
    # In Job field order, so rows load without reordering.
    returned = [
        cast(c.options, Text).label("options")
        if name == "options"
        else job_key(jobs)
        if name == "key"
        else c[name]
        for name in JOB_FIELDS
    ]
    return (
        update(jobs)
        .where(*same_row(jobs, chosen), *recheck)
        .values(
            status="dispatched",
            dispatched_at=func.now(),
            leader_epoch=bindparam("p_epoch"),
            claim_id=bindparam("p_claim", type_=c.claim_id.type),
        )
        .returning(*returned)
    )


def _ids(jobs: Table, name: str) -> Any:
    return bindparam(name, type_=postgresql.ARRAY(jobs.c.id.type))


# -- claims (the hot path) -------------------------------------------------------


def claim_due(t: Tables) -> Update:
    """Claim up to ``p_limit`` due pending jobs of shard ``p_shard`` for epoch
    ``p_epoch``, oldest due first, skipping rows another claimer holds."""
    c = t.jobs.c
    now = func.now()
    # The scan walks the partial pending index of one shard in due order
    # and stops at the current minute, so future rows are never read. (A
    # row moved to another shard meanwhile fails the re-checked shard test,
    # as in claim_ids.)
    due_ids = (
        select(*ROW_ADDRESS, c.due_at)
        .where(
            c.status == PENDING,
            c.shard == bindparam("p_shard"),
            c.due_bucket <= _minute_of(now),
            c.due_at <= now,
            claim_horizon(t.jobs),
        )
        .order_by(c.due_bucket, c.due_at)
        .limit(bindparam("p_limit"))
        .with_for_update(skip_locked=True)
        .subquery("due")
    )
    return _claim(t.jobs, due_ids, claim_horizon(t.jobs))


def claim_ids(t: Tables) -> Update:
    """Claim the jobs ``ids`` of shard ``p_shard`` that are pending and due,
    for epoch ``p_epoch`` (the staged ids a leader pops)."""
    c = t.jobs.c
    now = func.now()
    # The ids are found by primary key only: with the status test in
    # this subquery the planner may pick the partial pending index
    # instead (it does on a freshly loaded table with no statistics) and
    # read the whole backlog per batch. The outer UPDATE re-checks
    # status and due-ness on the locked row.
    # The shard test is what keeps a staged id safe across a change of the
    # shard count: a row moved to another shard (rehome) since it was
    # staged fails it, and FOR UPDATE re-checks it on the row's latest
    # version when the move commits first (or waits for the move when it
    # holds the row), so the old shard's leader never claims it; the new
    # shard's sweep or staging does, once.
    given_ids = (
        select(*ROW_ADDRESS, c.due_at)
        .where(
            c.id == any_(_ids(t.jobs, "ids")),
            c.shard == bindparam("p_shard"),
            claim_horizon(t.jobs),
        )
        .with_for_update(skip_locked=True)
        .subquery("given")
    )
    return _claim(t.jobs, given_ids, c.status == PENDING, c.due_at <= now, claim_horizon(t.jobs))


def _due_soon_tests(t: Tables) -> tuple[ColumnElement[bool], ...]:
    c = t.jobs.c
    horizon = func.now() + seconds_param("within")
    return (
        c.status == PENDING,
        c.shard == bindparam("p_shard"),
        c.due_bucket <= _minute_of(horizon),
        c.due_at <= horizon,
    )


def due_soon(t: Tables) -> Select[Any]:
    """``(id, due_at)`` of the pending jobs of ``p_shard`` due within
    ``within`` seconds (overdue ones included), in due order, at most
    ``p_limit`` (what staging copies to Redis)."""
    c = t.jobs.c
    return (
        select(c.id, c.due_at)
        .where(*_due_soon_tests(t))
        .order_by(c.due_bucket, c.due_at)
        .limit(bindparam("p_limit"))
    )


def due_soon_after(t: Tables) -> Select[Any]:
    """:func:`due_soon`, only those due after ``after`` (incremental staging)."""
    c = t.jobs.c
    # The lower bucket bound lets the index scan start at ``after`` instead
    # of at the oldest pending row.
    after = bindparam("after", type_=c.due_at.type)
    return (
        select(c.id, c.due_at)
        .where(*_due_soon_tests(t), c.due_bucket >= bindparam("after_bucket"), c.due_at > after)
        .order_by(c.due_bucket, c.due_at)
        .limit(bindparam("p_limit"))
    )


def oldest_due_pending(t: Tables) -> Select[Any]:
    """The due time of the oldest pending job of shard ``p_shard`` that is
    due (the leader's backlog gauge); no row when none is."""
    c = t.jobs.c
    now = func.now()
    # The first entry of the shard's partial pending index, the same scan a
    # claim starts with: one index probe however many rows are stored.
    return (
        select(c.due_at)
        .where(
            c.status == PENDING,
            c.shard == bindparam("p_shard"),
            c.due_bucket <= _minute_of(now),
            c.due_at <= now,
        )
        .order_by(c.due_bucket, c.due_at)
        .limit(1)
    )


# -- fenced dispatch transitions ---------------------------------------------------


def _fenced(t: Tables) -> tuple[ColumnElement[bool], ...]:
    c = t.jobs.c
    return (
        c.id == any_(_ids(t.jobs, "ids")),
        due_between(t.jobs),
        c.status == DISPATCHED,
        c.leader_epoch == bindparam("p_epoch"),
    )


def release(t: Tables) -> Update:
    """dispatched -> pending for the jobs ``ids`` epoch ``p_epoch`` claimed
    but could not publish."""
    return update(t.jobs).where(*_fenced(t)).values(status="pending", dispatched_at=None)


def mark_expired(t: Tables) -> Update:
    """dispatched -> expired for the jobs ``ids`` of epoch ``p_epoch`` whose
    ``expires_at`` has passed, with ``reason``."""
    c = t.jobs.c
    now = func.now()
    # Expiry re-checked by the database's clock: a leader whose clock ran
    # ahead (a wall-clock step) must not expire a job early.
    return (
        update(t.jobs)
        .where(*_fenced(t), c.expires_at <= now)
        .values(status="expired", finished_at=now, last_error=bindparam("reason"))
    )


def fail_dispatch(t: Tables) -> Update:
    """Requeue the jobs ``f_ids`` of epoch ``p_epoch`` whose own message
    could not be published, each with its reason in ``f_reasons``."""
    c = t.jobs.c
    # One attempt used, as the reconciler counts one (the same rule for
    # giving up). The reasons come as an array parallel to the ids,
    # unnested in lockstep.
    failed = (
        func.unnest(
            _ids(t.jobs, "f_ids"),
            bindparam("f_reasons", type_=postgresql.ARRAY(Text)),
        )
        .table_valued("id", "reason")
        .render_derived(name="failed", with_types=False)
    )
    return (
        update(t.jobs)
        .where(
            c.id == failed.c.id,
            due_between(t.jobs),
            c.status == DISPATCHED,
            c.leader_epoch == bindparam("p_epoch"),
        )
        .values(**requeue_values(t.jobs, "not published: %s", failed.c.reason))
        .returning(c.status)
    )


def mark_missed(t: Tables) -> Update:
    """dispatched -> missed for the jobs ``f_ids`` of epoch ``p_epoch`` that
    were never sent (``attempt = 0``), each with its reason in ``f_reasons``
    (occurrences the misfire policy drops at their first dispatch)."""
    c = t.jobs.c
    dropped = (
        func.unnest(
            _ids(t.jobs, "f_ids"),
            bindparam("f_reasons", type_=postgresql.ARRAY(Text)),
        )
        .table_valued("id", "reason")
        .render_derived(name="dropped", with_types=False)
    )
    # attempt = 0: a requeue (of a job sent before) follows max_attempts,
    # never the misfire policy, whatever the caller passed.
    return (
        update(t.jobs)
        .where(
            c.id == dropped.c.id,
            due_between(t.jobs),
            c.status == DISPATCHED,
            c.leader_epoch == bindparam("p_epoch"),
            c.attempt == 0,
        )
        .values(status="missed", finished_at=func.now(), last_error=dropped.c.reason)
        .returning(c.id)
    )


def unfinished_by_shard(t: Tables) -> Any:
    """Per shard ``>= from_shard`` and unfinished status, the count of jobs."""
    c = t.jobs.c
    # Rows left in shards a lowered shard count no longer leads. One
    # branch per status, the literal status letting each use its partial
    # index (pending's leads with shard; the others are small).
    from_shard = bindparam("from_shard", type_=c.shard.type)
    return union_all(
        *(
            select(c.shard, literal(status, type_=Text()), func.count())
            .where(c.status == literal_column(f"'{status}'"), c.shard >= from_shard)
            .group_by(c.shard)
            for status in sorted(UNFINISHED_STATUSES)
        )
    )


# -- a changed shard count ----------------------------------------------------------

_UNFINISHED = sorted(status.value for status in UNFINISHED_STATUSES)


def _rehome_columns(t: Tables) -> tuple[Any, ...]:
    c = t.jobs.c
    # The key as the client hashed it: a keyless job's key is its id's text.
    return (c.id, job_key(t.jobs), c.shard, c.status, c.due_at)


def next_stranded_shard(t: Tables) -> Select[Any]:
    """The lowest shard above ``p_after`` holding pending jobs (NULL: none)."""
    c = t.jobs.c
    # min() over the pending index, which leads with shard: one probe per
    # stranded shard however many rows each holds (a loose index scan).
    return select(func.min(c.shard)).where(c.status == PENDING, c.shard > bindparam("p_after"))


def stranded_pending(t: Tables) -> Select[Any]:
    """Up to ``p_limit`` pending jobs of shard ``p_shard``, soonest due first
    (a stranded shard's rows to move, read from its pending index in order)."""
    c = t.jobs.c
    return (
        select(*_rehome_columns(t))
        .where(c.status == PENDING, c.shard == bindparam("p_shard"))
        .order_by(c.due_bucket, c.due_at)
        .limit(bindparam("p_limit"))
    )


def stranded_in_flight(t: Tables) -> Select[Any]:
    """Up to ``p_limit`` dispatched, running or retrying jobs in shards
    ``>= p_shards``, soonest due first."""
    c = t.jobs.c
    # One branch per status, each reading that status's partial index (only
    # the jobs in flight). One test of "status IN (...)" matches none of
    # those indexes: PostgreSQL read every partition whole instead (1.7 s a
    # look with 10M future jobs stored, every 30 s on shard 0's leader).
    p_shards = bindparam("p_shards", type_=c.shard.type)
    in_flight = union_all(
        *(
            select(*_rehome_columns(t)).where(status == c.status, c.shard >= p_shards)
            for status in (DISPATCHED, RUNNING, RETRYING)
        )
    ).subquery("in_flight")
    return select(in_flight).order_by(in_flight.c.due_at).limit(bindparam("p_limit"))


def _unfinished_in_id_order(t: Tables, *tests: ColumnElement[bool]) -> Select[Any]:
    c = t.jobs.c
    return (
        select(*_rehome_columns(t))
        .where(c.status.in_([literal_column(f"'{status}'") for status in _UNFINISHED]), *tests)
        .order_by(c.id)
        .limit(bindparam("p_limit"))
    )


def unfinished_first_page(t: Tables) -> Select[Any]:
    """The first ``p_limit`` unfinished jobs in id order: the first page of
    a full resharding pass."""
    return _unfinished_in_id_order(t)


def unfinished_page(t: Tables) -> Select[Any]:
    """Up to ``p_limit`` unfinished jobs with ids above ``p_after``, in id
    order: the next page of a full resharding pass."""
    # Keyset paging by primary key: each page is an index range of its own
    # size, and a pass reads every row once however long it takes. (Two
    # statements rather than "p_after IS NULL OR ...", which a generic plan
    # could not turn into an index range.)
    c = t.jobs.c
    return _unfinished_in_id_order(t, c.id > bindparam("p_after", type_=c.id.type))


def rehome(t: Tables) -> Update:
    """Move the jobs ``r_ids`` from shard ``r_from`` to ``r_to`` (parallel
    arrays), each only if it is still unfinished and still in ``r_from``;
    returns the ids moved."""
    c = t.jobs.c
    # (UPDATE ... FROM unnest(...), as fail_dispatch does: one named
    # statement for any batch size, where a VALUES list would be another
    # statement per length.) A row a claim, the reconciler or a worker's
    # report holds locked is waited for; READ COMMITTED then re-checks this
    # WHERE on its latest version, so a row that finished meanwhile stays
    # where it is and one claimed meanwhile moves dispatched (the new
    # shard's reconciler takes over from there).
    moves = (
        func.unnest(
            _ids(t.jobs, "r_ids"),
            bindparam("r_from", type_=postgresql.ARRAY(Integer)),
            bindparam("r_to", type_=postgresql.ARRAY(Integer)),
        )
        .table_valued("id", "from_shard", "to_shard")
        .render_derived(name="moves", with_types=False)
    )
    return (
        update(t.jobs)
        .where(
            c.id == moves.c.id,
            c.shard == moves.c.from_shard,
            c.status.in_([literal_column(f"'{status}'") for status in _UNFINISHED]),
        )
        .values(shard=moves.c.to_shard)
        .returning(c.id)
    )


# -- the reconciler and the rescuer ----------------------------------------------


def _visibility_timeout(t: Tables) -> ColumnElement[Any]:
    return func.coalesce(t.jobs.c.visibility_timeout, bindparam("default_timeout", type_=_DOUBLE))


def _oldest(
    t: Tables, name: str, status: ColumnElement[str], *tests: ColumnElement[bool], by: Any
) -> Any:
    """Up to ``p_limit`` ids of shard ``p_shard``'s jobs in ``status`` that
    pass ``tests``, oldest ``by`` first, locked (rows locked elsewhere are
    skipped): the subquery ``name`` of a requeue."""
    c = t.jobs.c
    return (
        select(*ROW_ADDRESS, c.due_at)
        .where(c.status == status, c.shard == bindparam("p_shard"), *tests)
        .order_by(by)
        .limit(bindparam("p_limit"))
        .with_for_update(skip_locked=True)
        .subquery(name)
    )


def _requeue(t: Tables, chosen: Any, why: str, *args: Any) -> Update:
    """Requeue the jobs ``chosen`` (see :func:`requeue_values`), returning their new status."""
    c = t.jobs.c
    return (
        update(t.jobs)
        .where(*same_row(t.jobs, chosen))
        .values(**requeue_values(t.jobs, why, *args))
        .returning(c.status)
    )


def _tracked(t: Tables) -> ColumnElement[bool]:
    """Whether some worker process tracks the job's task: a heartbeat row
    (live or not yet pruned) lists it, or has no list (a worker of before
    0006, which tracks every task). Only then can a requeue be told apart
    from a run nobody reported."""
    w = t.workers.c
    return exists().where(or_(w.tasks.is_(None), t.jobs.c.task == any_(w.tasks)))


def _published(t: Tables) -> ColumnElement[bool]:
    """Whether the job's claim went out: recorded in ``published_claims``
    after its publish, or claimed before 0013 (no ``claim_id``: the old rule,
    which took every claimed job for sent)."""
    c = t.jobs.c
    p = t.published_claims.c
    return or_(c.claim_id.is_(None), exists().where(p.claim_id == c.claim_id))


def requeue_dispatched(t: Tables) -> Update:
    """Requeue up to ``p_limit`` jobs of ``p_shard`` dispatched longer ago
    than their visibility timeout (``default_timeout`` when unset) whose
    task some worker tracks, or whose claim never went out."""
    # A job whose claim was never recorded as published was, as far as
    # anyone can tell, never sent (its beat died between claim and publish,
    # or the claim's COMMIT was lost and the claim retried): requeuing it
    # cannot run it twice, whoever tracks its task.
    stale = _stale_dispatched(t, "stale", or_(_tracked(t), not_(_published(t))))
    return _requeue(t, stale, "not started within %ss of dispatch", _visibility_timeout(t))


#: Seconds past the index bound the reconciler's ranges read: the bound is
#: Unix seconds in double precision, the exact test (kept beside it) is in
#: microseconds, so a row at the edge is read and the exact test decides.
_STALE_SLACK: ColumnElement[Any] = literal_column("0.001")


def _stale_dispatched(t: Tables, name: str, tracked: ColumnElement[bool]) -> Any:
    """Up to ``p_limit`` of shard ``p_shard``'s dispatched jobs past their
    visibility timeout that pass ``tracked``, those that went stale first,
    locked (rows locked elsewhere are skipped): the subquery ``name`` of a
    requeue."""
    # Measured (issue #31): "dispatched_at < now() - coalesce(
    # visibility_timeout, default)" bounds each row by its own timeout, so
    # no index range can hold it and every pass walked every dispatched row
    # (of every shard: the index had no shard), stale or not: 0.5 us a row,
    # 140-165 ms a pass with 300,000 in flight (10,000 jobs/s untracked),
    # the leader's claims waiting meanwhile. jobs_dispatched_idx (0015) now
    # keys each shard's rows by when they go stale, in two runs: jobs
    # without a timeout of their own (stale past now - default) and jobs
    # with one (stale past now). Each run is one index range over stale rows
    # only, at most p_limit of them read in order; the exact test is kept
    # beside the index bound. A pass costs its stale rows and two index
    # descents per partition, whatever is in flight and whatever timeouts
    # jobs carry. (Bounding one range by the smallest timeout in flight
    # would walk everything again as soon as one job carried a short one.)
    c = t.jobs.c
    shard: ColumnElement[Any] = bindparam("p_shard")
    limit: ColumnElement[Any] = bindparam("p_limit")
    timeout = _visibility_timeout(t)
    stale_at = c.dispatched_at + seconds(timeout)
    exact = c.dispatched_at < func.now() - seconds(timeout)
    no_own_timeout, stale_key = dispatched_keys(t.jobs)
    now_key = func.date_part(literal_column("'epoch'"), func.now() - UNIX_EPOCH)

    def run_of(kind: int, bound: ColumnElement[Any]) -> Select[Any]:
        return (
            select(*ROW_ADDRESS, c.due_at)
            .where(
                c.status == DISPATCHED,
                c.shard == shard,
                no_own_timeout == literal_column(str(kind)),
                stale_key < bound + _STALE_SLACK,
                exact,
                tracked,
            )
            .order_by(stale_key)
            .limit(limit)
        )

    default = bindparam("default_timeout", type_=_DOUBLE)
    candidates = union_all(run_of(1, now_key - default), run_of(0, now_key)).subquery(
        f"{name}_runs"
    )
    table = DIALECT.identifier_preparer.format_table(t.jobs)
    return (
        select(
            literal_column(f"{table}.tableoid").label("tableoid"),
            literal_column(f"{table}.ctid").label("ctid"),
            c.due_at,
        )
        # Checked again on the row locked: it may have moved since the
        # statement's snapshot (READ COMMITTED re-reads it).
        .where(
            *same_row(t.jobs, candidates), c.status == DISPATCHED, c.shard == shard, exact, tracked
        )
        .order_by(stale_at)
        .limit(limit)
        .with_for_update(skip_locked=True, of=t.jobs)
        .subquery(name)
    )


def mark_untracked(t: Tables) -> Update:
    """Mark ``sent`` up to ``p_limit`` jobs of ``p_shard`` dispatched longer
    ago than their visibility timeout whose task no worker tracks and whose
    claim went out: nothing would report their run, so a requeue could only
    run them twice."""
    c = t.jobs.c
    stale = _stale_dispatched(t, "untracked", and_(not_(_tracked(t)), _published(t)))
    return (
        update(t.jobs)
        .where(*same_row(t.jobs, stale))
        .values(
            status="sent",
            finished_at=func.now(),
            last_error=func.format(
                "sent once; no worker tracks task %s (celery_sched.tracking.install), "
                "so it is not sent again",
                c.task,
            ),
        )
        .returning(c.status)
    )


def record_published(t: Tables) -> Any:
    """Record that the claims ``p_claims`` of shard ``p_shard`` went out
    (each once; a repeat is a no-op)."""
    p = t.published_claims
    claims = (
        func.unnest(bindparam("p_claims", type_=postgresql.ARRAY(BigInteger)))
        .table_valued("claim_id")
        .render_derived(name="claims", with_types=False)
    )
    return (
        pg_insert(p)
        .from_select(
            ["claim_id", "shard"],
            select(claims.c.claim_id, bindparam("p_shard", type_=SmallInteger)),
        )
        .on_conflict_do_nothing()
    )


def prune_published(t: Tables) -> Any:
    """Delete the records of claims published longer than ``older_than``
    seconds ago (by ``published_claims_at_idx``)."""
    p = t.published_claims
    return delete(p).where(p.c.published_at < func.now() - seconds_param("older_than"))


def requeue_retrying(t: Tables) -> Update:
    """Requeue up to ``p_limit`` retrying jobs of ``p_shard`` whose retry
    was due longer ago than their visibility timeout."""
    c = t.jobs.c
    now = func.now()
    timeout = _visibility_timeout(t)
    # A retrying job's dispatched_at is when its retry message is due
    # (set by the retrying report): one that has not started a
    # visibility timeout later was lost with the broker, and nothing
    # else would ever send it again. A late retry message carries the
    # older attempt and is fenced on the worker.
    stale = _oldest(
        t,
        "stale_retry",
        RETRYING,
        # Implied by the next test (timeouts are positive); bounds the scan
        # of jobs_retrying_idx to retries already due.
        c.dispatched_at < now,
        c.dispatched_at < now - seconds(timeout),
        by=c.dispatched_at,
    )
    return _requeue(
        t, stale, "its retry did not start within %ss of its ETA %s", timeout, c.dispatched_at
    )


def requeue_running(t: Tables) -> Update:
    """Requeue up to ``p_limit`` running jobs of ``p_shard`` past their
    ``max_runtime``."""
    c = t.jobs.c
    overrunning = _oldest(
        t,
        "overrunning",
        RUNNING,
        c.max_runtime.is_not(None),
        c.started_at < func.now() - seconds(c.max_runtime),
        by=c.started_at,
    )
    return _requeue(
        t,
        overrunning,
        "ran longer than max_runtime %ss on %s",
        c.max_runtime,
        func.coalesce(c.worker, "an unknown worker"),
    )


def rescue(t: Tables) -> Update:
    """Rescue up to ``p_limit`` running jobs of ``p_shard`` whose worker
    process stopped beating ``p_worker_timeout`` seconds ago: succeeded when
    the ledger records the job completed, requeued otherwise."""
    c = t.jobs.c
    w = t.workers.c
    now = func.now()
    gives_up = c.attempt + 1 >= c.max_attempts  # the rescuer gives up as a requeue does
    silent_since = now - seconds_param("p_worker_timeout")
    # A job started without a pid (an older worker) matches every
    # process of its host.
    its_process = and_(w.hostname == c.worker, or_(c.worker_pid.is_(None), w.pid == c.worker_pid))
    # The ledger entry of a celery_sched.Task job records the job it
    # completed for; its key is the job key by default. A primary key
    # probe per rescued row.
    completed = exists().where(
        t.ledger.c.key == func.coalesce(c.key, cast(c.id, Text)),
        t.ledger.c.job_id == c.id,
        t.ledger.c.state == literal_column("'completed'"),
    )
    orphaned = (
        select(
            *ROW_ADDRESS,
            c.due_at,
            completed.label("done"),
            select(func.max(w.seen_at)).where(its_process).scalar_subquery().label("seen"),
        )
        .where(
            c.status == RUNNING,
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
        .with_for_update(of=t.jobs, skip_locked=True)
        .subquery("orphaned")
    )
    done = orphaned.c.done
    return (
        update(t.jobs)
        .where(*same_row(t.jobs, orphaned))
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
                bindparam("p_worker_timeout", type_=_DOUBLE),
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


# -- workers' reports ----------------------------------------------------------------


def heartbeat(t: Tables) -> Any:
    """Worker process ``(p_hostname, p_pid)`` is alive (``p_first``: its first
    beat) and tracks the jobs of tasks ``p_tasks`` (NULL: every task)."""
    w = t.workers.c
    now = func.now()
    tasks = bindparam("p_tasks", type_=postgresql.ARRAY(Text))
    # A process's first beat (re)sets started_at: a reused pid is a new
    # process, and jobs started before it are not running in it.
    return (
        pg_insert(t.workers)
        .values(hostname=bindparam("p_hostname"), pid=bindparam("p_pid"), tasks=tasks)
        .on_conflict_do_update(
            index_elements=[w.hostname, w.pid],
            set_={
                "seen_at": now,
                "tasks": tasks,
                "started_at": case((bindparam("p_first", type_=Boolean), now), else_=w.started_at),
            },
        )
    )


def _adopted(jobs: Table) -> ColumnElement[bool]:
    # A running row without a worker was taken over by an older copy of
    # its message (the delivery fence's adoption, which runs before the
    # pool picks a process): its first start report names the process.
    return and_(jobs.c.status == "running", jobs.c.worker.is_(None))


def mark_running(t: Tables, due: DueTest = due_between) -> Update:
    """Job ``p_id`` started on worker ``p_worker`` (process ``p_worker_pid``)."""
    c = t.jobs.c
    adopted = _adopted(t.jobs)
    return (
        update(t.jobs)
        .where(
            c.id == bindparam("p_id"),
            due(t.jobs),
            or_(c.status == any_(text_array("dispatched", "retrying", "pending")), adopted),
        )
        .values(
            status="running",
            started_at=case((adopted, c.started_at), else_=func.now()),
            worker=bindparam("p_worker"),
            worker_pid=bindparam("p_worker_pid", type_=Integer),
        )
    )


def mark_finished(t: Tables, due: DueTest = due_between) -> Update:
    """Job ``p_id`` finished with status ``p_status`` and ``error``."""
    c = t.jobs.c
    return (
        update(t.jobs)
        .where(
            c.id == bindparam("p_id"), due(t.jobs), c.status != all_(text_array(*sorted(_FINISHED)))
        )
        .values(
            status=bindparam("p_status"),
            finished_at=func.now(),
            last_error=bindparam("error", type_=c.last_error.type),
        )
    )


def mark_retrying(t: Tables, due: DueTest = due_between) -> Update:
    """Running job ``p_id`` retries in ``p_retry_in`` seconds, after ``error``."""
    c = t.jobs.c
    # A retrying job's dispatched_at is when its retry is due (the
    # reconciler requeues it once that is a visibility timeout past).
    return (
        update(t.jobs)
        .where(c.id == bindparam("p_id"), due(t.jobs), c.status == "running")
        .values(
            status="retrying",
            dispatched_at=func.now()
            + seconds(func.coalesce(bindparam("p_retry_in", type_=_DOUBLE), 0.0)),
            last_error=bindparam("error", type_=c.last_error.type),
        )
    )


# The same transitions for batched worker reports: one statement per
# kind, its rows passed as parallel arrays (one parameter each, so a
# batch costs the client a few list appends per report, not a
# statement). Each array holds an id at most once.


def _reported(jobs: Table, **columns: str) -> Any:
    """``unnest(:p_ids, :p_x, ..., :p_dues) AS reported(id, x, ..., due)``:
    one row per report, the last column its job's due time (text)."""
    texts = postgresql.ARRAY(Text)
    columns = {**columns, "due": "p_dues"}
    arrays = [bindparam(param, type_=texts) for param in columns.values()]
    return (
        func.unnest(_ids(jobs, "p_ids"), *arrays)
        .table_valued("id", *columns)
        .render_derived(name="reported", with_types=False)
    )


def _report_of(jobs: Table, reported: Any, due: DueTest) -> tuple[ColumnElement[bool], ...]:
    """``jobs``' row is the one a ``reported`` row is about: its id, and its
    due time when the report names one (a message with the due header),
    within the statement's own due-time test ``due``."""
    c = jobs.c
    return (
        c.id == reported.c.id,
        due(jobs),
        or_(reported.c.due.is_(None), c.due_at == cast(reported.c.due, c.due_at.type)),
    )


def batch_running(t: Tables, due: DueTest = due_between) -> Update:
    """Jobs started: ``p_ids`` with ``p_workers``, ``p_pids`` and ``p_attempts``."""
    c = t.jobs.c
    adopted = _adopted(t.jobs)
    running = _reported(t.jobs, worker="p_workers", worker_pid="p_pids", attempt="p_attempts")
    return (
        update(t.jobs)
        .where(
            *_report_of(t.jobs, running, due),
            or_(c.status == any_(text_array("dispatched", "retrying", "pending")), adopted),
            # A delivery of an older attempt (the job was requeued since)
            # must not move the row: the new attempt could not be claimed.
            or_(running.c.attempt.is_(None), c.attempt <= cast(running.c.attempt, Integer)),
        )
        .values(
            status="running",
            started_at=case((adopted, c.started_at), else_=func.now()),
            worker=running.c.worker,
            worker_pid=cast(running.c.worker_pid, Integer),
        )
    )


def batch_retrying(t: Tables, due: DueTest = due_between) -> Update:
    """Jobs retrying: ``p_ids`` with ``p_errors`` and ``p_retry_ins``."""
    c = t.jobs.c
    retrying = _reported(t.jobs, error="p_errors", retry_in="p_retry_ins")
    retry_in = cast(retrying.c.retry_in, _DOUBLE)
    return (
        update(t.jobs)
        .where(*_report_of(t.jobs, retrying, due), c.status == "running")
        .values(
            status="retrying",
            dispatched_at=func.now() + seconds(func.coalesce(retry_in, 0.0)),
            last_error=retrying.c.error,
        )
    )


def batch_finished(t: Tables, due: DueTest = due_between) -> Update:
    """Jobs finished: ``p_ids`` with ``p_statuses`` and ``p_errors``."""
    c = t.jobs.c
    ended = _reported(t.jobs, status="p_statuses", error="p_errors")
    return (
        update(t.jobs)
        .where(
            *_report_of(t.jobs, ended, due),
            c.status != all_(text_array(*sorted(_FINISHED))),
        )
        .values(status=ended.c.status, finished_at=func.now(), last_error=ended.c.error)
    )


def batch_ran(t: Tables, due: DueTest = due_between) -> Update:
    """Jobs started and finished in one batch: ``p_ids`` with ``p_workers``,
    ``p_pids``, ``p_statuses`` and ``p_errors``; returns per row whether its
    start applied too."""
    c = t.jobs.c
    now = func.now()
    adopted = _adopted(t.jobs)
    # A job whose start and finish arrive in one batch (a short task)
    # takes both transitions in one row update instead of two: the same
    # end state as running then finished, half the row versions.
    ran = _reported(
        t.jobs, worker="p_workers", worker_pid="p_pids", status="p_statuses", error="p_errors"
    )
    was_running = c.status == "running"
    return (
        update(t.jobs)
        .where(*_report_of(t.jobs, ran, due), c.status != all_(text_array(*sorted(_FINISHED))))
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


def batch_lost(t: Tables, due: DueTest = due_between) -> Update:
    """Jobs whose worker process was lost: ``p_ids`` with ``p_errors`` and
    ``p_attempts``, requeued at once unless the job has moved on (a later
    attempt)."""
    c = t.jobs.c
    lost = _reported(t.jobs, error="p_errors", attempt="p_attempts")
    return (
        update(t.jobs)
        .where(
            *_report_of(t.jobs, lost, due),
            c.status == any_(text_array("dispatched", "running")),
            or_(lost.c.attempt.is_(None), c.attempt == cast(lost.c.attempt, Integer)),
        )
        .values(**requeue_values(t.jobs, "%s", lost.c.error))
    )


# -- the idempotency ledger's take and completion ---------------------------------


def _sql(text: str) -> ColumnElement[Any]:
    return literal_column(text)


def _literals(statuses: Iterable[JobStatus]) -> list[ColumnElement[Any]]:
    # Rendered into the SQL, so the planner sees the values.
    return [literal_column(f"'{status.value}'") for status in sorted(statuses)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DeliveryFence:
    """The delivery fence (models.delivery_fence, in SQL) as CTEs."""

    job: Any
    adopted: Any
    fenced: ColumnElement[bool]
    verdict: tuple[Any, ...]


def _delivery_fence(t: Tables, due: DueTest) -> _DeliveryFence:
    jobs = t.jobs
    # The job row by primary key, read in the same statement as the take.
    # No job row (pruned, or not a celery_sched message) fences nothing.
    job_id = bindparam("p_job_id", type_=jobs.c.id.type)
    delivered = bindparam("p_attempt", type_=Integer)
    job = (
        select(jobs.c.status, jobs.c.attempt, jobs.c.due_at)
        .where(jobs.c.id == job_id, due(jobs))
        .cte("job")
    )
    # The adoption (see Ledger.check_delivery): a copy of an older attempt
    # takes over a job nobody has started since its requeue. Only while
    # the row still has the attempt this statement read: a racing older
    # copy re-checks the updated row (EvalPlanQual) and adopts nothing.
    adopted = (
        update(jobs)
        .where(
            jobs.c.id == job_id,
            due(jobs),
            jobs.c.status.in_(_literals(ADOPTABLE_STATUSES)),
            jobs.c.attempt > delivered,
            jobs.c.attempt == select(job.c.attempt).scalar_subquery(),
        )
        # Running from now, without a worker until this copy's process
        # reports its start: later copies find it started and are fenced.
        .values(
            status=_sql("'running'"),
            attempt=jobs.c.attempt + 1,
            started_at=func.now(),
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
    # One row always: the job row's status and attempt, from which a fenced
    # delivery's reason is told, the attempt adopted, and the row's due time.
    verdict = (
        select(job.c.status).scalar_subquery().label("job_status"),
        select(job.c.attempt).scalar_subquery().label("job_attempt"),
        select(adopted.c.attempt).scalar_subquery().label("adopted"),
        select(job.c.due_at).scalar_subquery().label("job_due"),
    )
    return _DeliveryFence(job=job, adopted=adopted, fenced=fenced, verdict=verdict)


def _ledger_take(t: Tables, fenced: ColumnElement[bool] | None, *sources: Any) -> Any:
    """The upsert that takes key ``p_key`` for ``p_owner`` (unless ``fenced``)."""
    ledger = t.ledger
    c = ledger.c
    now = func.now()
    row = select(
        bindparam("p_key", type_=Text),
        bindparam("p_job_id", type_=c.job_id.type),
        LEDGER_RUNNING,
        bindparam("p_owner", type_=Text),
        now + seconds_param("p_lease"),
        _sql("1"),
    )
    for source in sources:
        row = row.select_from(source)
    if fenced is not None:
        row = row.where(~fenced)
    new = pg_insert(ledger).from_select(
        ["key", "job_id", "state", "owner", "lease_expires_at", "attempts"], row
    )
    completed = c.state == LEDGER_COMPLETED
    # The WHERE of DO UPDATE sees the existing row: a running key whose
    # holder stopped renewing its lease is taken over, and (with
    # p_take_completed: the key is the job key) a key completed for
    # another job, an earlier one that used the same key and was pruned
    # since; it starts afresh. A key completed for this job, or a live
    # lease, makes the take return nothing.
    return new.on_conflict_do_update(
        index_elements=[c.key],
        set_={
            "state": LEDGER_RUNNING,
            "owner": new.excluded.owner,
            "lease_expires_at": new.excluded.lease_expires_at,
            "attempts": case((completed, _sql("1")), else_=c.attempts + _sql("1")),
            "job_id": func.coalesce(new.excluded.job_id, c.job_id),
            "result": null(),
            "completed_at": null(),
        },
        where=or_(
            and_(c.state == LEDGER_RUNNING, c.lease_expires_at <= now),
            and_(
                bindparam("p_take_completed", type_=Boolean),
                completed,
                c.job_id != new.excluded.job_id,
            ),
        ),
    ).returning(c.attempts)


#: The take commits without waiting for its WAL flush (synchronous_commit
#: off for this statement's own transaction only): other sessions see it at
#: once, so exactly one taker wins; only a PostgreSQL crash in the next
#: fraction of a second could forget it. Completions, which the guarantee
#: rests on, stay durable.
def _no_fsync() -> Any:
    return select(
        func.set_config(_sql("'synchronous_commit'"), _sql("'off'"), _sql("true")).label("off")
    ).cte("no_fsync")


def ledger_acquire(t: Tables, due: DueTest = due_between) -> Select[Any]:
    """Take key ``p_key`` for ``p_owner`` under a lease of ``p_lease``
    seconds, unless the delivery of job ``p_job_id`` at ``p_attempt`` is
    fenced; one row: the attempts if taken, and the fence's verdict."""
    fence = _delivery_fence(t, due)
    taken = _ledger_take(t, fence.fenced, _no_fsync()).cte("taken")
    return select(select(taken.c.attempts).scalar_subquery().label("taken"), *fence.verdict)


def ledger_check_delivery(t: Tables, due: DueTest = due_between) -> Select[Any]:
    """The delivery fence and adoption of :func:`ledger_acquire` for a
    delivery of job ``p_job_id`` at ``p_attempt`` that takes no key."""
    return select(*_delivery_fence(t, due).verdict)


def delivery_job(t: Tables, due: DueTest = due_between) -> Select[Any]:
    """Job ``p_job_id``'s status, attempt and due time: the delivery fence's
    read when no adoption can follow (see ``PostgresLedger.check_delivery``).

    A plain read, planned in about a third of the time of
    :func:`ledger_check_delivery`, whose adopting ``UPDATE`` can only change
    a row whose attempt is newer than the delivery's."""
    c = t.jobs.c
    return select(c.status, c.attempt, c.due_at).where(
        c.id == bindparam("p_job_id", type_=c.id.type), due(t.jobs)
    )


def _partition_table(t: Tables, partition: str) -> Any:
    c = t.jobs.c
    return table(
        partition,
        column("id", c.id.type),
        column("status", c.status.type),
        column("attempt", c.attempt.type),
        column("due_at", c.due_at.type),
        schema=t.jobs.schema,
    )


def _in_partition(part: Any, jobs: Table) -> tuple[ColumnElement[bool], ...]:
    return (
        part.c.id == bindparam("p_job_id", type_=jobs.c.id.type),
        part.c.due_at == bindparam("p_due", type_=jobs.c.due_at.type),
    )


def delivery_job_in(t: Tables, partition: str) -> Select[Any]:
    """:func:`delivery_job` on ``partition`` alone, the partition of ``jobs``
    that holds the delivery's due time ``p_due``.

    A plain table: the statement runs prepared (planned once per
    connection) and locks that partition only, where the same read on
    ``jobs`` is planned on every call (:func:`due_between`)."""
    part = _partition_table(t, partition)
    return select(part.c.status, part.c.attempt, part.c.due_at).where(*_in_partition(part, t.jobs))


def ledger_acquire_in(t: Tables, partition: str) -> Select[Any]:
    """:func:`ledger_acquire` reading job ``p_job_id`` from ``partition``
    (the one that holds its due time ``p_due``), without the adoption: a
    delivery of an older attempt takes nothing here and is decided by
    :func:`ledger_acquire`. Touches a plain table and the ledger, so it
    runs prepared; one row: the attempts if taken, the row's status and
    attempt."""
    part = _partition_table(t, partition)
    job = select(part.c.status, part.c.attempt).where(*_in_partition(part, t.jobs)).cte("job")
    delivered = bindparam("p_attempt", type_=Integer)
    fenced = exists().where(
        or_(job.c.status.in_(_literals(FENCED_STATUSES)), job.c.attempt > delivered)
    )
    taken = _ledger_take(t, fenced, _no_fsync()).cte("taken")
    return select(
        select(taken.c.attempts).scalar_subquery().label("taken"),
        select(job.c.status).scalar_subquery().label("job_status"),
        select(job.c.attempt).scalar_subquery().label("job_attempt"),
    )


def ledger_inspect(t: Tables) -> Select[Any]:
    """Key ``p_key``'s entry as a take that took nothing reads it."""
    c = t.ledger.c
    return select(
        c.state,
        c.owner,
        c.attempts,
        c.result,
        c.result.is_not(None).label("recorded"),
        extract("epoch", c.lease_expires_at - func.now()).label("retry_in"),
        c.completed_at,
    ).where(c.key == bindparam("p_key"))


def _completion(t: Tables, *, recorded: bool) -> Any:
    ledger = t.ledger
    c = ledger.c
    now = func.now()
    # Owner tokens are unique per execution, so matching the owner is
    # enough: a repeat by the same owner (a retry after a lost reply)
    # finds its own completed row and only refreshes the result. An
    # upsert: a row that is missing although this owner took it (the
    # take's asynchronous commit was lost in a crash) is created
    # completed; only a row of another owner refuses (no row changed).
    result = cast(bindparam("p_result", type_=Text), JSONB) if recorded else null()
    done = pg_insert(ledger).values(
        key=bindparam("p_key", type_=Text),
        job_id=bindparam("p_job_id", type_=c.job_id.type),
        state=LEDGER_COMPLETED,
        owner=bindparam("p_owner", type_=Text),
        attempts=_sql("1"),
        result=result,
        completed_at=now,
    )
    values = {
        "state": LEDGER_COMPLETED,
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


def ledger_complete(t: Tables) -> Any:
    """Complete key ``p_key`` for ``p_owner`` (job ``p_job_id``), recording
    ``p_result``; a row back means completed."""
    return _completion(t, recorded=True)


def ledger_complete_keep_result(t: Tables) -> Any:
    """:func:`ledger_complete` recording no result."""
    return _completion(t, recorded=False)


#: Every named statement, in the order :func:`render` prints them.
NAMED: tuple[Callable[[Tables], Any], ...] = (
    claim_due,
    claim_ids,
    due_soon,
    due_soon_after,
    oldest_due_pending,
    release,
    mark_expired,
    fail_dispatch,
    mark_missed,
    unfinished_by_shard,
    next_stranded_shard,
    stranded_pending,
    stranded_in_flight,
    unfinished_first_page,
    unfinished_page,
    rehome,
    requeue_dispatched,
    mark_untracked,
    record_published,
    prune_published,
    requeue_retrying,
    requeue_running,
    rescue,
    heartbeat,
    mark_running,
    mark_finished,
    mark_retrying,
    batch_running,
    batch_retrying,
    batch_finished,
    batch_ran,
    batch_lost,
    ledger_acquire,
    ledger_check_delivery,
    delivery_job,
    ledger_inspect,
    ledger_complete,
    ledger_complete_keep_result,
)


class Statements:
    """Every named statement for one schema, built once (per store)."""

    def __init__(self, schema: str) -> None:
        t = self.tables = Tables.of(schema)
        self.claim_due = claim_due(t)
        self.claim_ids = claim_ids(t)
        self.due_soon = due_soon(t)
        self.due_soon_after = due_soon_after(t)
        self.oldest_due_pending = oldest_due_pending(t)
        self.release = release(t)
        self.mark_expired = mark_expired(t)
        self.fail_dispatch = fail_dispatch(t)
        self.mark_missed = mark_missed(t)
        self.unfinished_by_shard = unfinished_by_shard(t)
        self.next_stranded_shard = next_stranded_shard(t)
        self.stranded_pending = stranded_pending(t)
        self.stranded_in_flight = stranded_in_flight(t)
        self.unfinished_first_page = unfinished_first_page(t)
        self.unfinished_page = unfinished_page(t)
        self.rehome = rehome(t)
        self.requeue_dispatched = requeue_dispatched(t)
        self.mark_untracked = mark_untracked(t)
        self.record_published = record_published(t)
        self.prune_published = prune_published(t)
        self.requeue_retrying = requeue_retrying(t)
        self.requeue_running = requeue_running(t)
        self.rescue = rescue(t)
        self.heartbeat = heartbeat(t)
        self.mark_running = mark_running(t)
        self.mark_finished = mark_finished(t)
        self.mark_retrying = mark_retrying(t)
        self.batch_running = batch_running(t)
        self.batch_retrying = batch_retrying(t)
        self.batch_finished = batch_finished(t)
        self.batch_ran = batch_ran(t)
        self.batch_lost = batch_lost(t)
        self.ledger_acquire = ledger_acquire(t)
        self.ledger_check_delivery = ledger_check_delivery(t)
        self.delivery_job = delivery_job(t)
        self.ledger_inspect = ledger_inspect(t)
        self.ledger_complete = ledger_complete(t)
        self.ledger_complete_keep_result = ledger_complete_keep_result(t)
        #: The worker's statements for a message without the due header.
        self.by_margin = MarginStatements(t)


class MarginStatements:
    """The worker's statements by id bounded by :func:`sent_due` instead of
    :func:`due_between`: for messages sent before the ``celery_sched_due``
    header existed (each costs a lock on every partition, as before)."""

    def __init__(self, t: Tables) -> None:
        self.mark_running = mark_running(t, sent_due)
        self.mark_finished = mark_finished(t, sent_due)
        self.mark_retrying = mark_retrying(t, sent_due)
        self.batch_running = batch_running(t, sent_due)
        self.batch_retrying = batch_retrying(t, sent_due)
        self.batch_finished = batch_finished(t, sent_due)
        self.batch_ran = batch_ran(t, sent_due)
        self.batch_lost = batch_lost(t, sent_due)
        self.ledger_acquire = ledger_acquire(t, sent_due)
        self.ledger_check_delivery = ledger_check_delivery(t, sent_due)


def render(schema: str, names: list[str] | None = None) -> str:
    """The named statements (all, or ``names``) as the SQL psycopg receives,
    each headed by its name and docstring, its bound defaults after it."""
    built = Statements(schema)
    chosen = [fn for fn in NAMED if names is None or fn.__name__ in names]
    unknown = set(names or ()) - {fn.__name__ for fn in chosen}
    if unknown:
        raise ValueError(f"no statement named {', '.join(sorted(unknown))}")
    blocks = []
    for fn in chosen:
        compiled = getattr(built, fn.__name__).compile(dialect=DIALECT)
        # IN lists spelled out, as the engine sends them.
        expanded = compiled.construct_expanded_state(
            {name: None for name, bind in compiled.binds.items() if bind.required}
        )
        doc = " ".join((fn.__doc__ or "").split())
        defaults = {k: v for k, v in expanded.parameters.items() if v is not None}
        lines = [f"-- name: {fn.__name__}", f"-- {doc}", f"{expanded.statement};"]
        if defaults:
            lines.append(f"-- defaults: {defaults}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
