"""The PostgreSQL schema of celery_sched, as SQLAlchemy Core tables.

Every table lives in one configurable Postgres schema (``settings.db_schema``),
so :func:`build_metadata` takes the schema name. The Alembic migrations under
``celery_sched/store/migrations`` create exactly these tables; a test compares
the migrated database with this metadata.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    cast,
    func,
    literal_column,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.sql.elements import ColumnElement

from celery_sched.models import JobStatus, MisfirePolicy, OverlapPolicy

#: Status values allowed by the ``jobs.status`` CHECK constraint.
STATUS_VALUES = tuple(status.value for status in JobStatus)

#: Storage parameters of each partition of the ``jobs`` table (a
#: partitioned table has no storage of its own: they are given to every
#: partition as it is created, see ``store/postgres/partitioning.py``).
#: Every job row is updated several times (pending -> dispatched ->
#: running -> finished) and then deleted, so the table churns constantly:
#: a fillfactor below 100 leaves room on each page for the new row
#: versions, and autovacuum must run after a small fraction of the table
#: changed (the default 20% of a 10M-row table is far too late: dead index
#: entries in the partial pending index slow every claim) and be allowed to
#: do more work per round than the conservative default.
JOBS_STORAGE = {
    "fillfactor": "80",
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_limit": "2000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
}

SCHEDULE_KINDS = ("crontab", "interval", "solar", "clocked", "custom")


#: The Unix epoch as a timestamptz constant: ``dispatched_at`` minus it is an
#: immutable expression (``extract(epoch FROM timestamptz)`` is only stable,
#: so no index may hold it).
UNIX_EPOCH: ColumnElement[Any] = literal_column("'1970-01-01 00:00:00+00'::timestamptz")


def dispatched_keys(jobs: Table) -> tuple[ColumnElement[Any], ColumnElement[Any]]:
    """The keys of ``jobs_dispatched_idx`` after ``shard``: whether the job
    has no visibility timeout of its own (1) or has one (0), and when it
    goes stale in Unix seconds, less the default timeout when it has none
    (``dispatched_at`` + its own timeout, or + 0).

    The reconciler reads each kind by one index range of stale rows
    (``store/postgres/statements.py``, :func:`_stale_dispatched`). The flag
    is an integer: a boolean index key would match ``= true`` but not
    ``= false``, which the planner rewrites to ``IS NOT NULL``.
    """
    c = jobs.c
    # (Spelled so that Alembic's comparison of metadata and database, which
    # drops casts and quotes, reads the index PostgreSQL prints back as equal.)
    since_epoch = func.date_part(literal_column("'epoch'"), c.dispatched_at - UNIX_EPOCH)
    return (
        cast(c.visibility_timeout.is_(None), Integer),
        since_epoch + func.coalesce(c.visibility_timeout, literal_column("0")),
    )


def _ts(
    name: str, *, nullable: bool = True, now_default: bool = False, primary_key: bool = False
) -> Column[object]:
    return Column(
        name,
        DateTime(timezone=True),
        nullable=nullable,
        primary_key=primary_key,
        server_default=text("now()") if now_default else None,
    )


def build_metadata(schema: str) -> MetaData:
    """Return the tables of celery_sched, all placed in Postgres schema ``schema``."""
    metadata = MetaData(schema=schema)

    status_list = ", ".join(f"'{value}'" for value in STATUS_VALUES)
    # Range-partitioned by due time (0012): a partition per UTC day near now,
    # per month or year further away (store/partitions.py), created before
    # the first row that needs it; retention drops whole finished partitions.
    # A unique index of a partitioned table must hold the partition key, so
    # the primary key is (id, due_at) and global key uniqueness lives in
    # job_keys below.
    jobs = Table(
        "jobs",
        metadata,
        # The id is also the Celery task id. Ids are generated (time-ordered
        # v7, unique by construction) unless the caller's key is a UUID's
        # text, and such a key is kept in job_keys like any other.
        Column("id", Uuid(as_uuid=True), primary_key=True),
        # NULL when the key is the job's id (every job scheduled without a
        # key): readers present id::text, and the primary key keeps such keys
        # unique, so only the keys callers chose take an entry in the key
        # index. (0003)
        Column("key", Text, nullable=True),
        Column("task", Text, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("content_type", Text, nullable=False),
        Column("content_encoding", Text, nullable=False),
        Column("argsrepr", Text, nullable=False, server_default=text("''")),
        Column("kwargsrepr", Text, nullable=False, server_default=text("''")),
        Column("options", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        _ts("due_at", nullable=False, primary_key=True),
        Column("due_bucket", Integer, nullable=False),
        _ts("expires_at"),
        Column("status", Text, nullable=False, server_default=text("'pending'")),
        Column("attempt", Integer, nullable=False, server_default=text("0")),
        Column("max_attempts", Integer, nullable=False, server_default=text("5")),
        Column("shard", SmallInteger, nullable=False, server_default=text("0")),
        # No foreign key to schedules: a FK check per COPY row would slow bulk
        # loads, and deleting a schedule must not touch its finished history.
        Column("schedule_id", BigInteger, nullable=True),
        Column("leader_epoch", BigInteger, nullable=True),
        Column("visibility_timeout", Double, nullable=True),
        Column("max_runtime", Double, nullable=True),
        _ts("created_at", nullable=False, now_default=True),
        _ts("dispatched_at"),
        _ts("started_at"),
        _ts("finished_at"),
        Column("worker", Text, nullable=True),
        Column("last_error", Text, nullable=True),
        # The process a running job runs in, beside its host in ``worker``:
        # the rescuer matches it against that process's heartbeat. (0004)
        Column("worker_pid", Integer, nullable=True),
        # Which claim dispatched the job: a random number per claim (per try
        # of one), matched against published_claims once the claim's messages
        # went out. (0013)
        Column("claim_id", BigInteger, nullable=True),
        CheckConstraint(f"status IN ({status_list})", name="jobs_status_check"),
        postgresql_partition_by="RANGE (due_at)",
    )
    # The hot path: claims scan "pending, this shard, bucket <= now" in due
    # order. Partial, so dispatched and finished rows drop out of it and the
    # scan never wades through the past.
    Index(
        "jobs_pending_due_idx",
        jobs.c.shard,
        jobs.c.due_bucket,
        jobs.c.due_at,
        postgresql_where=text("status = 'pending'"),
    )
    # Finds a job by its caller-chosen key in each partition; job_keys makes
    # the key unique across them. (0012: was the unique jobs_key_key)
    Index(
        "jobs_key_idx",
        jobs.c.key,
        postgresql_where=text("key IS NOT NULL"),
    )
    # Dispatched jobs by shard and by when they go stale (dispatched_keys):
    # the reconciler reads only the stale ones, however many are in flight
    # (untracked jobs stay dispatched a whole visibility timeout), and the
    # start-up check for rows in shards past the count by shard. (0015: was
    # dispatched_at alone, which made every reconciler pass walk every
    # dispatched row of every shard.)
    Index(
        "jobs_dispatched_idx",
        jobs.c.shard,
        *dispatched_keys(jobs),
        postgresql_where=text("status = 'dispatched'"),
    )
    Index(
        "jobs_running_idx",
        jobs.c.started_at,
        postgresql_where=text("status = 'running'"),
    )
    # Retrying jobs per shard, for the start-up check of a lowered shard
    # count (pending's index leads with shard; dispatched and running are
    # small), and by when their retry is due (dispatched_at), for the
    # reconciler's scan for retries that never started. (0004)
    Index(
        "jobs_retrying_idx",
        jobs.c.shard,
        jobs.c.dispatched_at,
        postgresql_where=text("status = 'retrying'"),
    )
    # Dead jobs in due order, for listing and requeueing them by hand; rows
    # enter it only when they die, so inserts and claims pay nothing. (0008)
    Index(
        "jobs_dead_idx",
        jobs.c.due_at,
        jobs.c.id,
        postgresql_where=text("status = 'dead'"),
    )
    # Every job in due order, for the jobs listings (web console, `sched
    # jobs`) by keyset, whole or filtered by task or due range. (0010)
    Index("jobs_due_idx", jobs.c.due_at, jobs.c.id)
    # Failed and dead jobs by when they finished, newest first for the web
    # console's recent failures; only failing rows enter it. (0011)
    Index(
        "jobs_failed_idx",
        jobs.c.finished_at,
        postgresql_where=text("status IN ('failed', 'dead')"),
    )
    Index(
        "jobs_finished_idx",
        jobs.c.finished_at,
        postgresql_where=text("finished_at IS NOT NULL"),
    )
    Index(
        "jobs_schedule_idx",
        jobs.c.schedule_id,
        jobs.c.status,
        postgresql_where=text("schedule_id IS NOT NULL"),
    )
    # A schedule's next and latest occurrence (listing, withdrawing future
    # occurrences) without reading its whole history. (0002)
    Index(
        "jobs_schedule_due_idx",
        jobs.c.schedule_id,
        jobs.c.due_at,
        postgresql_where=text("schedule_id IS NOT NULL"),
    )

    # Every caller-chosen key of a stored job (a key that is a UUID's text
    # too), unique across the partitions of jobs: each insert path writes
    # the key here in the same transaction, before the job, and a taken key
    # is a conflict here. Generated ids are unique by construction and take
    # no entry. The row goes when its job is deleted (prune, withdrawn
    # occurrences) or its partition dropped. (0012)
    Table(
        "job_keys",
        metadata,
        Column("key", Text, primary_key=True),
        Column("job_id", Uuid(as_uuid=True), nullable=False),
    )

    kind_list = ", ".join(f"'{kind}'" for kind in SCHEDULE_KINDS)
    misfire_list = ", ".join(f"'{policy.value}'" for policy in MisfirePolicy)
    overlap_list = ", ".join(f"'{policy.value}'" for policy in OverlapPolicy)
    schedules = Table(
        "schedules",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("name", Text, nullable=False),
        Column("task", Text, nullable=False),
        Column("kind", Text, nullable=False),
        Column("spec", JSONB, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("content_type", Text, nullable=False),
        Column("content_encoding", Text, nullable=False),
        Column("argsrepr", Text, nullable=False, server_default=text("''")),
        Column("kwargsrepr", Text, nullable=False, server_default=text("''")),
        Column("options", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("timezone", Text, nullable=False, server_default=text("'UTC'")),
        Column("enabled", Boolean, nullable=False, server_default=text("true")),
        Column("source", Text, nullable=False, server_default=text("'dynamic'")),
        Column("misfire", Text, nullable=True),
        Column("overlap", Text, nullable=True),
        Column("catchup_window", Double, nullable=True),
        Column("max_catchup", Integer, nullable=True),
        Column("relative", Boolean, nullable=False, server_default=text("false")),
        _ts("last_nominal_at"),
        _ts("next_nominal_at"),
        _ts("created_at", nullable=False, now_default=True),
        _ts("updated_at", nullable=False, now_default=True),
        _ts("disabled_at"),
        # 0002: the user's pause switch (``enabled`` is false only for static
        # schedules gone from the code) and a version bumped by every change,
        # so a planner that read an older definition writes nothing.
        Column("paused", Boolean, nullable=False, server_default=text("false")),
        Column("version", BigInteger, nullable=False, server_default=text("0")),
        # 0004: a schedule the planner could not plan is set aside with its
        # reason (shown by `sched schedules`) instead of failing every pass.
        _ts("broken_at"),
        Column("broken_reason", Text, nullable=True),
        UniqueConstraint("name", name="schedules_name_key"),
        CheckConstraint(f"kind IN ({kind_list})", name="schedules_kind_check"),
        CheckConstraint("source IN ('static', 'dynamic')", name="schedules_source_check"),
        CheckConstraint(f"misfire IN ({misfire_list})", name="schedules_misfire_check"),
        CheckConstraint(f"overlap IN ({overlap_list})", name="schedules_overlap_check"),
    )
    # The planner's scan: schedules whose next instant enters the horizon.
    # Partial, so paused and disabled schedules cost it nothing. (0002)
    Index(
        "schedules_plan_idx",
        schedules.c.next_nominal_at,
        schedules.c.id,
        postgresql_where=text("enabled AND NOT paused AND broken_at IS NULL"),
    )

    ledger = Table(
        "ledger",
        metadata,
        Column("key", Text, primary_key=True),
        Column("job_id", Uuid(as_uuid=True), nullable=True),
        Column("state", Text, nullable=False),
        Column("owner", Text, nullable=True),
        _ts("lease_expires_at"),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("result", JSONB, nullable=True),
        _ts("created_at", nullable=False, now_default=True),
        _ts("completed_at"),
        CheckConstraint("state IN ('running', 'completed')", name="ledger_state_check"),
    )
    Index("ledger_completed_idx", ledger.c.completed_at)

    # One row per worker process (a prefork pool's children share a
    # hostname), refreshed by its status writer; the leader's rescuer
    # requeues running jobs of processes that stopped beating. (0004)
    Table(
        "workers",
        metadata,
        Column("hostname", Text, primary_key=True),
        Column("pid", Integer, primary_key=True, autoincrement=False),
        _ts("started_at", nullable=False, now_default=True),
        _ts("seen_at", nullable=False, now_default=True),
        # The tasks whose jobs the process tracks; NULL (a worker of before
        # 0006) counts as every task. (0006)
        Column("tasks", ARRAY(Text), nullable=True),
    )

    Table(
        "leaders",
        metadata,
        Column("shard", SmallInteger, primary_key=True, autoincrement=False),
        Column("epoch", BigInteger, nullable=False),
        Column("holder", Text, nullable=True),
        _ts("acquired_at"),
    )

    # One row per claim whose messages all went out (or whose unsent jobs
    # were all settled otherwise). The reconciler marks a job that no worker
    # tracks ``sent`` only when its claim is here; a job claimed but never
    # published (a beat killed between claim and publish, a claim whose
    # COMMIT was lost and retried) is requeued instead. One row per batch,
    # not per job, so dispatch writes one small row per 1,000 jobs. Pruned
    # with the finished jobs' retention. (0013)
    Table(
        "published_claims",
        metadata,
        Column("claim_id", BigInteger, primary_key=True, autoincrement=False),
        Column("shard", SmallInteger, nullable=False),
        _ts("published_at", nullable=False, now_default=True),
    )
    Index("published_claims_at_idx", metadata.tables[f"{schema}.published_claims"].c.published_at)

    # At most one row: the shard count every unfinished row was last placed
    # for. Shard 0's leader compares it with its own count to know when a
    # full pass over the rows is due, instead of reading them all every
    # pass; no row (a schema of before 0009) means one is. (0009)
    Table(
        "placement",
        metadata,
        Column("singleton", Boolean, primary_key=True, server_default=text("true")),
        Column("shards", SmallInteger, nullable=False),
        _ts("placed_at", nullable=False, now_default=True),
        CheckConstraint("singleton", name="placement_singleton_check"),
    )
    return metadata
