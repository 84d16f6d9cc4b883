"""The job rows in memory: :class:`~celery_sched.interfaces.Jobs` for unit tests."""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from celery_sched.errors import DuplicateJob, StaleEpoch
from celery_sched.ids import new_claim_id, new_epoch_salt
from celery_sched.interfaces import Jobs
from celery_sched.models import (
    ADOPTABLE_STATUSES,
    FINISHED_STATUSES,
    REQUEUABLE_STATUSES,
    UNFINISHED_STATUSES,
    DueSpan,
    Job,
    JobQuery,
    JobStatus,
    LedgerState,
    MinuteDispatches,
    NewJob,
    PageCursor,
    ReconcileResult,
    RehomeResult,
    RehomeRow,
    RequeueResult,
    check_rehome,
    dispatch_lag,
    misplaced,
    next_epoch,
    requeued_allowance,
    sendable,
)
from celery_sched.store.memory.base import MemoryStoreBase
from celery_sched.timeutil import ensure_utc, to_bucket


class MemoryJobs(MemoryStoreBase, Jobs):
    """:class:`~celery_sched.interfaces.Jobs` in memory."""

    # -- writing jobs -------------------------------------------------------

    def add_job(self, job: NewJob, *, if_exists: Literal["raise", "return"] = "raise") -> Job:
        return self._insert(job, if_exists)

    def load_jobs(self, jobs: Iterable[NewJob]) -> int:
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

    def add_occurrences(self, jobs: Sequence[NewJob]) -> list[uuid.UUID]:
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
        self, job_id: uuid.UUID, attempt: int | None, due_at: dt.datetime | None = None
    ) -> tuple[Job | None, int | None]:
        """The memory twin of the PostgreSQL ledger's adoption step (see
        :meth:`~celery_sched.interfaces.Ledger.check_delivery`): the job as
        it was, and the attempt a delivery of ``attempt`` took it over as
        (``None`` when it did not). ``due_at``: only the job due then."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and due_at is not None and job.due_at != due_at:
                job = None
            if job is not None and due_at is None and not sendable(job, self.now()):
                job = None  # not a job any delivery can be of
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

    def oldest_due_pending(self, *, shard: int) -> dt.datetime | None:
        with self._lock:
            now = self.now()
            return min(
                (
                    job.due_at
                    for job in self._jobs.values()
                    if job.shard == shard and job.status == JobStatus.PENDING and job.due_at <= now
                ),
                default=None,
            )

    def dispatches_by_minute(
        self, *, since: dt.datetime, until: dt.datetime
    ) -> dict[dt.datetime, MinuteDispatches]:
        since, until = ensure_utc(since, name="since"), ensure_utc(until, name="until")
        lags: dict[dt.datetime, list[float]] = {}
        with self._lock:
            for job in self._jobs.values():
                lag = dispatch_lag(job)
                if lag is not None and since <= job.due_at < until:
                    minute = job.due_at.replace(second=0, microsecond=0)
                    lags.setdefault(minute, []).append(lag)
        return {
            minute: MinuteDispatches(count=len(values), mean_lag=sum(values) / len(values))
            for minute, values in lags.items()
        }

    def recent_failures(self, *, limit: int) -> list[Job]:
        with self._lock:
            failed = [
                job
                for job in self._jobs.values()
                if job.status in REQUEUABLE_STATUSES and job.finished_at is not None
            ]
        failed.sort(key=lambda job: (job.finished_at, job.id.bytes), reverse=True)
        return failed[: max(limit, 0)]

    def list_jobs(
        self, query: JobQuery, *, after: PageCursor | None = None, limit: int
    ) -> list[Job]:
        with self._lock:
            rows = [
                job
                for job in self._jobs.values()
                if query.matches(job) and query.beyond(job, after)
            ]
        rows.sort(key=_page_order, reverse=query.newest)
        return rows[: max(limit, 0)]

    # -- user transitions ---------------------------------------------------

    def requeue(self, keys: Sequence[str], *, allowance: int | None = None) -> RequeueResult:
        if allowance is not None:
            requeued_allowance(0, 1, allowance)  # refuses a bad allowance up front
        result = RequeueResult()
        with self._lock:
            now = self.now()
            for key in dict.fromkeys(keys):
                job_id = self._by_key.get(key)
                if job_id is None:
                    result.unknown.append(key)
                    continue
                job = self._jobs[job_id]
                if job.status not in REQUEUABLE_STATUSES:
                    result.refused[key] = job.status
                    continue
                result.requeued.append(self._requeue_by_hand(job, now, allowance))
        return result

    def requeue_dead(
        self,
        *,
        died_by: dt.datetime,
        task: str | None = None,
        limit: int,
        allowance: int | None = None,
    ) -> list[Job]:
        died_by = ensure_utc(died_by, name="died_by")
        with self._lock:
            now = self.now()
            dead = sorted(
                (
                    job
                    for job in self._jobs.values()
                    if job.status == JobStatus.DEAD
                    and job.finished_at is not None
                    and job.finished_at <= died_by
                    and (task is None or job.task == task)
                ),
                key=_page_order,
            )[: max(limit, 0)]
            return [self._requeue_by_hand(job, now, allowance) for job in dead]

    def _requeue_by_hand(self, job: Job, now: dt.datetime, allowance: int | None) -> Job:
        return self._update(
            job,
            status=JobStatus.PENDING,
            attempt=job.attempt + 1,
            max_attempts=requeued_allowance(job.attempt, job.max_attempts, allowance),
            due_at=now,
            due_bucket=to_bucket(now),
            dispatched_at=None,
            started_at=None,
            finished_at=None,
        )

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
            epoch = next_epoch(self._epochs.get(shard, 0), new_epoch_salt())
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
        claim_id = new_claim_id()
        return [
            self._update(
                job,
                status=JobStatus.DISPATCHED,
                dispatched_at=now,
                leader_epoch=epoch,
                claim_id=claim_id,
            )
            for job in rows[: max(limit, 0)]
        ]

    def record_published(self, claim_ids: Sequence[int], *, shard: int) -> None:
        with self._lock:
            now = self.now()
            for claim_id in claim_ids:
                self._published.setdefault(claim_id, now)

    def _went_out(self, job: Job) -> bool:
        return job.claim_id is None or job.claim_id in self._published

    def release(self, ids: Sequence[uuid.UUID], *, epoch: int, due: DueSpan) -> int:
        return self._move_fenced(ids, epoch, due, status=JobStatus.PENDING, dispatched_at=None)

    def mark_expired(
        self, ids: Sequence[uuid.UUID], *, epoch: int, reason: str, due: DueSpan
    ) -> int:
        with self._lock:
            now = self.now()
            # Re-checked by the store's clock, as the Postgres statement does.
            expired = [
                job_id
                for job_id in ids
                if (job := self._jobs.get(job_id)) is not None
                and job.expires_at is not None
                and job.expires_at <= now
            ]
            return self._move_fenced(
                expired, epoch, due, status=JobStatus.EXPIRED, finished_at=now, last_error=reason
            )

    def fail_dispatch(
        self, failures: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> ReconcileResult:
        with self._lock:  # one lock stands in for the one statement
            now = self.now()
            moved = dead = 0
            for job_id, reason in dict(failures).items():
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and due.holds(job.due_at)
                    and job.status == JobStatus.DISPATCHED
                    and job.leader_epoch == epoch
                ):
                    dead += self._requeue(job, now, f"not published: {reason}")
                    moved += 1
            return ReconcileResult(requeued=moved - dead, dead=dead)

    def mark_missed(
        self, dropped: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> list[uuid.UUID]:
        with self._lock:  # one lock stands in for the one statement
            now = self.now()
            moved = []
            for job_id, reason in dict(dropped).items():
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and due.holds(job.due_at)
                    and job.status == JobStatus.DISPATCHED
                    and job.leader_epoch == epoch
                    and job.attempt == 0
                ):
                    self._update(job, status=JobStatus.MISSED, finished_at=now, last_error=reason)
                    moved.append(job_id)
            return moved

    def unfinished_by_shard(self, *, from_shard: int) -> dict[int, dict[JobStatus, int]]:
        found: dict[int, dict[JobStatus, int]] = {}
        with self._lock:
            for job in self._jobs.values():
                if job.shard >= from_shard and job.status in UNFINISHED_STATUSES:
                    per_status = found.setdefault(job.shard, {})
                    per_status[job.status] = per_status.get(job.status, 0) + 1
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
        with self._lock:  # one lock stands in for the batch's transaction
            unfinished = [job for job in self._jobs.values() if job.status in UNFINISHED_STATUSES]
            following: uuid.UUID | None = None
            if stranded_only:
                stranded = [
                    job
                    for job in unfinished
                    if job.shard >= shards and (in_flight or job.status is JobStatus.PENDING)
                ]
                # Pending first, soonest due first; then those in flight.
                stranded.sort(
                    key=lambda job: (job.status != JobStatus.PENDING, job.due_at, job.id.bytes)
                )
                chosen = stranded[:limit]
            else:
                # Postgres orders uuids by their bytes, as does this.
                page = sorted(
                    (job for job in unfinished if after is None or job.id.bytes > after.bytes),
                    key=lambda job: job.id.bytes,
                )
                chosen = page[:limit]
                following = chosen[-1].id if len(chosen) == limit else None
            rows: list[RehomeRow] = [
                (job.id, job.key, job.shard, job.status.value, job.due_at) for job in chosen
            ]
            wanted = misplaced(rows, shards=shards, shard_of=shard_of)
            if not dry_run:
                for move in wanted:
                    self._update(self._jobs[move.id], shard=move.to_shard)
            return RehomeResult(scanned=len(rows), moved=tuple(wanted), after=following)

    def placed_for(self) -> int | None:
        with self._lock:
            return self._placed_for

    def record_placement(self, shards: int) -> None:
        with self._lock:
            self._placed_for = shards

    def _move_fenced(
        self, ids: Sequence[uuid.UUID], epoch: int, due: DueSpan, **changes: Any
    ) -> int:
        """Apply ``changes`` to the dispatched jobs among ``ids`` claimed by
        ``epoch`` and due within ``due``."""
        with self._lock:
            moved = 0
            for job_id in set(ids):
                job = self._jobs.get(job_id)
                if (
                    job is not None
                    and due.holds(job.due_at)
                    and job.status == JobStatus.DISPATCHED
                    and job.leader_epoch == epoch
                ):
                    self._update(job, **changes)
                    moved += 1
            return moved

    def reconcile(
        self, *, shard: int, epoch: int, limit: int, default_visibility_timeout: float
    ) -> ReconcileResult:
        """Stale dispatched jobs first (those that went stale first; requeued when
        a worker tracks their task, then the others marked sent), then
        retrying jobs whose retry is overdue (oldest due first), then running
        jobs past their max_runtime, ``limit`` rows in all. ``timed_out``
        counts the latter; ``requeued`` and ``dead`` count every job moved,
        ``untracked`` those marked sent."""
        with self._lock:
            self._check_epoch(shard, epoch)
            now = self.now()
            limit = max(limit, 0)
            stale: list[tuple[dt.datetime, Job]] = []
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
                    stale_at = job.dispatched_at + dt.timedelta(seconds=timeout)
                    if stale_at < now:
                        # A retrying job's dispatched_at is when its retry is due.
                        if job.status == JobStatus.DISPATCHED:
                            stale.append((stale_at, job))
                        else:
                            retries.append(job)
                elif (
                    job.status == JobStatus.RUNNING
                    and job.max_runtime is not None
                    and job.started_at is not None
                    and job.started_at < now - dt.timedelta(seconds=job.max_runtime)
                ):
                    overran.append(job)
            # As PostgreSQL reads them (jobs_dispatched_idx): stale soonest first.
            stale.sort(key=lambda pair: (pair[0], str(pair[1].id)))
            retries.sort(key=lambda job: (job.dispatched_at, str(job.id)))
            overran.sort(key=lambda job: (job.started_at, str(job.id)))
            # Requeued: tracked, or never published (it cannot run twice).
            untracked = [
                job for _, job in stale if not self._tracked(job.task) and self._went_out(job)
            ]
            requeued = [
                job for _, job in stale if self._tracked(job.task) or not self._went_out(job)
            ][:limit]
            untracked = untracked[: limit - len(requeued)]
            retries = retries[: limit - len(requeued) - len(untracked)]
            overran = overran[: limit - len(requeued) - len(untracked) - len(retries)]
            for job in untracked:
                self._update(
                    job,
                    status=JobStatus.SENT,
                    finished_at=now,
                    last_error=f"sent once; no worker tracks task {job.task} "
                    "(celery_sched.tracking.install), so it is not sent again",
                )
            dead = 0
            for job in (*requeued, *retries):
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
            moved = len(requeued) + len(retries) + len(overran)
            return ReconcileResult(
                requeued=moved - dead, dead=dead, timed_out=len(overran), untracked=len(untracked)
            )

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

    # -- housekeeping -------------------------------------------------------

    def prepare_storage(self) -> None:
        """Nothing to prepare: the memory store has no partitions."""

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        total = 0
        with self._lock:
            cutoff = self.now() - dt.timedelta(seconds=older_than)
            for claim_id, at in list(self._published.items()):
                if at < cutoff:
                    del self._published[claim_id]
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


def _due_order(job: Job) -> tuple[dt.datetime, str]:
    return (job.due_at, str(job.id))


def _page_order(job: Job) -> tuple[dt.datetime, bytes]:
    # PostgreSQL orders uuids by their bytes.
    return (job.due_at, job.id.bytes)
