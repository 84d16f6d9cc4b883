"""An in-memory :class:`~celery_sched.interfaces.JobStore` for unit tests.

It mirrors the PostgreSQL store's semantics exactly (the contract suite in
``tests/contract`` runs against both): one lock stands in for transactions,
and the injectable ``clock`` plays Postgres ``now()``. Nothing here is meant
for production: everything is lost with the process.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from celery_sched.errors import (
    DuplicateJob,
    InvalidSchedule,
    ScheduleExists,
    StaleEpoch,
    UnknownSchedule,
)
from celery_sched.interfaces import JobStore, Ledger
from celery_sched.models import (
    ADOPTABLE_STATUSES,
    FINISHED_STATUSES,
    UNFINISHED_STATUSES,
    Job,
    JobStatus,
    LedgerState,
    NewJob,
    NewSchedule,
    PlanCommit,
    ReconcileResult,
    ScheduleAdvance,
    ScheduleRuns,
    StoredSchedule,
    SyncResult,
    WorkerUpdate,
    check_retry_in,
)
from celery_sched.timeutil import UTC, ensure_utc, to_bucket

_CLAIMABLE_BY_WORKER = frozenset({JobStatus.DISPATCHED, JobStatus.RETRYING, JobStatus.PENDING})


def _utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


class MemoryJobStore(JobStore):
    """Jobs in a dict, guarded by one lock.

    ``clock`` returns the store's "now" (aware UTC); tests pass a fake clock
    to move time without sleeping.
    """

    def __init__(
        self, clock: Callable[[], dt.datetime] | None = None, *, ledger: Ledger | None = None
    ) -> None:
        self._clock = clock or _utcnow
        # Postgres reads the ledger table from the jobs' database; here the
        # rescuer asks this ledger which jobs completed.
        self._ledger = ledger
        self._workers: dict[tuple[str, int], list[dt.datetime]] = {}
        self._lock = threading.RLock()
        self._jobs: dict[uuid.UUID, Job] = {}
        self._by_key: dict[str, uuid.UUID] = {}
        self._epochs: dict[int, int] = {}
        self._holders: dict[int, str] = {}
        self._schedules: dict[str, StoredSchedule] = {}
        self._schedule_ids = itertools.count(1)
        self._closed = False

    # -- lifecycle ----------------------------------------------------------

    def migrate(self) -> None:
        """Nothing to create; present for interface parity."""

    def close(self) -> None:
        self._closed = True

    def now(self) -> dt.datetime:
        value = self._clock()
        if value.tzinfo is None:
            raise ValueError("MemoryJobStore clock must return an aware datetime")
        return value.astimezone(UTC)

    # -- writing jobs -------------------------------------------------------

    def insert(self, job: NewJob, *, if_exists: Literal["raise", "return"] = "raise") -> Job:
        with self._lock:
            existing = self._by_key.get(job.key)
            if existing is not None:
                if if_exists == "return":
                    return self._jobs[existing]
                raise DuplicateJob(key=job.key)
            if job.id in self._jobs:
                raise DuplicateJob(f"a job with id {job.id} already exists", key=job.key)
            stored = self._new_row(job, self.now())
            self._put(stored)
            return stored

    def insert_many(self, jobs: Iterable[NewJob]) -> int:
        with self._lock:
            now = self.now()
            staged: dict[str, Job] = {}
            ids: set[uuid.UUID] = set()
            # The iterable is consumed lazily, as COPY would stream it; an
            # exception it raises propagates unchanged and nothing is kept.
            for job in jobs:
                if job.key in self._by_key or job.key in staged:
                    raise DuplicateJob(key=job.key)
                if job.id in self._jobs or job.id in ids:
                    raise DuplicateJob(f"a job with id {job.id} already exists", key=job.key)
                staged[job.key] = self._new_row(job, now)
                ids.add(job.id)
            for stored in staged.values():
                self._put(stored)
            return len(staged)

    def insert_occurrences(self, jobs: Sequence[NewJob]) -> list[uuid.UUID]:
        with self._lock:
            now = self.now()
            written: list[uuid.UUID] = []
            for job in jobs:
                if job.key in self._by_key or job.id in self._jobs:
                    continue
                self._put(self._new_row(job, now))
                written.append(job.id)
            return written

    # -- reading ------------------------------------------------------------

    def get(self, key: str) -> Job | None:
        with self._lock:
            job_id = self._by_key.get(key)
            return None if job_id is None else self._jobs[job_id]

    def get_by_id(self, job_id: uuid.UUID) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def adopt_delivery(
        self, job_id: uuid.UUID, attempt: int | None
    ) -> tuple[Job | None, int | None]:
        """The memory twin of the PostgreSQL ledger's adoption step (see
        :meth:`~celery_sched.interfaces.Ledger.check_delivery`): the job as
        it was, and the attempt a delivery of ``attempt`` took it over as
        (``None`` when it did not)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if (
                job is None
                or attempt is None
                or job.status not in ADOPTABLE_STATUSES
                or job.attempt <= attempt
            ):
                return job, None
            adopted = self._update(
                job,
                status=JobStatus.RUNNING,
                attempt=job.attempt + 1,
                started_at=self.now(),
                worker=None,
                worker_pid=None,
            )
            return job, adopted.attempt

    def counts_by_status(self) -> dict[JobStatus, int]:
        with self._lock:
            counts: dict[JobStatus, int] = {}
            for job in self._jobs.values():
                counts[job.status] = counts.get(job.status, 0) + 1
            return counts

    def counts_by_hour(self, status: JobStatus | None = None) -> dict[dt.datetime, int]:
        with self._lock:
            counts: dict[dt.datetime, int] = {}
            for job in self._jobs.values():
                if status is not None and job.status != status:
                    continue
                hour = job.due_at.replace(minute=0, second=0, microsecond=0)
                counts[hour] = counts.get(hour, 0) + 1
            return counts

    # -- user transitions ---------------------------------------------------

    def cancel(self, key: str) -> bool:
        with self._lock:
            job_id = self._by_key.get(key)
            if job_id is None:
                return False
            job = self._jobs[job_id]
            if job.status != JobStatus.PENDING:
                return False
            self._update(job, status=JobStatus.CANCELLED, finished_at=self.now())
            return True

    # -- leadership fencing -------------------------------------------------

    def acquire_epoch(self, shard: int, holder: str) -> int:
        with self._lock:
            epoch = self._epochs.get(shard, 0) + 1
            self._epochs[shard] = epoch
            self._holders[shard] = holder
            return epoch

    def current_epoch(self, shard: int) -> int:
        with self._lock:
            return self._epochs.get(shard, 0)

    def _check_epoch(self, shard: int, epoch: int) -> None:
        current = self._epochs.get(shard, 0)
        if current == 0 or epoch != current:
            raise StaleEpoch(
                f"epoch {epoch} is not the current epoch {current} of shard {shard}; "
                "another leader took over"
            )

    # -- dispatch transitions -----------------------------------------------

    def due_soon(
        self,
        *,
        shard: int,
        within: float,
        limit: int,
        after: dt.datetime | None = None,
    ) -> list[tuple[uuid.UUID, dt.datetime]]:
        if after is not None:
            after = ensure_utc(after, name="after")
        with self._lock:
            horizon = self.now() + dt.timedelta(seconds=within)
            rows = [
                job
                for job in self._jobs.values()
                if job.shard == shard
                and job.status == JobStatus.PENDING
                and job.due_at <= horizon
                and (after is None or job.due_at > after)
            ]
            rows.sort(key=_due_order)
            return [(job.id, job.due_at) for job in rows[: max(limit, 0)]]

    def claim_due(self, *, shard: int, epoch: int, limit: int) -> list[Job]:
        if limit <= 0:
            # Like the Postgres store: an empty claim touches nothing, fence included.
            return []
        with self._lock:
            self._check_epoch(shard, epoch)
            now = self.now()
            rows = [
                job
                for job in self._jobs.values()
                if job.shard == shard and job.status == JobStatus.PENDING and job.due_at <= now
            ]
            return self._claim(rows, epoch, now, limit)

    def claim_ids(self, ids: Sequence[uuid.UUID], *, shard: int, epoch: int) -> list[Job]:
        with self._lock:
            self._check_epoch(shard, epoch)
            now = self.now()
            rows = []
            for job_id in set(ids):
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and job.shard == shard
                    and job.status == JobStatus.PENDING
                    and job.due_at <= now
                ):
                    rows.append(job)
            return self._claim(rows, epoch, now, len(rows))

    def _claim(self, rows: list[Job], epoch: int, now: dt.datetime, limit: int) -> list[Job]:
        rows.sort(key=_due_order)
        return [
            self._update(job, status=JobStatus.DISPATCHED, dispatched_at=now, leader_epoch=epoch)
            for job in rows[: max(limit, 0)]
        ]

    def release(self, ids: Sequence[uuid.UUID], *, epoch: int) -> int:
        return self._move_fenced(ids, epoch, status=JobStatus.PENDING, dispatched_at=None)

    def mark_expired(self, ids: Sequence[uuid.UUID], *, epoch: int, reason: str) -> int:
        with self._lock:
            now = self.now()
            # Re-checked by the store's clock, as the Postgres statement does.
            due = [
                job_id
                for job_id in ids
                if (job := self._jobs.get(job_id)) is not None
                and job.expires_at is not None
                and job.expires_at <= now
            ]
            return self._move_fenced(
                due, epoch, status=JobStatus.EXPIRED, finished_at=now, last_error=reason
            )

    def fail_dispatch(
        self, failures: Sequence[tuple[uuid.UUID, str]], *, epoch: int
    ) -> ReconcileResult:
        with self._lock:  # one lock stands in for the one statement
            now = self.now()
            moved = dead = 0
            for job_id, reason in dict(failures).items():
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and job.status == JobStatus.DISPATCHED
                    and job.leader_epoch == epoch
                ):
                    dead += self._requeue(job, now, f"not published: {reason}")
                    moved += 1
            return ReconcileResult(requeued=moved - dead, dead=dead)

    def unfinished_by_shard(self, *, from_shard: int) -> dict[int, dict[JobStatus, int]]:
        found: dict[int, dict[JobStatus, int]] = {}
        with self._lock:
            for job in self._jobs.values():
                if job.shard >= from_shard and job.status in UNFINISHED_STATUSES:
                    per_status = found.setdefault(job.shard, {})
                    per_status[job.status] = per_status.get(job.status, 0) + 1
        return found

    def _move_fenced(self, ids: Sequence[uuid.UUID], epoch: int, **changes: Any) -> int:
        """Apply ``changes`` to the dispatched jobs among ``ids`` claimed by ``epoch``."""
        with self._lock:
            moved = 0
            for job_id in set(ids):
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and job.status == JobStatus.DISPATCHED
                    and job.leader_epoch == epoch
                ):
                    self._update(job, **changes)
                    moved += 1
            return moved

    def reconcile(
        self, *, shard: int, epoch: int, limit: int, default_visibility_timeout: float
    ) -> ReconcileResult:
        """Stale dispatched jobs first (oldest dispatch first), then retrying
        jobs whose retry is overdue (oldest due first), then running jobs past
        their max_runtime, ``limit`` rows in all. ``timed_out`` counts the
        latter; ``requeued`` and ``dead`` count every job moved."""
        with self._lock:
            self._check_epoch(shard, epoch)
            now = self.now()
            limit = max(limit, 0)
            stale: list[Job] = []
            retries: list[Job] = []
            overran: list[Job] = []
            for job in self._jobs.values():
                if job.shard != shard:
                    continue
                if (
                    job.status in (JobStatus.DISPATCHED, JobStatus.RETRYING)
                    and job.dispatched_at is not None
                ):
                    timeout = (
                        job.visibility_timeout
                        if job.visibility_timeout is not None
                        else default_visibility_timeout
                    )
                    if job.dispatched_at < now - dt.timedelta(seconds=timeout):
                        # A retrying job's dispatched_at is when its retry is due.
                        (stale if job.status == JobStatus.DISPATCHED else retries).append(job)
                elif (
                    job.status == JobStatus.RUNNING
                    and job.max_runtime is not None
                    and job.started_at is not None
                    and job.started_at < now - dt.timedelta(seconds=job.max_runtime)
                ):
                    overran.append(job)
            stale.sort(key=lambda job: (job.dispatched_at, str(job.id)))
            retries.sort(key=lambda job: (job.dispatched_at, str(job.id)))
            overran.sort(key=lambda job: (job.started_at, str(job.id)))
            stale = stale[:limit]
            retries = retries[: limit - len(stale)]
            overran = overran[: limit - len(stale) - len(retries)]
            dead = 0
            for job in (*stale, *retries):
                timeout = (
                    job.visibility_timeout
                    if job.visibility_timeout is not None
                    else default_visibility_timeout
                )
                reason = (
                    f"not started within {timeout:g}s of dispatch"
                    if job.status == JobStatus.DISPATCHED
                    else f"its retry did not start within {timeout:g}s of its ETA "
                    f"{job.dispatched_at}"
                )
                dead += self._requeue(job, now, reason, started_at=None)
            for job in overran:
                dead += self._requeue(
                    job,
                    now,
                    f"ran longer than max_runtime {job.max_runtime:g}s on "
                    f"{job.worker or 'an unknown worker'}",
                    started_at=None,
                )
            moved = len(stale) + len(retries) + len(overran)
            return ReconcileResult(requeued=moved - dead, dead=dead, timed_out=len(overran))

    def _requeue(self, job: Job, now: dt.datetime, reason: str, **changes: Any) -> int:
        """pending with attempt + 1, or dead once out of attempts; 1 if dead."""
        attempt = job.attempt + 1
        gives_up = attempt >= job.max_attempts
        self._update(
            job,
            status=JobStatus.DEAD if gives_up else JobStatus.PENDING,
            attempt=attempt,
            dispatched_at=None,
            finished_at=now if gives_up else None,
            last_error=(
                f"{reason} (attempt {attempt} of {job.max_attempts})"
                + ("; giving up" if gives_up else "")
            ),
            **changes,
        )
        return 1 if gives_up else 0

    def rescue(
        self, *, shard: int, epoch: int, limit: int, worker_timeout: float
    ) -> ReconcileResult:
        with self._lock:
            self._check_epoch(shard, epoch)
            now = self.now()
            silent_since = now - dt.timedelta(seconds=worker_timeout)
            orphaned: list[tuple[Job, dt.datetime]] = []
            for job in self._jobs.values():
                if (
                    job.shard != shard
                    or job.status != JobStatus.RUNNING
                    or job.started_at is None
                    or job.started_at >= silent_since
                ):
                    continue
                beats = [
                    (started, seen)
                    for (host, pid), (started, seen) in self._workers.items()
                    if host == job.worker and (job.worker_pid is None or pid == job.worker_pid)
                ]
                alive = any(
                    seen >= silent_since and started <= job.started_at for started, seen in beats
                )
                if job.worker is None:
                    # Taken over by an older copy whose process never reported.
                    orphaned.append((job, job.started_at))
                elif beats and not alive:
                    orphaned.append((job, max(seen for _, seen in beats)))
            orphaned.sort(key=lambda pair: (pair[0].started_at, str(pair[0].id)))
            dead = succeeded = 0
            for job, seen in orphaned[: max(limit, 0)]:
                reason = (
                    f"its worker {job.worker} (pid "
                    f"{'unknown' if job.worker_pid is None else job.worker_pid}) stopped "
                    f"beating: last heartbeat at {seen}, worker timeout {worker_timeout:g}s; "
                )
                if self._completed(job):
                    self._update(
                        job,
                        status=JobStatus.SUCCEEDED,
                        finished_at=now,
                        last_error=reason + "its ledger entry records it completed",
                    )
                    succeeded += 1
                else:
                    dead += self._requeue(job, now, reason + "requeued", started_at=None)
            moved = len(orphaned[: max(limit, 0)])
            return ReconcileResult(
                requeued=moved - dead - succeeded,
                dead=dead,
                rescued=moved,
                succeeded=succeeded,
            )

    def _completed(self, job: Job) -> bool:
        """Whether the ledger records that this very job completed."""
        if self._ledger is None:
            return False
        entry = self._ledger.get(job.key)
        return entry is not None and entry.state == LedgerState.COMPLETED and entry.job_id == job.id

    def prune_workers(self, *, older_than: float) -> int:
        with self._lock:
            cutoff = self.now() - dt.timedelta(seconds=older_than)
            gone = [name for name, (_, seen) in self._workers.items() if seen < cutoff]
            for name in gone:
                del self._workers[name]
            return len(gone)

    # -- worker transitions -------------------------------------------------

    def heartbeat(self, hostname: str, pid: int, *, first: bool = False) -> None:
        with self._lock:
            now = self.now()
            row = self._workers.get((hostname, pid))
            started = now if row is None or first else row[0]
            self._workers[(hostname, pid)] = [started, now]

    def mark_running(
        self, job_id: uuid.UUID, *, worker: str, worker_pid: int | None = None
    ) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return False
            # Taken over by an older copy (see adopt_delivery): named now.
            adopted = job.status == JobStatus.RUNNING and job.worker is None
            if job.status not in _CLAIMABLE_BY_WORKER and not adopted:
                return False
            self._update(
                job,
                status=JobStatus.RUNNING,
                started_at=job.started_at if adopted else self.now(),
                worker=worker,
                worker_pid=worker_pid,
            )
            return True

    def _lost(self, update: WorkerUpdate) -> bool:
        job = self._jobs.get(update.job_id)
        if (
            job is None
            or job.status not in (JobStatus.DISPATCHED, JobStatus.RUNNING)
            or (update.attempt is not None and job.attempt != update.attempt)
        ):
            return False
        reason = update.error or "its worker process was lost"
        self._requeue(job, self.now(), reason, started_at=None)
        return True

    def mark_finished(
        self, job_id: uuid.UUID, status: JobStatus, *, error: str | None = None
    ) -> bool:
        status = JobStatus(status)
        if not status.finished:
            raise ValueError(f"mark_finished needs a finished status, got {status.value!r}")
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.status in FINISHED_STATUSES:
                return False
            self._update(job, status=status, finished_at=self.now(), last_error=error)
            return True

    def mark_retrying(
        self, job_id: uuid.UUID, *, error: str | None = None, retry_in: float | None = None
    ) -> bool:
        delay = dt.timedelta(seconds=check_retry_in(retry_in) or 0.0)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.status != JobStatus.RUNNING:
                return False
            self._update(
                job,
                status=JobStatus.RETRYING,
                dispatched_at=self.now() + delay,
                last_error=error,
            )
            return True

    def apply_worker_updates(self, updates: Sequence[WorkerUpdate]) -> int:
        changed = 0
        with self._lock:  # one lock stands in for the one transaction
            for update in updates:
                if update.status == JobStatus.RUNNING:
                    # A delivery of an older attempt must not move a requeued row.
                    job = self._jobs.get(update.job_id)
                    stale = (
                        job is not None
                        and update.attempt is not None
                        and job.attempt > update.attempt
                    )
                    done = not stale and self.mark_running(
                        update.job_id, worker=update.worker or "", worker_pid=update.worker_pid
                    )
                elif update.status == JobStatus.PENDING:
                    done = self._lost(update)
                elif update.status == JobStatus.RETRYING:
                    done = self.mark_retrying(
                        update.job_id, error=update.error, retry_in=update.retry_in
                    )
                else:
                    done = self.mark_finished(update.job_id, update.status, error=update.error)
                changed += done
        return changed

    # -- housekeeping -------------------------------------------------------

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        total = 0
        for _ in itertools.repeat(None) if max_batches is None else range(max_batches):
            # One "transaction" per batch, as the real store deletes in batches.
            with self._lock:
                cutoff = self.now() - dt.timedelta(seconds=older_than)
                victims = [
                    job
                    for job in self._jobs.values()
                    if job.status in FINISHED_STATUSES
                    and job.finished_at is not None
                    and job.finished_at < cutoff
                ][:batch]
                for job in victims:
                    del self._jobs[job.id]
                    del self._by_key[job.key]
            total += len(victims)
            if len(victims) < batch:
                break
        return total

    # == periodic schedules ===============================================

    def add_schedules(self, schedules: Sequence[NewSchedule]) -> int:
        _refuse_duplicate_names(schedules)
        with self._lock:
            for schedule in schedules:
                if schedule.name in self._schedules:
                    raise ScheduleExists(name=schedule.name)
            now = self.now()
            for schedule in schedules:
                self._schedules[schedule.name] = self._new_schedule(schedule, now)
            return len(schedules)

    def get_schedule(self, name: str) -> StoredSchedule | None:
        with self._lock:
            return self._schedules.get(name)

    def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[StoredSchedule]:
        with self._lock:
            rows = sorted(
                (s for s in self._schedules.values() if after is None or s.name > after),
                key=lambda s: s.name,
            )
        return rows if limit is None else rows[: max(limit, 0)]

    def count_schedules(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._lock:
            for schedule in self._schedules.values():
                state = (
                    "disabled"
                    if not schedule.enabled
                    else "paused"
                    if schedule.paused
                    else "broken"
                    if schedule.broken_at is not None
                    else "active"
                )
                counts[state] = counts.get(state, 0) + 1
        return counts

    def schedule_runs(self, schedule_ids: Sequence[int]) -> dict[int, ScheduleRuns]:
        wanted = set(schedule_ids)
        with self._lock:
            now = self.now()
            nexts: dict[int, dt.datetime] = {}
            lasts: dict[int, Job] = {}
            for job in self._jobs.values():
                sid = job.schedule_id
                if sid is None or sid not in wanted:
                    continue
                if job.due_at > now:
                    if job.status == JobStatus.PENDING and (
                        sid not in nexts or job.due_at < nexts[sid]
                    ):
                        nexts[sid] = job.due_at
                elif sid not in lasts or job.due_at > lasts[sid].due_at:
                    lasts[sid] = job
        return {
            sid: ScheduleRuns(
                next_due_at=nexts.get(sid),
                last_due_at=lasts[sid].due_at if sid in lasts else None,
                last_status=lasts[sid].status if sid in lasts else None,
            )
            for sid in wanted
            if sid in nexts or sid in lasts
        }

    def replace_schedule(
        self, schedule: NewSchedule, *, expected_version: int, restart: bool
    ) -> StoredSchedule | None:
        with self._lock:
            stored = self._schedules.get(schedule.name)
            if stored is None:
                raise UnknownSchedule(name=schedule.name)
            if stored.version != expected_version:
                return None
            changes = _definition(schedule)
            changes.update(_UNBROKEN)
            if restart:
                changes.update(last_nominal_at=None, next_nominal_at=schedule.next_nominal_at)
            self._change_schedule(stored, **changes)
            self._withdraw([stored.id], roll_back=set() if restart else {stored.id})
            return self._schedules[schedule.name]

    def set_schedule_paused(self, name: str, paused: bool) -> StoredSchedule:
        with self._lock:
            stored = self._schedules.get(name)
            if stored is None:
                raise UnknownSchedule(name=name)
            if stored.paused != paused:
                self._change_schedule(stored, paused=paused, **({} if paused else _UNBROKEN))
                if paused:
                    self._withdraw([stored.id], roll_back={stored.id})
            elif not paused and stored.broken_at is not None:
                self._change_schedule(stored, **_UNBROKEN)
            return self._schedules[name]

    def delete_schedule(self, name: str) -> bool:
        with self._lock:
            stored = self._schedules.get(name)
            if stored is None:
                return False
            self._withdraw([stored.id], roll_back=set())
            del self._schedules[name]
            return True

    def trigger_occurrence(self, job: NewJob, *, skip_if_busy: bool) -> Job | None:
        if job.schedule_id is None:
            raise ValueError("a triggered occurrence needs its schedule_id")
        with self._lock:
            if not any(s.id == job.schedule_id for s in self._schedules.values()):
                raise UnknownSchedule(f"schedule {job.schedule_id} no longer exists")
            if skip_if_busy:
                now = self.now()
                for other in self._jobs.values():
                    if (
                        other.schedule_id == job.schedule_id
                        and other.status in UNFINISHED_STATUSES
                        and (other.status != JobStatus.PENDING or other.due_at <= now)
                    ):
                        return None
            return self.insert(job, if_exists="return")

    def sync_static_schedules(self, schedules: Sequence[NewSchedule]) -> SyncResult:
        _refuse_duplicate_names(schedules)
        with self._lock:
            now = self.now()
            wanted = {s.name: dataclasses.replace(s, source="static") for s in schedules}
            added = 0
            restarted: list[int] = []
            rolled: list[int] = []
            conflicts: list[str] = []
            for name, new in wanted.items():
                stored = self._schedules.get(name)
                if stored is None:
                    self._schedules[name] = self._new_schedule(new, now)
                    added += 1
                elif stored.source != "static":
                    conflicts.append(name)
                elif stored.as_new().definition() != new.definition():
                    changes = _definition(new)
                    changes.update(
                        enabled=new.enabled,
                        disabled_at=None if new.enabled else (stored.disabled_at or now),
                        **_UNBROKEN,
                    )
                    restart = (not stored.enabled and new.enabled) or (
                        stored.as_new().timing() != new.timing()
                    )
                    if restart:
                        changes.update(last_nominal_at=None, next_nominal_at=new.next_nominal_at)
                        restarted.append(stored.id)
                    else:
                        rolled.append(stored.id)
                    self._change_schedule(stored, **changes)
            disabled: list[int] = []
            for stored in list(self._schedules.values()):
                if stored.source == "static" and stored.enabled and stored.name not in wanted:
                    self._change_schedule(stored, enabled=False, disabled_at=now)
                    disabled.append(stored.id)
            self._withdraw([*restarted, *rolled, *disabled], roll_back=set(rolled))
            updated = len(restarted) + len(rolled)
            return SyncResult(
                added=added,
                updated=updated,
                disabled=len(disabled),
                unchanged=len(wanted) - added - updated - len(conflicts),
                conflicts=tuple(conflicts),
            )

    def due_schedules(
        self,
        *,
        horizon: dt.datetime,
        shard: int,
        shards: int,
        limit: int,
        after: tuple[dt.datetime, int] | None = None,
    ) -> list[StoredSchedule]:
        horizon = ensure_utc(horizon, name="horizon")
        if after is not None:
            after = (ensure_utc(after[0], name="after"), after[1])
        with self._lock:
            rows = [
                s
                for s in self._schedules.values()
                if s.enabled
                and not s.paused
                and s.broken_at is None
                and s.next_nominal_at is not None
                and s.next_nominal_at <= horizon
                and s.id % max(shards, 1) == shard
                and (after is None or (s.next_nominal_at, s.id) > after)
            ]
        rows.sort(key=lambda s: (s.next_nominal_at, s.id))
        return rows[: max(limit, 0)]

    def busy_schedules(self, schedule_ids: Sequence[int]) -> set[int]:
        wanted = set(schedule_ids)
        with self._lock:
            return {
                job.schedule_id
                for job in self._jobs.values()
                if job.schedule_id is not None
                and job.schedule_id in wanted
                and job.status in UNFINISHED_STATUSES
            }

    def commit_plans(self, advances: Sequence[ScheduleAdvance]) -> PlanCommit:
        with self._lock:
            by_id = {s.id: s for s in self._schedules.values()}
            now = self.now()
            written: list[tuple[uuid.UUID, dt.datetime, int]] = []
            stale = busy = 0
            for advance in sorted(advances, key=lambda a: a.schedule_id):
                stored = by_id.get(advance.schedule_id)
                if (
                    stored is None
                    or stored.version != advance.version
                    or not stored.enabled
                    or stored.paused
                    or stored.broken_at is not None
                    or (
                        stored.last_nominal_at is not None
                        and advance.last_nominal_at is not None
                        and stored.last_nominal_at > advance.last_nominal_at
                    )
                ):
                    stale += 1
                    continue
                self._schedules[stored.name] = dataclasses.replace(
                    stored,
                    last_nominal_at=advance.last_nominal_at,
                    next_nominal_at=advance.next_nominal_at,
                )
                if advance.skip_if_busy and self.busy_schedules([stored.id]):
                    busy += len(advance.occurrences)
                    continue
                for job in advance.occurrences:
                    if job.key in self._by_key or job.id in self._jobs:
                        continue
                    self._put(self._new_row(job, now))
                    written.append((job.id, job.due_at, job.shard))
            return PlanCommit(written=written, stale=stale, busy=busy)

    def mark_schedule_broken(self, schedule_id: int, *, version: int, reason: str) -> bool:
        with self._lock:
            for stored in self._schedules.values():
                if stored.id == schedule_id:
                    if stored.version != version or stored.broken_at is not None:
                        return False
                    self._schedules[stored.name] = dataclasses.replace(
                        stored, broken_at=self.now(), broken_reason=reason
                    )
                    return True
            return False

    def _new_schedule(self, schedule: NewSchedule, now: dt.datetime) -> StoredSchedule:
        return StoredSchedule(
            id=next(self._schedule_ids),
            **{f.name: getattr(schedule, f.name) for f in dataclasses.fields(NewSchedule)},
            paused=False,
            version=0,
            last_nominal_at=None,
            created_at=now,
            updated_at=now,
            disabled_at=None if schedule.enabled else now,
        )

    def _change_schedule(self, stored: StoredSchedule, **changes: Any) -> None:
        self._schedules[stored.name] = dataclasses.replace(
            stored, **changes, version=stored.version + 1, updated_at=self.now()
        )

    def _withdraw(self, schedule_ids: Sequence[int], *, roll_back: set[int]) -> None:
        """Delete the not-yet-due pending occurrences of ``schedule_ids``; for
        those in ``roll_back``, point the cursor at the earliest one deleted."""
        wanted = set(schedule_ids)
        if not wanted:
            return
        now = self.now()
        earliest: dict[int, dt.datetime] = {}
        for job in list(self._jobs.values()):
            sid = job.schedule_id
            if sid in wanted and job.status == JobStatus.PENDING and job.due_at > now:
                del self._jobs[job.id]
                del self._by_key[job.key]
                if sid not in earliest or job.due_at < earliest[sid]:
                    earliest[sid] = job.due_at
        for stored in list(self._schedules.values()):
            if stored.id in roll_back and stored.id in earliest:
                self._schedules[stored.name] = dataclasses.replace(
                    stored, last_nominal_at=None, next_nominal_at=earliest[stored.id]
                )

    # -- internals ----------------------------------------------------------

    @staticmethod
    def _new_row(job: NewJob, now: dt.datetime) -> Job:
        return Job(
            id=job.id,
            key=job.key,
            task=job.task,
            body=job.body,
            content_type=job.content_type,
            content_encoding=job.content_encoding,
            argsrepr=job.argsrepr,
            kwargsrepr=job.kwargsrepr,
            due_at=job.due_at,
            due_bucket=to_bucket(job.due_at),
            status=JobStatus.PENDING,
            options=dict(job.options),
            expires_at=job.expires_at,
            max_attempts=job.max_attempts,
            shard=job.shard,
            schedule_id=job.schedule_id,
            visibility_timeout=job.visibility_timeout,
            max_runtime=job.max_runtime,
            created_at=now,
        )

    def _put(self, job: Job) -> None:
        self._jobs[job.id] = job
        self._by_key[job.key] = job.id

    def _update(self, job: Job, **changes: Any) -> Job:
        updated = dataclasses.replace(job, **changes)
        self._jobs[job.id] = updated
        return updated


#: What a user's change writes: the planner tries the schedule again.
_UNBROKEN: dict[str, Any] = {"broken_at": None, "broken_reason": None}


def _due_order(job: Job) -> tuple[dt.datetime, str]:
    return (job.due_at, str(job.id))


def _refuse_duplicate_names(schedules: Sequence[NewSchedule]) -> None:
    seen: set[str] = set()
    for schedule in schedules:
        if schedule.name in seen:
            raise InvalidSchedule(f"schedule name {schedule.name!r} is given twice")
        seen.add(schedule.name)


def _definition(schedule: NewSchedule) -> dict[str, Any]:
    """The fields ``replace_schedule`` writes: the definition without name,
    source, enabled and the first instant."""
    skip = {"name", "source", "enabled", "next_nominal_at"}
    return {
        f.name: getattr(schedule, f.name)
        for f in dataclasses.fields(NewSchedule)
        if f.name not in skip
    }
