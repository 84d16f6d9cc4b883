"""What workers report, in memory: :class:`~celery_sched.interfaces.WorkerReports`
for unit tests."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence

from celery_sched.interfaces import WorkerReports
from celery_sched.models import (
    FINISHED_STATUSES,
    Job,
    JobStatus,
    WorkerUpdate,
    check_retry_in,
    sendable,
)
from celery_sched.store.memory.base import MemoryStoreBase

_CLAIMABLE_BY_WORKER = frozenset({JobStatus.DISPATCHED, JobStatus.RETRYING, JobStatus.PENDING})


class MemoryWorkerReports(MemoryStoreBase, WorkerReports):
    """:class:`~celery_sched.interfaces.WorkerReports` in memory."""

    def _sent(self, job_id: uuid.UUID, due_at: dt.datetime | None) -> Job | None:
        """The job ``job_id`` due at ``due_at`` (its message's header), or,
        without one, if a worker can hold it (:func:`~celery_sched.models.sendable`)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if due_at is not None:
            return job if job.due_at == due_at else None
        return job if sendable(job, self.now()) else None

    def heartbeat(
        self,
        hostname: str,
        pid: int,
        *,
        first: bool = False,
        tasks: Sequence[str] | None = None,
    ) -> None:
        with self._lock:
            now = self.now()
            row = self._workers.get((hostname, pid))
            started = now if row is None or first else row[0]
            self._workers[(hostname, pid)] = [started, now]
            self._worker_tasks[(hostname, pid)] = None if tasks is None else frozenset(tasks)

    def mark_running(
        self,
        job_id: uuid.UUID,
        *,
        worker: str,
        worker_pid: int | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        with self._lock:
            job = self._sent(job_id, due_at)
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
        job = self._sent(update.job_id, update.due_at)
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
        self,
        job_id: uuid.UUID,
        status: JobStatus,
        *,
        error: str | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        status = JobStatus(status)
        if not status.finished:
            raise ValueError(f"mark_finished needs a finished status, got {status.value!r}")
        with self._lock:
            job = self._sent(job_id, due_at)
            if job is None or job.status in FINISHED_STATUSES:
                return False
            self._update(job, status=status, finished_at=self.now(), last_error=error)
            return True

    def mark_retrying(
        self,
        job_id: uuid.UUID,
        *,
        error: str | None = None,
        retry_in: float | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        delay = dt.timedelta(seconds=check_retry_in(retry_in) or 0.0)
        with self._lock:
            job = self._sent(job_id, due_at)
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
                        update.job_id,
                        worker=update.worker or "",
                        worker_pid=update.worker_pid,
                        due_at=update.due_at,
                    )
                elif update.status == JobStatus.PENDING:
                    done = self._lost(update)
                elif update.status == JobStatus.RETRYING:
                    done = self.mark_retrying(
                        update.job_id,
                        error=update.error,
                        retry_in=update.retry_in,
                        due_at=update.due_at,
                    )
                else:
                    done = self.mark_finished(
                        update.job_id, update.status, error=update.error, due_at=update.due_at
                    )
                changed += done
        return changed

    def prune_workers(self, *, older_than: float) -> int:
        with self._lock:
            cutoff = self.now() - dt.timedelta(seconds=older_than)
            gone = [name for name, (_, seen) in self._workers.items() if seen < cutoff]
            for name in gone:
                del self._workers[name]
                self._worker_tasks.pop(name, None)
            return len(gone)
