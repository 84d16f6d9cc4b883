"""What every role of the memory job store shares: one lock standing in for
transactions, the rows in dicts, the injectable clock, and the row helpers."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any, Literal

from celery_sched.errors import DuplicateJob
from celery_sched.interfaces import Ledger, StoreLifecycle
from celery_sched.models import Job, JobStatus, NewJob, StoredSchedule
from celery_sched.timeutil import UTC, to_bucket


def _utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


class MemoryStoreBase(StoreLifecycle):
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
        #: The tasks each worker process tracks (None: every task).
        self._worker_tasks: dict[tuple[str, int], frozenset[str] | None] = {}
        self._lock = threading.RLock()
        self._jobs: dict[uuid.UUID, Job] = {}
        self._by_key: dict[str, uuid.UUID] = {}
        self._epochs: dict[int, int] = {}
        self._holders: dict[int, str] = {}
        #: The shard count the rows were last placed for (Jobs.record_placement).
        self._placed_for: int | None = None
        #: Claims recorded as published (Jobs.record_published), with when.
        self._published: dict[int, dt.datetime] = {}
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

    # -- internals ----------------------------------------------------------

    def _insert(self, job: NewJob, if_exists: Literal["raise", "return"]) -> Job:
        """Insert one job (see :meth:`~celery_sched.interfaces.Jobs.add_job`)."""
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

    def _tracked(self, task: str) -> bool:
        """Whether a worker process tracks ``task`` (see ``Jobs.reconcile``)."""
        return any(tasks is None or task in tasks for tasks in self._worker_tasks.values())

    def _update(self, job: Job, **changes: Any) -> Job:
        updated = dataclasses.replace(job, **changes)
        self._jobs[job.id] = updated
        return updated
