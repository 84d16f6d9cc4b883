"""The public client: schedule, inspect and cancel jobs.

``Client(app)`` reads its settings from the Celery app, builds the job store
lazily (nothing connects until the first call), validates every job with
:class:`~celery_sched.validation.JobBuilder` before writing, and writes
through the :class:`~celery_sched.interfaces.JobStore` interface only.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from celery_sched.errors import (
    CelerySchedError,
    InvalidJob,
    InvalidSchedule,
    StoreError,
    UndecodableBody,
    UnknownSchedule,
)
from celery_sched.ids import UUID7Source
from celery_sched.interfaces import JobStore, Staging
from celery_sched.models import (
    Job,
    JobPage,
    JobQuery,
    JobStatus,
    LeaderView,
    MinuteDispatches,
    NewJobRow,
    NewSchedule,
    PageCursor,
    RequeueResult,
    ScheduleInfo,
    ScheduleRuns,
    StoredSchedule,
    accepted_content_types,
    decode_body,
)
from celery_sched.settings import Settings
from celery_sched.validation import JobBuilder

if TYPE_CHECKING:
    from celery_sched.schedules.spec import SpecBuilder

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
        self._schedules: ScheduleManager | None = None

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

    @functools.cached_property
    def accept(self) -> frozenset[str]:
        """The content types stored bodies may be decoded from: the app's
        ``accept_content``, as its workers decode messages."""
        return accepted_content_types(self.app.conf.accept_content)

    def decode(self, job: Job) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of ``job``, decoded as the app's workers would.

        A body whose content type the app does not accept raises
        :class:`~celery_sched.errors.UntrustedContent` and is not
        deserialized (``job.args`` and ``job.decode()`` accept JSON only).
        """
        return job.decode(self.accept)

    @property
    def schedules(self) -> ScheduleManager:
        """Periodic schedules: add, update, pause, resume, delete, trigger, list."""
        if self._schedules is None:
            self._schedules = ScheduleManager(self)
        return self._schedules

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
            caller_key=True,
        )
        job = self.store.add_job(new, if_exists=if_exists)
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
        count = self.store.load_job_rows(self._build_rows(rows, near))
        logger.info("scheduled %d jobs in bulk", count)
        # The leader's stager may have moved its horizon past some of these
        # while the insert ran (it cannot see uncommitted rows), so the
        # window is measured from the commit, not from the start.
        horizon = self._staging_horizon()
        due_soon = [item for item in near if item[2] <= horizon]
        if due_soon:
            self._stage(due_soon)
        return count

    def check_row(self, row: Mapping[str, Any]) -> None:
        """Validate one :meth:`schedule_many` row as it would be, writing nothing.

        Raises the :class:`~celery_sched.errors.InvalidJob` subclass
        :meth:`schedule_many` would (a key already stored is not checked:
        the write finds it). Used by ``sched import`` to refuse bad rows one
        by one before it writes the good ones. The local clock stands in for
        the store's (a countdown's due time is only checked here; the write
        reads the store's clock), so a check costs no round trip.
        """
        if not isinstance(row, Mapping):
            raise InvalidJob(f"expected a mapping, got {type(row).__name__}")
        self.builder.build_row(row, functools.partial(dt.datetime.now, dt.UTC), _ROW_FIELDS)

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

    def dispatches_by_minute(
        self, *, since: dt.datetime, until: dt.datetime
    ) -> dict[dt.datetime, MinuteDispatches]:
        """Per UTC minute of due time in ``[since, until)``: the jobs due then
        that were dispatched, and their mean dispatch lag in seconds."""
        return self.store.dispatches_by_minute(since=since, until=until)

    def recent_failures(self, limit: int = 10) -> list[Job]:
        """The latest failed and dead jobs, the last to finish first."""
        return self.store.recent_failures(limit=limit)

    # -- looking through jobs and steering them by hand ------------------------

    def list_jobs(
        self,
        query: JobQuery | None = None,
        *,
        after: PageCursor | str | None = None,
        limit: int = 50,
    ) -> JobPage:
        """One page of the jobs ``query`` selects (all jobs by default), in
        its order of ``(due_at, id)``, starting beyond ``after`` (a
        :class:`~celery_sched.models.PageCursor` or its encoded text, as a
        page's ``next`` gives it; a bad one raises
        :class:`~celery_sched.errors.InvalidCursor`). The page's ``next``
        is ``None`` on the last page."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        cursor = PageCursor.decode(after) if isinstance(after, str) else after
        # One row more than the page says whether another page follows.
        jobs = self.store.list_jobs(query or JobQuery(), after=cursor, limit=limit + 1)
        if len(jobs) <= limit:
            return JobPage(jobs=jobs)
        del jobs[limit:]
        return JobPage(jobs=jobs, next=PageCursor.of(jobs[-1]))

    def requeue(self, keys: Iterable[str], *, allowance: int | None = None) -> RequeueResult:
        """Requeue dead or failed jobs by hand (see
        :meth:`~celery_sched.interfaces.Jobs.requeue`): each runs again
        now, at its next attempt, with ``allowance`` more attempts (default
        its ``max_attempts``). The others are reported, not changed."""
        result = self.store.requeue(list(keys), allowance=allowance)
        self._stage_requeued(result.requeued)
        return result

    def requeue_dead(
        self,
        *,
        task: str | None = None,
        allowance: int | None = None,
        batch: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Requeue every job dead by now (of ``task`` only, if given), a
        transaction of ``batch`` jobs (default ``celery_sched_batch_size``)
        at a time, so that millions never sit in memory; return how many.
        ``progress`` is called with the running total after each batch.
        Jobs that die while it runs are left dead."""
        size = batch or self.settings.batch_size
        died_by = self.store.now()
        total = 0
        while True:
            moved = self.store.requeue_dead(
                died_by=died_by, task=task, limit=size, allowance=allowance
            )
            total += len(moved)
            self._stage_requeued(moved)
            if moved and progress is not None:
                progress(total)
            if len(moved) < size:
                break
        if total:
            logger.info("requeued %d dead jobs by hand", total)
        return total

    def _stage_requeued(self, jobs: list[Job]) -> None:
        # Due now: a copy in the staging set fires them without waiting
        # for the leader's next sweep (best effort, as for new jobs).
        if jobs and self._stage_new_jobs:
            self._stage([(job.shard, job.id, job.due_at) for job in jobs])

    def message_headers(self, job: Job) -> dict[str, Any]:
        """The headers the shard's current leader would send ``job``'s
        message with now: built by the dispatchers' own code
        (:mod:`celery_sched.protocol`), with the task's declared limits and
        expiry, the current epoch of the job's shard and its attempt."""
        from celery_sched.protocol import (
            COMPRESSION_HEADER,
            base_headers,
            compress_body,
            message_headers,
            send_expires_at,
            task_defaults,
        )

        defaults = task_defaults(self.app.tasks.get(job.task))
        base = base_headers(
            origin=self.settings.hostname, epoch=self.store.current_epoch(job.shard)
        )
        expires_at = send_expires_at(job, self.store.now(), defaults)
        headers = message_headers(base, job, str(job.id), expires_at=expires_at, defaults=defaults)
        compression = (job.options or {}).get("compression") or self.app.conf.task_compression
        if compression:
            headers[COMPRESSION_HEADER] = compress_body(job.body, compression)[1]
        return headers

    def leaders(self) -> list[LeaderView]:
        """Per shard (``0 .. celery_sched_shards - 1``): the lease's holder
        (``host:pid``) and seconds left, and the leader's last report
        (:class:`~celery_sched.models.LeaderView`), read from Redis."""
        from celery_sched.backends import build_board, build_redis

        client = build_redis(self.settings)
        try:
            return build_board(self.settings, client).read(range(self.settings.shards))
        finally:
            client.close()

    def epochs(self) -> dict[int, int]:
        """Per shard, its current fencing epoch in PostgreSQL (0: never led)."""
        return {shard: self.store.current_epoch(shard) for shard in range(self.settings.shards)}


