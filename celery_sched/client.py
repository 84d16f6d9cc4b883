"""The public client: schedule, inspect and cancel jobs.

``Client(app)`` reads its settings from the Celery app, builds the job store
lazily (nothing connects until the first call), validates every job with
:class:`~celery_sched.validation.JobBuilder` before writing, and writes
through the :class:`~celery_sched.interfaces.JobStore` interface only.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

from celery_sched.errors import InvalidJob
from celery_sched.interfaces import JobStore, Staging
from celery_sched.models import Job, JobStatus, NewJob
from celery_sched.settings import Settings
from celery_sched.validation import JobBuilder

logger = logging.getLogger(__name__)

#: Keys of a ``schedule_many`` row that are not scheduling options.
_ROW_FIELDS = frozenset(
    {"task", "task_name", "args", "kwargs", "eta", "countdown", "key", "check_task"}
)


class Client:
    """Schedules one-off jobs into the celery_sched job store.

    ``staging`` is reserved for staging a job due within the staging window
    right after it is inserted (see :meth:`_after_insert`); until that lands,
    the leader's stager picks every job up from PostgreSQL.
    """

    def __init__(
        self,
        app: Any,
        *,
        settings: Settings | None = None,
        store: JobStore | None = None,
        staging: Staging | None = None,
    ) -> None:
        self.app = app
        self.settings = settings if settings is not None else Settings.from_app(app)
        self._store = store
        self._owns_store = store is None
        self._staging = staging
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
        if job.id == new.id:
            self._after_insert([job])
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
        count = self.store.insert_many(self._build_rows(rows))
        logger.info("scheduled %d jobs in bulk", count)
        return count

    def _build_rows(self, rows: Iterable[Mapping[str, Any]]) -> Iterator[NewJob]:
        build_row = self.builder.build_row
        now_cache: list[dt.datetime] = []

        # One reading of the store's clock serves the whole batch, and only
        # if some row needs it (a countdown or no due time).
        def now() -> dt.datetime:
            if not now_cache:
                now_cache.append(self.store.now())
            return now_cache[0]

        fields = _ROW_FIELDS
        for index, row in enumerate(rows):
            try:
                if type(row) is not dict and not isinstance(row, Mapping):
                    raise InvalidJob(f"expected a mapping, got {type(row).__name__}")
                job = build_row(row, now, fields)
            except InvalidJob as exc:
                # Same class, so callers catch what schedule() raises; the
                # row index tells them which input to fix.
                raise type(exc)(f"row {index}: {exc}") from exc
            yield job

    def _after_insert(self, jobs: list[Job]) -> None:
        """Hook for staging jobs due within the staging window right away.

        Not implemented yet: with ``staging`` set, a later change will add
        jobs due before ``now + settings.staging_window`` to the Redis set so
        they fire without waiting for the leader's next stager pass.
        """
        if self._staging is None:
            return

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
