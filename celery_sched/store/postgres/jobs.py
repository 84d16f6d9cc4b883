"""The job rows on PostgreSQL: writing, reading, cancelling, and the leader's
work on them (epochs, claims, requeues, the rescue, pruning).

The per-batch statements (claims, requeues, the rescue) are named in
:mod:`~celery_sched.store.postgres.statements`; the rest are built here.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import psycopg
from sqlalchemy import Row, Select, bindparam, delete, func, literal_column, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from celery_sched.errors import DuplicateJob, StaleEpoch, StoreError
from celery_sched.ids import new_claim_id, new_epoch_salt
from celery_sched.interfaces import Jobs
from celery_sched.models import (
    EPOCH_SALT_BITS,
    EPOCH_SALT_MASK,
    DueSpan,
    Job,
    JobQuery,
    JobStatus,
    MinuteDispatches,
    NewJob,
    NewJobRow,
    PageCursor,
    ReconcileResult,
    RehomeResult,
    RehomeRow,
    RequeueResult,
    check_rehome,
    id_of_key,
    jobs_from_rows,
    misplaced,
)
from celery_sched.settings import Settings
from celery_sched.store.postgres.base import PostgresStoreBase
from celery_sched.store.postgres.bulk import JobCopy
from celery_sched.store.postgres.connection import RawStatement, raw_cursor
from celery_sched.store.postgres.keys import release_keys, stored_key
from celery_sched.store.postgres.listing import (
    CODE_POINT_COLLATIONS,
    Listing,
    check_allowance,
    key_arrays,
    read_collation,
    requeue_result,
)
from celery_sched.store.postgres.statements import (
    PENDING,
    ROW_ADDRESS,
    Tables,
    job_columns,
    key_matches,
    same_row,
    seconds_param,
)
from celery_sched.timeutil import ensure_utc, to_bucket

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NOW = select(func.now())

#: Rows per multi-row INSERT in add_occurrences (keeps the statement under
#: Postgres's 65535 bind parameter limit).
OCCURRENCE_CHUNK = 1000

_TEXT_OID = 25


class JobQueries:
    """The statements of the job rows that run per call, not per batch."""

    def __init__(self, tables: Tables) -> None:
        jobs = tables.jobs
        leaders = tables.leaders
        c = jobs.c
        now = func.now()
        columns = job_columns(jobs)

        # -- leadership --
        self.epoch_for_share = (
            select(leaders.c.epoch, func.now())
            .where(leaders.c.shard == bindparam("p_shard"))
            .with_for_update(read=True)
        )
        self.current_epoch = select(leaders.c.epoch).where(leaders.c.shard == bindparam("p_shard"))
        # models.next_epoch in SQL: the counter in the high bits goes up by
        # one, the low bits are the caller's random salt.
        salt = bindparam("p_salt", type_=leaders.c.epoch.type)
        step = literal_column(str(1 << EPOCH_SALT_BITS), leaders.c.epoch.type)
        upsert = pg_insert(leaders).values(
            shard=bindparam("p_shard"),
            epoch=step + salt,
            holder=bindparam("p_holder"),
            acquired_at=now,
        )
        self.acquire_epoch = upsert.on_conflict_do_update(
            index_elements=[leaders.c.shard],
            set_={
                "epoch": (leaders.c.epoch // step + 1) * step + salt,
                "holder": upsert.excluded.holder,
                "acquired_at": now,
            },
        ).returning(leaders.c.epoch)

        # -- the shard count the rows were placed for --
        placement = tables.placement
        self.placed_for = select(placement.c.shards)
        placed = pg_insert(placement).values(shards=bindparam("p_shards"), placed_at=now)
        self.record_placement = placed.on_conflict_do_update(
            index_elements=[placement.c.singleton],
            set_={"shards": placed.excluded.shards, "placed_at": now},
        )

        # -- reading --
        self.get_by_key = select(*columns).where(key_matches(jobs))
        self.get_by_id = select(*columns).where(c.id == bindparam("p_id"))
        self.counts_by_status = select(c.status, func.count()).group_by(c.status)
        hour = func.date_trunc("hour", c.due_at, "UTC")
        self.counts_by_hour = select(hour, func.count()).group_by(hour)
        self.counts_by_hour_for_status = (
            select(hour, func.count()).where(c.status == bindparam("p_status")).group_by(hour)
        )

        # -- writing --
        self.insert = pg_insert(jobs).returning(*columns)
        # No conflict target: a taken key is a conflict on the key index or,
        # for a key that is an id, on the primary key.
        self.insert_or_nothing = pg_insert(jobs).on_conflict_do_nothing().returning(*columns)
        self.cancel = (
            update(jobs)
            .where(key_matches(jobs), c.status == PENDING)
            .values(status="cancelled", finished_at=now)
        )

        # -- housekeeping --
        # By row address, as claims: an id alone would be looked up in
        # every partition. The deleted jobs' keys go with them.
        prunable = (
            select(*ROW_ADDRESS, c.due_at)
            .where(c.finished_at < now - seconds_param("older_than"))
            .limit(bindparam("batch"))
            .with_for_update(skip_locked=True)
            .subquery("prunable")
        )
        pruned = delete(jobs).where(*same_row(jobs, prunable)).returning(c.key, c.id).cte("pruned")
        self.prune = select(func.count()).select_from(pruned).add_cte(release_keys(tables, pruned))


class PostgresJobs(PostgresStoreBase, Jobs):
    """:class:`~celery_sched.interfaces.Jobs` on PostgreSQL (psycopg 3)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._jq = JobQueries(self.statements.tables)
        self._copy = JobCopy(self.database, self.partitions)
        self._claim_due = RawStatement(self.statements.claim_due)
        self._claim_ids = RawStatement(self.statements.claim_ids)
        self._release = RawStatement(self.statements.release)
        self._mark_expired = RawStatement(self.statements.mark_expired)
        self._fail_dispatch = RawStatement(self.statements.fail_dispatch)
        self._mark_missed = RawStatement(self.statements.mark_missed)
        self._listing = Listing(self.statements.tables.jobs)
        #: The database's collation, read on the first key-prefix listing.
        self._key_collation: str | None = None

    def _fence(self, conn: Connection, shard: int, epoch: int) -> dt.datetime:
        # FOR SHARE on the shard's leaders row: acquire_epoch's UPDATE of that
        # row must wait until this claim commits, and a claim that starts after
        # the bump reads the new epoch and is refused. So once acquire_epoch
        # returns, no transaction of an older epoch can still be moving rows.
        row = conn.execute(self._jq.epoch_for_share, {"p_shard": shard}).first()
        current = None if row is None else row[0]
        # No leaders row means no leader was ever elected: nobody may claim.
        if row is None or current != epoch:
            raise StaleEpoch(
                f"epoch {epoch} is stale for shard {shard}: the current epoch is {current or 0}"
            )
        # The database's clock, for the claim's partition bound
        # (claim_horizon): now() is the transaction's start, the same value
        # every now() of the claim that follows reads, so the bound is
        # exact. (It was now + SENT_DUE_MARGIN, a day: that kept tomorrow's
        # partition, which holds a day of future jobs, in every claim's plan
        # and its result relations: ~1.5 us more server CPU per claimed row.)
        now: dt.datetime = row[1]
        return now

    # -- writing jobs -------------------------------------------------------

    def add_job(self, job: NewJob, *, if_exists: Literal["raise", "return"] = "raise") -> Job:
        db = self.database
        values = row_values(job)
        attempts = 0

        def write(conn: Connection) -> Job:
            self.partitions.ensure(conn, [job.due_at])
            if if_exists == "return":
                # A racing delete of the existing row could leave nothing to
                # return; try the insert again in that case.
                for _ in range(3):
                    free = self.job_keys.is_free(conn, job, or_raise=False)
                    row = conn.execute(self._jq.insert_or_nothing, values).first() if free else None
                    if row is None:
                        row = conn.execute(self._jq.get_by_key, key_params(job.key)).first()
                    if row is not None:
                        return job_of(row)
                raise StoreError(f"could not insert or read job {job.key!r}")
            if not self.job_keys.is_free(conn, job, or_raise=True):
                raise DuplicateJob(key=job.key)
            return job_of(conn.execute(self._jq.insert, values).one())

        def in_transaction() -> Job:
            with db.engine.begin() as conn:
                return write(conn)

        def attempt() -> Job:
            nonlocal attempts
            attempts += 1
            try:
                return self.with_partitions(lambda: db.guard(in_transaction, "add_job"))
            except DuplicateJob:
                # A retry after a lost commit acknowledgement finds our own
                # row (same id): that is success, not a duplicate.
                if attempts > 1:
                    existing = self.get(job.key)
                    if existing is not None and existing.id == job.id:
                        return existing
                raise

        return db.with_retries(attempt, "add_job")

    def load_jobs(self, jobs: Iterable[NewJob]) -> int:
        return self.load_job_rows(map(_stored_row, jobs))

    def load_job_rows(self, rows: Iterable[NewJobRow]) -> int:
        """:meth:`load_jobs` for jobs given as :data:`~celery_sched.models.NEW_JOB_ROW`
        tuples (already validated: ``JobBuilder.build_row`` output), written
        to COPY unchanged. Same atomicity and errors as :meth:`load_jobs`.
        """
        return self._copy.write(rows)

    def add_occurrences(self, jobs: Sequence[NewJob]) -> list[uuid.UUID]:
        if not jobs:
            return []
        table = self.statements.tables.jobs

        def write(conn: Connection) -> list[uuid.UUID]:
            self.partitions.ensure(conn, (job.due_at for job in jobs))
            written: list[uuid.UUID] = []
            for start in range(0, len(jobs), OCCURRENCE_CHUNK):
                chunk = self.job_keys.free_jobs(conn, jobs[start : start + OCCURRENCE_CHUNK])
                if not chunk:
                    continue
                stmt = (
                    pg_insert(table)
                    .values([row_values(job) for job in chunk])
                    .on_conflict_do_nothing()
                    .returning(table.c.id)
                )
                written.extend(conn.execute(stmt).scalars())
            return written

        return self.with_partitions(lambda: self.database.transaction("add_occurrences", write))

    def _ensure_now(self, conn: Connection) -> None:
        """The partition of now, where a job requeued by hand moves (due now)."""
        self.partitions.ensure(conn, [conn.execute(_NOW).scalar_one()])

    # -- reading ------------------------------------------------------------

    def get(self, key: str) -> Job | None:
        params = key_params(key)
        row = self.database.transaction(
            "get", lambda conn: conn.execute(self._jq.get_by_key, params).first()
        )
        return None if row is None else job_of(row)

    def get_by_id(self, job_id: uuid.UUID) -> Job | None:
        row = self.database.transaction(
            "get_by_id", lambda conn: conn.execute(self._jq.get_by_id, {"p_id": job_id}).first()
        )
        return None if row is None else job_of(row)

    def counts_by_status(self) -> dict[JobStatus, int]:
        rows = self.database.transaction(
            "counts_by_status", lambda conn: conn.execute(self._jq.counts_by_status).all()
        )
        return {JobStatus(status): count for status, count in rows}

    def counts_by_hour(self, status: JobStatus | None = None) -> dict[dt.datetime, int]:
        def read(conn: Connection) -> list[tuple[dt.datetime, int]]:
            if status is None:
                result = conn.execute(self._jq.counts_by_hour)
            else:
                result = conn.execute(
                    self._jq.counts_by_hour_for_status, {"p_status": status.value}
                )
            return [(row[0], row[1]) for row in result]

        counts = self.database.transaction("counts_by_hour", read)
        return {ensure_utc(hour): count for hour, count in counts}

    def oldest_due_pending(self, *, shard: int) -> dt.datetime | None:
        due = self.database.transaction(
            "oldest_due_pending",
            lambda conn: conn.execute(
                self.statements.oldest_due_pending, {"p_shard": shard}
            ).scalar_one_or_none(),
        )
        return None if due is None else ensure_utc(due)

    def dispatches_by_minute(
        self, *, since: dt.datetime, until: dt.datetime
    ) -> dict[dt.datetime, MinuteDispatches]:
        params = {
            "p_since": ensure_utc(since, name="since"),
            "p_until": ensure_utc(until, name="until"),
        }
        rows = self.database.transaction(
            "dispatches_by_minute",
            lambda conn: conn.execute(self._listing.dispatches_by_minute, params).all(),
        )
        return {
            ensure_utc(minute): MinuteDispatches(count=count, mean_lag=float(lag))
            for minute, count, lag in rows
        }

    def recent_failures(self, *, limit: int) -> list[Job]:
        if limit <= 0:
            return []
        rows = self.database.transaction(
            "recent_failures",
            lambda conn: conn.execute(self._listing.recent_failures, {"p_limit": limit}).all(),
        )
        return [job_of(row) for row in rows]

    def list_jobs(
        self, query: JobQuery, *, after: PageCursor | None = None, limit: int
    ) -> list[Job]:
        """See :mod:`~celery_sched.store.postgres.listing` for the query plans."""
        if limit <= 0:
            return []

        def read(conn: Connection) -> list[Job]:
            stmt = self._listing.select_page(
                query,
                after,
                limit,
                code_point_keys=query.key_prefix is not None and self._code_point_keys(conn),
            )
            return [job_of(row) for row in conn.execute(stmt)]

        return self.database.transaction("list_jobs", read)

    def _code_point_keys(self, conn: Connection) -> bool:
        if self._key_collation is None:
            self._key_collation = read_collation(conn)
        return self._key_collation in CODE_POINT_COLLATIONS

    # -- user transitions ---------------------------------------------------

    def cancel(self, key: str) -> bool:
        return self.database.rowcount("cancel", self._jq.cancel, key_params(key)) > 0

    def requeue(self, keys: Sequence[str], *, allowance: int | None = None) -> RequeueResult:
        check_allowance(allowance)
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return RequeueResult()
        params: dict[str, Any] = {**key_arrays(wanted), "p_allowance": allowance}

        def run(conn: Connection) -> RequeueResult:
            self._ensure_now(conn)
            moved = [job_of(row) for row in conn.execute(self._listing.requeue_keys, params)]
            statuses: dict[str, str] = {
                key: status for key, status in conn.execute(self._listing.statuses_of_keys, params)
            }
            return requeue_result(wanted, moved, statuses)

        result = self.with_partitions(lambda: self.database.transaction("requeue", run))
        if result.requeued:
            logger.info("requeued %d jobs by hand", len(result.requeued))
        return result

    def requeue_dead(
        self,
        *,
        died_by: dt.datetime,
        task: str | None = None,
        limit: int,
        allowance: int | None = None,
    ) -> list[Job]:
        check_allowance(allowance)
        if limit <= 0:
            return []
        params: dict[str, Any] = {
            "p_died_by": ensure_utc(died_by, name="died_by"),
            "p_limit": limit,
            "p_allowance": allowance,
        }
        if task is not None:
            params["p_task"] = task
        stmt = self._listing.requeue_dead(task)

        def run(conn: Connection) -> list[Job]:
            self._ensure_now(conn)
            return [job_of(row) for row in conn.execute(stmt, params)]

        moved = self.with_partitions(lambda: self.database.transaction("requeue_dead", run))
        return sorted(moved, key=lambda job: (job.due_at, job.id.bytes))

    # -- leadership fencing -------------------------------------------------

    def acquire_epoch(self, shard: int, holder: str) -> int:
        epoch: int = self.database.transaction(
            "acquire_epoch",
            lambda conn: conn.execute(
                self._jq.acquire_epoch,
                {
                    "p_shard": shard,
                    "p_holder": holder,
                    "p_salt": new_epoch_salt() & EPOCH_SALT_MASK,
                },
            ).scalar_one(),
        )
        logger.info("shard %d: epoch %d acquired by %s", shard, epoch, holder)
        return epoch

    def current_epoch(self, shard: int) -> int:
        value = self.database.transaction(
            "current_epoch",
            lambda conn: conn.execute(
                self._jq.current_epoch, {"p_shard": shard}
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
        stmt: Select[Any] = self.statements.due_soon
        if after is not None:
            after = ensure_utc(after, name="after")
            stmt = self.statements.due_soon_after
            params.update(after=after, after_bucket=to_bucket(after))
        rows = self.database.transaction("due_soon", lambda conn: conn.execute(stmt, params).all())
        return [(job_id, ensure_utc(due_at)) for job_id, due_at in rows]

    def claim_due(self, *, shard: int, epoch: int, limit: int) -> list[Job]:
        if limit <= 0:
            return []

        def claim(conn: Connection) -> list[Job]:
            horizon = self._fence(conn, shard, epoch)
            params = {
                "p_shard": shard,
                "p_epoch": epoch,
                "p_limit": limit,
                "p_horizon": horizon,
                "p_claim": new_claim_id(),
            }
            return _claimed_jobs(conn, self._claim_due, params)

        return _sort_due(self.database.transaction("claim_due", claim))

    def claim_ids(self, ids: Sequence[uuid.UUID], *, shard: int, epoch: int) -> list[Job]:
        id_list = list(ids)

        def claim(conn: Connection) -> list[Job]:
            horizon = self._fence(conn, shard, epoch)
            if not id_list:
                return []
            params = {
                "ids": id_list,
                "p_shard": shard,
                "p_epoch": epoch,
                "p_horizon": horizon,
                "p_claim": new_claim_id(),
            }
            return _claimed_jobs(conn, self._claim_ids, params)

        return _sort_due(self.database.transaction("claim_ids", claim))

    def record_published(self, claim_ids: Sequence[int], *, shard: int) -> None:
        if not claim_ids:
            return
        params = {"p_claims": list(claim_ids), "p_shard": shard}

        def record(conn: Connection) -> None:
            # Not waiting for the flush: a record lost with a crash of the
            # server makes the reconciler requeue the claim's jobs (a second
            # run at worst, never a lost job), and the beat does not wait a
            # disk flush per batch.
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            conn.execute(self.statements.record_published, params)

        self.database.transaction("record_published", record)

    def release(self, ids: Sequence[uuid.UUID], *, epoch: int, due: DueSpan) -> int:
        if not ids:
            return 0
        params = {"ids": list(ids), "p_epoch": epoch}
        return self._by_due("release", self._release, params, due, _rowcount)

    def mark_expired(
        self, ids: Sequence[uuid.UUID], *, epoch: int, reason: str, due: DueSpan
    ) -> int:
        if not ids:
            return 0
        params = {"ids": list(ids), "p_epoch": epoch, "reason": reason}
        return self._by_due("mark_expired", self._mark_expired, params, due, _rowcount)

    def fail_dispatch(
        self, failures: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> ReconcileResult:
        if not failures:
            return ReconcileResult()
        # One reason per id: the last one given wins, as in the memory store.
        reasons = dict(failures)
        params = {"f_ids": list(reasons), "f_reasons": list(reasons.values()), "p_epoch": epoch}
        statuses = self._by_due("fail_dispatch", self._fail_dispatch, params, due, _first_column)
        dead = sum(1 for status in statuses if status == JobStatus.DEAD.value)
        return ReconcileResult(requeued=len(statuses) - dead, dead=dead)

    def mark_missed(
        self, dropped: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> list[uuid.UUID]:
        if not dropped:
            return []
        reasons = dict(dropped)
        params = {"f_ids": list(reasons), "f_reasons": list(reasons.values()), "p_epoch": epoch}
        return self._by_due("mark_missed", self._mark_missed, params, due, _first_column)

    def _by_due(
        self,
        what: str,
        stmt: RawStatement,
        params: dict[str, Any],
        due: DueSpan,
        read: Callable[[psycopg.Cursor[Any]], T],
    ) -> T:
        """Run a fenced transition by id of jobs due within ``due`` in its
        own transaction; ``read`` its outcome off the cursor."""
        values = stmt.params(**params, p_due_from=due.earliest, p_due_to=due.latest)

        def run(conn: Connection) -> T:
            with raw_cursor(conn) as cur:
                # Never prepared: the due bounds must be values to the
                # planner (statements.due_between).
                cur.execute(stmt.sql, values, prepare=False)
                return read(cur)

        return self.database.transaction(what, run)

    def unfinished_by_shard(self, *, from_shard: int) -> dict[int, dict[JobStatus, int]]:
        rows = self.database.transaction(
            "unfinished_by_shard",
            lambda conn: conn.execute(
                self.statements.unfinished_by_shard, {"from_shard": from_shard}
            ).all(),
        )
        found: dict[int, dict[JobStatus, int]] = {}
        for shard, status, count in rows:
            found.setdefault(int(shard), {})[JobStatus(status)] = int(count)
        return found

    # -- changing the shard count ---------------------------------------------

    def rehome(
        self,
        *,
        shards: int,
        shard_of: Callable[[str], int],
        limit: int,
        stranded_only: bool,
        after: uuid.UUID | None = None,
        dry_run: bool = False,
        in_flight: bool = True,
    ) -> RehomeResult:
        check_rehome(shards=shards, limit=limit)
        s = self.statements

        def run(conn: Connection) -> RehomeResult:
            following: uuid.UUID | None = None
            if stranded_only:
                rows = self._stranded(conn, shards, limit, in_flight=in_flight)
            else:
                if after is None:
                    page = conn.execute(s.unfinished_first_page, {"p_limit": limit})
                else:
                    page = conn.execute(s.unfinished_page, {"p_limit": limit, "p_after": after})
                rows = [_rehome_row(row) for row in page]
                following = rows[-1][0] if len(rows) == limit else None
            wanted = misplaced(rows, shards=shards, shard_of=shard_of)
            if dry_run or not wanted:
                return RehomeResult(scanned=len(rows), moved=tuple(wanted), after=following)
            params = {
                "r_ids": [move.id for move in wanted],
                "r_from": [move.from_shard for move in wanted],
                "r_to": [move.to_shard for move in wanted],
            }
            done = set(conn.execute(s.rehome, params).scalars())
            return RehomeResult(
                scanned=len(rows),
                moved=tuple(move for move in wanted if move.id in done),
                after=following,
            )

        # One transaction per batch: a batch that fails moves nothing, and
        # the next one (or the next pass) reads the same rows again.
        return self.database.transaction("rehome", run)

    def _stranded(
        self, conn: Connection, shards: int, limit: int, *, in_flight: bool
    ) -> list[RehomeRow]:
        """Up to ``limit`` rows in shards ``>= shards``: the soonest due
        pending ones of every such shard, then (``in_flight``) those in flight."""
        s = self.statements
        rows: list[RehomeRow] = []
        shard = shards - 1
        while True:
            found = conn.execute(s.next_stranded_shard, {"p_after": shard}).scalar_one_or_none()
            if found is None:
                break
            shard = int(found)
            params = {"p_shard": shard, "p_limit": limit}
            rows.extend(_rehome_row(row) for row in conn.execute(s.stranded_pending, params))
        # Each shard's soonest, merged: the soonest of them all move first.
        rows.sort(key=lambda row: (row[4], row[0].bytes))
        del rows[limit:]
        if in_flight and len(rows) < limit:
            params = {"p_shards": shards, "p_limit": limit - len(rows)}
            rows.extend(_rehome_row(row) for row in conn.execute(s.stranded_in_flight, params))
        return rows

    def placed_for(self) -> int | None:
        value = self.database.transaction(
            "placed_for", lambda conn: conn.execute(self._jq.placed_for).scalar_one_or_none()
        )
        return None if value is None else int(value)

    def record_placement(self, shards: int) -> None:
        self.database.transaction(
            "record_placement",
            lambda conn: conn.execute(self._jq.record_placement, {"p_shards": shards}),
        )

    def reconcile(
        self, *, shard: int, epoch: int, limit: int, default_visibility_timeout: float
    ) -> ReconcileResult:
        """Requeue stale dispatched jobs, retrying jobs whose retry is
        overdue, and running jobs past their max_runtime.

        ``requeued`` and ``dead`` count every job moved; ``timed_out`` counts
        those of them that were running past their ``max_runtime`` (the rest
        never started); ``untracked`` those marked ``sent`` instead (no worker
        tracks their task). At most ``limit`` rows in all, stale dispatched
        jobs first, then overdue retries.
        """
        timeout = default_visibility_timeout
        s = self.statements

        def run(conn: Connection) -> ReconcileResult:
            self._fence(conn, shard, epoch)
            params = {"p_shard": shard, "p_limit": limit, "default_timeout": timeout}
            moved = list(conn.execute(s.requeue_dispatched, params).scalars())
            untracked = 0
            if len(moved) < limit:
                params["p_limit"] = limit - len(moved)
                untracked = len(conn.execute(s.mark_untracked, params).scalars().all())
            if len(moved) + untracked < limit:
                params["p_limit"] = limit - len(moved) - untracked
                moved += conn.execute(s.requeue_retrying, params).scalars()
            overran: list[str] = []
            if len(moved) + untracked < limit:
                params["p_limit"] = limit - len(moved) - untracked
                overran = list(conn.execute(s.requeue_running, params).scalars())
            dead = sum(1 for status in (*moved, *overran) if status == JobStatus.DEAD.value)
            return ReconcileResult(
                requeued=len(moved) + len(overran) - dead,
                dead=dead,
                timed_out=len(overran),
                untracked=untracked,
            )

        if limit <= 0:
            # Still fenced: a stale leader must learn it is stale.
            self.database.transaction("reconcile", lambda conn: self._fence(conn, shard, epoch))
            return ReconcileResult()
        result = self.database.transaction("reconcile", run)
        if result.requeued or result.dead or result.timed_out or result.untracked:
            logger.info(
                "shard %d: reconciler requeued %d, marked %d dead, timed out %d, "
                "left %d untracked as sent",
                shard,
                result.requeued,
                result.dead,
                result.timed_out,
                result.untracked,
            )
        return result

    def rescue(
        self, *, shard: int, epoch: int, limit: int, worker_timeout: float
    ) -> ReconcileResult:
        if limit <= 0:
            # Still fenced: a stale leader must learn it is stale.
            self.database.transaction("rescue", lambda conn: self._fence(conn, shard, epoch))
            return ReconcileResult()
        params = {"p_shard": shard, "p_limit": limit, "p_worker_timeout": worker_timeout}

        def run(conn: Connection) -> list[str]:
            self._fence(conn, shard, epoch)
            return list(conn.execute(self.statements.rescue, params).scalars())

        statuses = self.database.transaction("rescue", run)
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

    # -- housekeeping -------------------------------------------------------

    def prepare_storage(self) -> None:
        self.partitions.create_ahead(self.now())

    def ensure_partitions(self, due_times: Iterable[dt.datetime]) -> None:
        """Create the partitions that hold every due time from the earliest
        to the latest of ``due_times``: for rows written around the store
        (benchmarks and tools loading with SQL of their own)."""
        times = sorted(due_times)
        if not times:
            return
        days = (times[-1] - times[0]).days + 1
        span = [times[0] + dt.timedelta(days=i) for i in range(days)] + [times[-1]]
        self.database.transaction(
            "ensure_partitions", lambda conn: self.partitions.ensure(conn, span)
        )

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        # Whole partitions first: a day whose every job finished long ago
        # goes with one DROP (no row-by-row WAL, no dead tuples to vacuum).
        total = sum(rows for _, rows in self.partitions.drop_finished(older_than=older_than))
        # The records of claims that went out are read by the reconciler a
        # visibility timeout after the claim: kept as long as finished jobs.
        self.database.transaction(
            "prune_published",
            lambda conn: conn.execute(self.statements.prune_published, {"older_than": older_than}),
        )
        params = {"older_than": older_than, "batch": batch}
        for _ in itertools.repeat(None) if max_batches is None else range(max_batches):
            # One transaction per batch keeps locks and WAL bursts small.
            deleted: int = self.database.transaction(
                "prune", lambda conn: conn.execute(self._jq.prune, params).scalar_one()
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
        compiled = self.statements.claim_due.compile(dialect=self.engine.dialect)
        sql = "EXPLAIN " + str(compiled)
        # The bound a claim gets from its fence (now(), read just before).
        horizon = self.now()
        params = compiled.construct_params(
            {"p_shard": shard, "p_epoch": 0, "p_limit": limit, "p_horizon": horizon, "p_claim": 0}
        )
        rows = self.database.transaction(
            "explain_claim", lambda conn: conn.exec_driver_sql(sql, params).all()
        )
        return "\n".join(row[0] for row in rows)


# -- job rows ------------------------------------------------------------------


def _claimed_jobs(conn: Connection, stmt: RawStatement, params: dict[str, Any]) -> list[Job]:
    """Run a claim on ``conn``'s raw cursor and load its rows straight into
    :class:`Job` with psycopg's C row loading (SQLAlchemy's per-row work
    costs several times the statement)."""
    with raw_cursor(conn) as cur:
        # Never prepared: planned with its values each time, so the
        # partitions past p_horizon are left out of the plan (a prepared
        # generic plan would hold every partition, and sort the backlog).
        # Rows come back in binary: the body is copied instead of
        # hex-encoded by the server and decoded here, and timestamps,
        # uuids and integers load without parsing text (the claim's
        # client CPU 3.8-4.1 -> 3.2-3.3 us per job, in one process).
        cur.execute(stmt.sql, stmt.params(**params), prepare=False, binary=True)
        names = [column.name for column in cur.description or ()]
        rows = cur.fetchall()
        options_at = names.index("options")
        if cur.description[options_at].type_code != _TEXT_OID:  # type: ignore[index]
            return jobs_from_rows(names, rows)
        return jobs_from_rows(names, _decode_options(rows, options_at))


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


def _rowcount(cur: psycopg.Cursor[Any]) -> int:
    return max(0, cur.rowcount)


def _first_column(cur: psycopg.Cursor[Any]) -> list[Any]:
    return [row[0] for row in cur.fetchall()]


def _rehome_row(row: Sequence[Any]) -> RehomeRow:
    return (row[0], row[1], int(row[2]), row[3], row[4])


def _sort_due(jobs: list[Job]) -> list[Job]:
    # RETURNING gives no order guarantee; callers publish oldest first.
    # Ties on the due time are common (a bulk schedule shares one), and
    # comparing UUID objects runs Python code per comparison: their integer
    # compares in C, in the same order (a tenth of the claim's client CPU).
    jobs.sort(key=lambda job: (job.due_at, job.id.int))
    return jobs


def job_of(row: Row[Any]) -> Job:
    """The :class:`Job` of a row read with :func:`~.statements.job_columns`."""
    return Job(**row._mapping)


def _stored_row(job: NewJob) -> NewJobRow:
    row = job.as_row()
    key = stored_key(job)
    return row if key is not None else (row[0], None, *row[2:])


def key_params(key: str) -> dict[str, Any]:
    """The parameters of :func:`~.statements.key_matches` for ``key``."""
    return {"p_key": key, "p_key_id": id_of_key(key)}


def row_values(job: NewJob) -> dict[str, Any]:
    """The column values of ``job``'s new row."""
    return {
        "id": job.id,
        "key": stored_key(job),
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
