"""The periodic schedules on PostgreSQL (statements in
:mod:`~celery_sched.store.postgres.schedule_queries`)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Row, any_, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from celery_sched.errors import (
    DuplicateJob,
    InvalidSchedule,
    ScheduleExists,
    UnknownSchedule,
)
from celery_sched.interfaces import ScheduleStore
from celery_sched.models import (
    Job,
    NewJob,
    NewSchedule,
    PlanCommit,
    ScheduleAdvance,
    ScheduleRuns,
    StoredSchedule,
    SyncResult,
)
from celery_sched.settings import Settings
from celery_sched.store.postgres.base import PostgresStoreBase
from celery_sched.store.postgres.bulk import copy_schedule_rows
from celery_sched.store.postgres.jobs import (
    OCCURRENCE_CHUNK,
    JobQueries,
    job_of,
    key_params,
    row_values,
)
from celery_sched.store.postgres.keys import stored_key
from celery_sched.store.postgres.schedule_queries import (
    DEFINITION_COLUMNS,
    UNBROKEN,
    ScheduleQueries,
)
from celery_sched.timeutil import ensure_utc

logger = logging.getLogger(__name__)


class PostgresScheduleStore(PostgresStoreBase, ScheduleStore):
    """:class:`~celery_sched.interfaces.ScheduleStore` on PostgreSQL."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        tables = self.statements.tables
        self._sq = ScheduleQueries(tables)
        # A triggered occurrence is written as a job insert with if_exists="return".
        jobs = JobQueries(tables)
        self._insert_or_nothing = jobs.insert_or_nothing
        self._get_by_key = jobs.get_by_key

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
            copy_schedule_rows(conn, self._sq.copy_schedules_sql, rows)
            return len(rows)

        try:
            count = self.database.transaction("add_schedules", write)
        except DuplicateJob as exc:
            # A concurrent add of the same name won the unique index.
            raise ScheduleExists(f"a schedule with that name already exists ({exc})") from exc
        logger.info("added %d schedules", count)
        return count

    def get_schedule(self, name: str) -> StoredSchedule | None:
        row = self.database.transaction(
            "get_schedule", lambda conn: conn.execute(self._sq.get, {"p_name": name}).first()
        )
        return None if row is None else _stored_schedule(row)

    def schedules_by_id(self, schedule_ids: Sequence[int]) -> dict[int, StoredSchedule]:
        ids = list(dict.fromkeys(schedule_ids))
        if not ids:
            return {}
        table = self._sq.schedules
        stmt = select(table).where(table.c.id == any_(bindparam("p_ids", type_=ARRAY(BigInteger))))
        rows = self.database.transaction(
            "schedules_by_id", lambda conn: conn.execute(stmt, {"p_ids": ids}).all()
        )
        return {schedule.id: schedule for schedule in map(_stored_schedule, rows)}

    def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[StoredSchedule]:
        table = self._sq.schedules
        stmt = select(table).order_by(table.c.name)
        if after is not None:
            stmt = stmt.where(table.c.name > after)
        if limit is not None:
            stmt = stmt.limit(max(limit, 0))
        rows = self.database.transaction("list_schedules", lambda conn: conn.execute(stmt).all())
        return [_stored_schedule(row) for row in rows]

    def count_schedules(self) -> dict[str, int]:
        rows = self.database.transaction(
            "count_schedules", lambda conn: conn.execute(self._sq.counts).all()
        )
        return {state: count for state, count in rows}

    def schedule_runs(self, schedule_ids: Sequence[int]) -> dict[int, ScheduleRuns]:
        ids = list(dict.fromkeys(schedule_ids))
        if not ids:
            return {}
        rows = self.database.transaction(
            "schedule_runs", lambda conn: conn.execute(self._sq.runs, {"ids": ids}).all()
        )
        return {
            schedule_id: ScheduleRuns(
                next_due_at=next_due, last_due_at=last_due, last_status=last_status
            )
            for schedule_id, next_due, last_due, last_status in rows
            if next_due is not None or last_due is not None
        }

    def schedule_history(self, schedule_id: int, *, limit: int) -> list[Job]:
        if limit < 1:
            return []
        params = {"p_id": schedule_id, "p_limit": limit}
        rows = self.database.transaction(
            "schedule_history", lambda conn: conn.execute(self._sq.history, params).all()
        )
        return [job_of(row) for row in rows]

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
            changes: dict[str, Any] = {**values, **UNBROKEN}
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

        return self.database.transaction("replace_schedule", write)

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
                        **({} if paused else UNBROKEN),
                    )
                )
                if paused:
                    self._withdraw(conn, [row.id], roll_back={row.id})
            return _stored_schedule(conn.execute(self._sq.get, {"p_name": name}).one())

        return self.database.transaction("set_schedule_paused", write)

    def delete_schedule(self, name: str) -> bool:
        def write(conn: Connection) -> bool:
            row = conn.execute(self._sq.get_for_update, {"p_name": name}).first()
            if row is None:
                return False
            self._withdraw(conn, [row.id], roll_back=set())
            conn.execute(self._sq.delete, {"p_id": row.id})
            return True

        deleted = self.database.transaction("delete_schedule", write)
        if deleted:
            logger.info("deleted schedule %s", name)
        return deleted

    def trigger_occurrence(self, job: NewJob, *, skip_if_busy: bool) -> Job | None:
        if job.schedule_id is None:
            raise ValueError("a triggered occurrence needs its schedule_id")
        values = row_values(job)

        def write(conn: Connection) -> Job | None:
            locked = conn.execute(self._sq.lock_by_id, {"p_id": job.schedule_id}).first()
            if locked is None:
                raise UnknownSchedule(f"schedule {job.schedule_id} no longer exists")
            if skip_if_busy and conn.execute(self._sq.running, {"ids": [job.schedule_id]}).first():
                return None
            self.partitions.ensure(conn, [job.due_at])
            free = (
                values["key"] is None
                or conn.execute(
                    self.job_keys.take_if_free, {"p_key": values["key"], "p_id": job.id}
                ).first()
            )
            row = conn.execute(self._insert_or_nothing, values).first() if free else None
            if row is None:
                row = conn.execute(self._get_by_key, key_params(job.key)).one()
            return job_of(row)

        return self.with_partitions(lambda: self.database.transaction("trigger_occurrence", write))

    def sync_static_schedules(self, schedules: Sequence[NewSchedule]) -> SyncResult:
        rows = [_schedule_values(schedule) for schedule in schedules]
        _refuse_duplicate_names(rows)
        for row in rows:
            row["source"] = "static"
        q = self._sq

        def write(conn: Connection) -> SyncResult:
            q.staged.create(conn)
            copy_schedule_rows(conn, q.copy_staged_sql, rows)
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

        return self.database.transaction("sync_static_schedules", write)

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
        rows = self.database.transaction(
            "due_schedules", lambda conn: conn.execute(stmt, params).all()
        )
        return [_stored_schedule(row) for row in rows]

    def busy_schedules(self, schedule_ids: Sequence[int]) -> set[int]:
        ids = list(dict.fromkeys(schedule_ids))
        if not ids:
            return set()
        return set(
            self.database.transaction(
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
            self.partitions.ensure(conn, (job.due_at for job in jobs))
            for start in range(0, len(jobs), OCCURRENCE_CHUNK):
                free = self.job_keys.free_jobs(conn, jobs[start : start + OCCURRENCE_CHUNK])
                if not free:
                    continue
                chunk = _occurrence_arrays(free)
                result = conn.execute(self._sq.add_occurrences, chunk)
                written.extend((job_id, ensure_utc(due), shard) for job_id, due, shard in result)
            return PlanCommit(written=written, stale=len(ordered) - len(applied), busy=busy)

        return self.with_partitions(lambda: self.database.transaction("commit_plans", write))

    def mark_schedule_broken(self, schedule_id: int, *, version: int, reason: str) -> bool:
        marked = self.database.rowcount(
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


def _occurrence_arrays(jobs: Sequence[NewJob]) -> dict[str, list[Any]]:
    """The ``u_<column>`` array parameters of ``add_occurrences``."""
    options: dict[int, str] = {}

    def as_json(value: Any) -> str:
        # Occurrences of one schedule share their options mapping.
        text = options.get(id(value))
        if text is None:
            text = options[id(value)] = json.dumps(dict(value)) if value else "{}"
        return text

    return {
        "u_id": [job.id for job in jobs],
        "u_key": [stored_key(job) for job in jobs],
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