# -- periodic schedules ----------------------------------------------------------------

#: The named fields of a schedule; every other keyword of ``add`` / ``update``
#: is a per-occurrence option (``queue``, ``priority``, ``expires``, ...).
_SCHEDULE_FIELDS = frozenset(
    {
        "task",
        "schedule",
        "args",
        "kwargs",
        "timezone",
        "misfire",
        "overlap",
        "catchup_window",
        "max_catchup",
        "relative",
    }
)

#: Attempts of ``update`` when a concurrent change moved the version under it.
_UPDATE_ATTEMPTS = 3


class ScheduleManager:
    """``client.schedules``: periodic schedules managed at runtime, without a restart.

    Every change is one transaction and takes effect within one leader tick:
    the planner re-reads the changed row, and the schedule's occurrences
    already materialized but not yet due are withdrawn first, so none of
    them fires with the old definition. Invalid input raises an
    :class:`~celery_sched.errors.InvalidSchedule` (or
    :class:`~celery_sched.errors.UnknownTimezone`) naming the problem and
    writes nothing.

    Schedules defined in code (``beat_schedule``, task decorators) are
    re-synced by the leader at every election: they can be paused, resumed
    and triggered here, but are changed or removed in the code.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._ids = UUID7Source()

    @property
    def _store(self) -> JobStore:
        return self._client.store

    # -- writing ----------------------------------------------------------------

    def add(
        self,
        name: str,
        task: str,
        schedule: Any,
        *,
        args: Any = (),
        kwargs: Mapping[str, Any] | None = None,
        timezone: str | None = None,
        misfire: str | None = None,
        overlap: str | None = None,
        catchup_window: float | None = None,
        max_catchup: int | None = None,
        relative: bool = False,
        check_task: bool = True,
        **options: Any,
    ) -> ScheduleInfo:
        """Add a periodic schedule and return it.

        ``schedule`` is anything ``celery beat`` accepts (a ``crontab``, a
        ``schedule``, a ``timedelta`` or seconds, a ``solar``), a
        :class:`celery_sched.schedules.clocked` one-off or a cron string.
        ``options`` are per-occurrence options (``queue``, ``exchange``,
        ``routing_key``, ``priority``, ``headers``, ``expires`` in seconds).
        A name already taken raises :class:`~celery_sched.errors.ScheduleExists`.
        """
        row = self._row(
            {
                "name": name,
                "task": task,
                "schedule": schedule,
                "args": args,
                "kwargs": kwargs,
                "timezone": timezone,
                "misfire": misfire,
                "overlap": overlap,
                "catchup_window": catchup_window,
                "max_catchup": max_catchup,
                "relative": relative,
                "options": options,
            },
            now=self._store.now(),
            check_task=check_task,
        )
        self._store.add_schedules([row])
        logger.info("added schedule %s (%s %s)", name, row.kind, dict(row.spec))
        info = self.get(name)
        assert info is not None
        return info

    def add_many(self, entries: Iterable[Mapping[str, Any]], *, check_task: bool = True) -> int:
        """Add many schedules in one all-or-nothing write; return how many.

        Each entry has ``name``, ``task``, ``schedule`` and optionally the
        other keywords of :meth:`add`; any other key is an option. An invalid
        entry (named by its index) or a taken name writes nothing.
        """
        from celery_sched import schedules

        now = self._store.now()
        # One spec builder for the batch: make_spec sets one up per call (the
        # app's settings and a job validator), which dominates a large batch.
        specs = schedules.SpecBuilder(self._client.app)
        rows: list[NewSchedule] = []
        for index, entry in enumerate(entries):
            values = dict(entry)
            fields = {key: values.pop(key) for key in (*_SCHEDULE_FIELDS, "name") if key in values}
            fields["options"] = values
            try:
                rows.append(self._row(fields, now=now, check_task=check_task, specs=specs))
            except InvalidSchedule as exc:
                raise type(exc)(f"entry {index}: {exc}") from exc
        count = self._store.add_schedules(rows)
        logger.info("added %d schedules", count)
        return count

    def check(self, entry: Mapping[str, Any], *, check_task: bool = True) -> None:
        """Validate one :meth:`add_many` entry as it would be, writing nothing.

        Raises what :meth:`add_many` would for it
        (:class:`~celery_sched.errors.InvalidSchedule`,
        :class:`~celery_sched.errors.UnknownTimezone`, ...; a name already
        stored is not checked). Used by ``sched import`` to skip bad entries
        one by one before it writes the good ones.
        """
        values = dict(entry)
        fields = {key: values.pop(key) for key in (*_SCHEDULE_FIELDS, "name") if key in values}
        fields["options"] = values
        self._row(fields, now=self._store.now(), check_task=check_task)

    def update(self, name: str, **changes: Any) -> ScheduleInfo:
        """Change a schedule; only the given fields change (an option given as
        ``None`` is removed; ``misfire=None`` means the project default again).

        A new ``schedule``, ``timezone`` or ``relative`` restarts it: its next
        run is computed from now, and nothing fires at once. Other changes
        keep its timing; occurrences already planned are planned again with
        the new definition.
        """
        check_task = bool(changes.pop("check_task", True))
        for _attempt in range(_UPDATE_ATTEMPTS):
            row = self._existing(name, changing=True)
            fields = self._fields_of(row)
            for key, value in changes.items():
                if key in _SCHEDULE_FIELDS:
                    fields[key] = value
                elif value is None:
                    fields["options"].pop(key, None)
                else:
                    fields["options"][key] = value
            new = self._row(fields, now=self._store.now(), check_task=check_task)
            restart = new.timing() != row.as_new().timing()
            replaced = self._store.replace_schedule(
                new, expected_version=row.version, restart=restart
            )
            if replaced is not None:
                logger.info("updated schedule %s (%s)", name, ", ".join(sorted(changes)))
                return self._info(replaced)
        raise StoreError(
            f"schedule {name!r} kept changing concurrently; update gave up after "
            f"{_UPDATE_ATTEMPTS} attempts"
        )

    def pause(self, name: str) -> ScheduleInfo:
        """Stop planning the schedule; its occurrences not yet due are withdrawn."""
        info = self._info(self._store.set_schedule_paused(name, True))
        logger.info("paused schedule %s", name)
        return info

    def resume(self, name: str) -> ScheduleInfo:
        """Plan the schedule again; what it missed while paused follows its
        misfire policy (``once``, the default, runs the latest missed one).

        Also retries a ``broken`` schedule (paused or not): the planner
        tries it again, and marks it broken again if it still fails."""
        info = self._info(self._store.set_schedule_paused(name, False))
        logger.info("resumed schedule %s", name)
        return info

    def delete(self, name: str) -> bool:
        """Delete the schedule (its finished history stays); False if unknown.

        A schedule defined in code can be deleted here only once it is gone
        from the code (disabled by the leader's sync).
        """
        row = self._store.get_schedule(name)
        if row is None:
            return False
        if row.source == "static" and row.enabled:
            raise InvalidSchedule(_STATIC_HINT.format(name=name, what="removed"))
        return self._store.delete_schedule(name)

    def trigger(self, name: str) -> Job | None:
        """Run one extra occurrence now and return its job.

        ``None`` (nothing written) when the schedule's overlap policy is
        ``skip`` and an occurrence of it is due or running. Works on paused
        schedules too.
        """
        from celery_sched.schedules.rows import occurrence_job

        row = self._existing(name, changing=False)
        now = self._store.now()
        job = occurrence_job(
            row,
            now,
            now=now,
            job_id=self._ids.next(),
            max_attempts=self._client.settings.max_attempts,
            shard_of=self._client.builder.shard_of,
        )
        stored = self._store.trigger_occurrence(job, skip_if_busy=row.overlap == "skip")
        if stored is None:
            logger.info("trigger of schedule %s skipped: an occurrence is running", name)
            return None
        self._client._stage([(stored.shard, stored.id, stored.due_at)])
        logger.info("triggered schedule %s: job %s", name, stored.key)
        return stored

    # -- reading ------------------------------------------------------------------

    def history(self, name: str, *, limit: int = 20) -> list[Job]:
        """The last ``limit`` occurrences of the schedule (due by now,
        triggered ones included), newest due first. Raises
        :class:`~celery_sched.errors.UnknownSchedule`."""
        row = self._existing(name, changing=False)
        return self._store.schedule_history(row.id, limit=limit)

    def get(self, name: str) -> ScheduleInfo | None:
        """The schedule called ``name`` with its next and last run, or ``None``."""
        row = self._store.get_schedule(name)
        return None if row is None else self._info(row)

    def list(self, *, after: str | None = None, limit: int | None = None) -> list[ScheduleInfo]:
        """Schedules by name (those after ``after``, at most ``limit``), each
        with its next and last run."""
        rows = self._store.list_schedules(after=after, limit=limit)
        accept = self._client.accept
        infos: list[ScheduleInfo] = []
        for start in range(0, len(rows), 1000):
            chunk = rows[start : start + 1000]
            runs = self._store.schedule_runs([row.id for row in chunk])
            infos.extend(_info(row, runs.get(row.id), accept) for row in chunk)
        return infos

    def counts(self) -> dict[str, int]:
        """Number of schedules per state (active, paused, disabled, broken)."""
        return self._store.count_schedules()

    # -- helpers --------------------------------------------------------------------

    def _row(
        self,
        fields: Mapping[str, Any],
        *,
        now: dt.datetime,
        check_task: bool,
        specs: SpecBuilder | None = None,
    ) -> NewSchedule:
        """The validated row of one schedule given as :meth:`add` keywords.

        ``specs`` is a spec builder shared by a batch (see :meth:`add_many`).
        """
        from celery_sched.schedules.rows import schedule_row
        from celery_sched.schedules.spec import SpecBuilder

        builder = specs if specs is not None else SpecBuilder(self._client.app)
        # The spec builder checks every value, name and task included.
        spec = builder.from_fields(
            fields.get("name"),
            fields.get("task"),
            fields.get("schedule"),
            fields,
            relative=fields.get("relative", False),
            source=fields.get("source", "dynamic"),
            enabled=fields.get("enabled", True),
        )
        return schedule_row(spec, self._client.builder, now=now, check_task=check_task)

    def _existing(self, name: str, *, changing: bool) -> StoredSchedule:
        row = self._store.get_schedule(name)
        if row is None:
            raise UnknownSchedule(name=name)
        if changing and row.source == "static":
            raise InvalidSchedule(_STATIC_HINT.format(name=name, what="changed"))
        return row

    def _fields_of(self, row: StoredSchedule) -> dict[str, Any]:
        """The keyword form of a stored schedule, for :meth:`_row`."""
        import celery.schedules

        from celery_sched import schedules
        from celery_sched.schedules.rows import spec_of

        args, kwargs = _decode(row, self._client.accept)
        value: Any
        if row.kind == "interval":
            # Not the schedule object: its own `relative` would outlive a
            # change of the `relative` field.
            value = dt.timedelta(seconds=float(row.spec["seconds"]))
        else:
            value = schedules.schedule_from_spec(spec_of(row), app=self._client.app)
            if isinstance(value, celery.schedules.crontab):
                # Its tz is the stored timezone; a new `timezone` must win.
                vars(value).pop("tz", None)
        return {
            "name": row.name,
            "task": row.task,
            "schedule": value,
            "args": args,
            "kwargs": kwargs,
            "timezone": row.timezone,
            "misfire": row.misfire,
            "overlap": row.overlap,
            "catchup_window": row.catchup_window,
            "max_catchup": row.max_catchup,
            "relative": row.relative,
            "options": dict(row.options),
            "source": row.source,
            "enabled": row.enabled,
        }

    def _info(self, row: StoredSchedule) -> ScheduleInfo:
        return _info(row, self._store.schedule_runs([row.id]).get(row.id), self._client.accept)


_STATIC_HINT = (
    "schedule {name!r} is defined in code (beat_schedule or a task decorator) and is "
    "synced from there by the leader; it is {what} in the code (it can be paused, "
    "resumed and triggered here)"
)


def _decode(row: StoredSchedule, accept: frozenset[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return decode_body(
        row.body, row.content_type, row.content_encoding, accept, f"schedule {row.name!r}"
    )


def _info(row: StoredSchedule, runs: ScheduleRuns | None, accept: frozenset[str]) -> ScheduleInfo:
    runs = runs or ScheduleRuns()
    next_run: dt.datetime | None = None
    if row.enabled and not row.paused:
        # A broken schedule plans nothing more; what it planned before still runs.
        planned = None if row.broken_at is not None else row.next_nominal_at
        candidates = [t for t in (runs.next_due_at, planned) if t is not None]
        next_run = min(candidates) if candidates else None
    undecodable: str | None = None
    try:
        args, kwargs = _decode(row, accept)
    except UndecodableBody as exc:
        # One unreadable row must not fail every listing (the CLI's, the
        # console's): it shows as broken, with the reason.
        args, kwargs, undecodable = (), {}, str(exc)
    return ScheduleInfo(
        name=row.name,
        task=row.task,
        kind=row.kind,
        spec=dict(row.spec),
        timezone=row.timezone,
        args=args,
        kwargs=kwargs,
        options=dict(row.options),
        misfire=row.misfire,
        overlap=row.overlap,
        catchup_window=row.catchup_window,
        max_catchup=row.max_catchup,
        relative=row.relative,
        source=row.source,
        enabled=row.enabled,
        paused=row.paused,
        next_run_at=next_run,
        last_run_at=runs.last_due_at,
        last_status=runs.last_status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        disabled_at=row.disabled_at,
        broken_at=row.broken_at,
        broken_reason=undecodable or row.broken_reason,
        undecodable=undecodable,
    )
