"""The public client: schedule, inspect and cancel jobs.

``Client(app)`` reads its settings from the Celery app, builds the job store
lazily (nothing connects until the first call), validates every job with
:class:`~celery_sched.validation.JobBuilder` before writing, and writes
through the :class:`~celery_sched.interfaces.JobStore` interface only.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

from celery_sched.errors import CelerySchedError, InvalidJob
from celery_sched.interfaces import JobStore, Staging
from celery_sched.models import Job, JobStatus, NewJobRow
from celery_sched.settings import Settings
from celery_sched.validation import JobBuilder

logger = logging.getLogger(__name__)

#: How far past the staging window ``schedule_many`` keeps candidates for
#: staging, to cover the time its insert takes.
STAGING_SLACK = dt.timedelta(minutes=5)

#: Keys of a ``schedule_many`` row that are not scheduling options.
_ROW_FIELDS = frozenset(
    {"task", "task_name", "args", "kwargs", "eta", "countdown", "key", "check_task"}
)


class Client:
    """Schedules one-off jobs into the celery_sched job store.

    Jobs due within the staging window are also added to the Redis staging
    set right after they commit, so the leader fires them on time without
    waiting for its next pass over Postgres. That copy is best effort: if
    Redis is down the leader's sweep finds the job in Postgres a few seconds
    later. Pass ``staging=False`` to never touch Redis from this client.
    """

    def __init__(
        self,
        app: Any,
        *,
        settings: Settings | None = None,
        store: JobStore | None = None,
        staging: Staging | Literal[False] | None = None,
    ) -> None:
        self.app = app
        self.settings = settings if settings is not None else Settings.from_app(app)
        self._store = store
        self._owns_store = store is None
        self._staging: Staging | None = staging or None
        self._stage_new_jobs = staging is not False
        self._builder: JobBuilder | None = None

    # -- lifecycle ----------------------------------------------------------

    @property
    def store(self) -> JobStore:
        """The job store, built from the settings on first use."""
        if self._store is None:
            from celery_sched.backends import build_store

            self._store = build_store(self.settings)
        return self._store

    @property
    def builder(self) -> JobBuilder:
        if self._builder is None:
            self._builder = JobBuilder(self.app, self.settings)
        return self._builder

    def migrate(self) -> None:
        """Create or upgrade the schema (idempotent)."""
        self.store.migrate()

    def close(self) -> None:
        """Close the store if this client built it."""
        if self._store is not None and self._owns_store:
            self._store.close()
            self._store = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- scheduling -----------------------------------------------------------

    def schedule(
        self,
        task_name: str,
        args: Any = (),
        kwargs: Any = None,
        *,
        eta: Any = None,
        countdown: Any = None,
        key: str | None = None,
        check_task: bool = True,
        if_exists: Literal["raise", "return"] = "raise",
        **options: Any,
    ) -> Job:
        """Schedule one job and return it as stored.

        ``eta`` (datetime; naive means the app's timezone) or ``countdown``
        (seconds) set the due time, default now. ``key`` makes the call
        idempotent: an existing key raises
        :class:`~celery_sched.errors.DuplicateJob` or, with
        ``if_exists="return"``, returns the stored job unchanged. ``options``
        are message options (``queue``, ``priority``, ...) and ``expires``,
        ``max_attempts``, ``visibility_timeout``, ``max_runtime``.
        Invalid input raises an :class:`~celery_sched.errors.InvalidJob`
        subclass and writes nothing.
        """
        if if_exists not in ("raise", "return"):
            raise InvalidJob(f"if_exists must be 'raise' or 'return', got {if_exists!r}")
        new = self.builder.build(
            task_name,
            args,
            kwargs,
            eta=eta,
            countdown=countdown,
            key=key,
            check_task=check_task,
            now=self.store.now,
            options=options,
        )
        job = self.store.insert(new, if_exists=if_exists)
        if job.id == new.id and job.due_at <= self._staging_horizon():
            self._stage([(job.shard, job.id, job.due_at)])
        logger.debug("scheduled job %s (%s) due %s", job.key, job.task, job.due_at.isoformat())
        return job

    def schedule_many(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Schedule many jobs in one all-or-nothing write; return how many.

        Each row is a mapping with ``task`` (or ``task_name``) and optionally
        ``args``, ``kwargs``, ``eta``, ``countdown``, ``key``, ``check_task``;
        any other key is a scheduling option as in :meth:`schedule`. Rows
        are validated while they stream into the store, so an invalid row N
        (reported with its index) or a duplicate key leaves nothing written.
        """
        near: list[tuple[int, uuid.UUID, dt.datetime]] = []
        count = self.store.insert_rows(self._build_rows(rows, near))
        logger.info("scheduled %d jobs in bulk", count)
        # The leader's stager may have moved its horizon past some of these
        # while the insert ran (it cannot see uncommitted rows), so the
        # window is measured from the commit, not from the start.
        horizon = self._staging_horizon()
        due_soon = [item for item in near if item[2] <= horizon]
        if due_soon:
            self._stage(due_soon)
        return count

    def _build_rows(
        self,
        rows: Iterable[Mapping[str, Any]],
        near: list[tuple[int, uuid.UUID, dt.datetime]],
    ) -> Iterator[NewJobRow]:
        build_row = self.builder.build_row
        now_cache: list[dt.datetime] = []

        # One reading of the store's clock serves the whole batch, and only
        # if some row needs it (a countdown or no due time).
        def now() -> dt.datetime:
            if not now_cache:
                now_cache.append(self.store.now())
            return now_cache[0]

        fields = _ROW_FIELDS
        # Candidates for staging after the commit: a long insert moves the
        # window, so collect a margin beyond it.
        horizon = self._staging_horizon() + STAGING_SLACK
        for index, row in enumerate(rows):
            try:
                if type(row) is not dict and not isinstance(row, Mapping):
                    raise InvalidJob(f"expected a mapping, got {type(row).__name__}")
                job = build_row(row, now, fields)
            except InvalidJob as exc:
                # Same class, so callers catch what schedule() raises; the
                # row index tells them which input to fix.
                raise type(exc)(f"row {index}: {exc}") from exc
            if job[9] <= horizon:  # NEW_JOB_ROW: 0 id, 9 due_at, 13 shard
                near.append((job[13], job[0], job[9]))
            yield job

    def _staging_horizon(self) -> dt.datetime:
        # The local clock is good enough here: staging is only a copy, and
        # a job staged early or late is still claimed by Postgres' clock.
        if not self._stage_new_jobs:
            return dt.datetime.min.replace(tzinfo=dt.UTC)
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.settings.staging_window)

    def _stage(self, items: list[tuple[int, uuid.UUID, dt.datetime]]) -> None:
        """Copy committed jobs due soon into the staging set (best effort)."""
        try:
            if self._staging is None:
                from celery_sched.backends import build_staging

                self._staging = build_staging(self.settings)
            by_shard: dict[int, list[tuple[uuid.UUID, dt.datetime]]] = {}
            for shard, job_id, due_at in items:
                by_shard.setdefault(shard, []).append((job_id, due_at))
            for shard, pairs in by_shard.items():
                self._staging.add(shard, pairs)
        except CelerySchedError as exc:
            logger.warning(
                "could not stage %d new jobs (%s); the leader's sweep will find them",
                len(items),
                exc,
            )

    # -- reading and cancelling ---------------------------------------------

    def get(self, key: str) -> Job | None:
        """The job with ``key``, or ``None``."""
        return self.store.get(key)

    def cancel(self, key: str) -> bool:
        """Cancel a pending job. False if it is unknown or no longer pending."""
        cancelled = self.store.cancel(key)
        if cancelled:
            logger.info("cancelled job %s", key)
        return cancelled

    def counts_by_status(self) -> dict[JobStatus, int]:
        """Number of jobs per status."""
        return self.store.counts_by_status()

    def counts_by_hour(self, status: JobStatus | None = None) -> dict[dt.datetime, int]:
        """Number of jobs per UTC hour of their due time."""
        return self.store.counts_by_hour(status)
