"""The I/O interfaces of celery_sched, in one place.

Each interface has one real backend and one in-memory fake for unit tests;
both pass the same contract test suite (``tests/contract``). The job store
(:class:`JobStore`) is split into the roles its callers need
(:class:`Jobs`, :class:`WorkerReports`, :class:`ScheduleStore`); a caller
that needs one role may ask for that role alone. Methods say what is atomic
and what they raise. Every backend raises only :mod:`celery_sched.errors`
exceptions: driver errors are translated inside the backend.

Vocabulary, the same in every module: a *job* is one task message due at
one time (the public ``Client.schedule``, ``schedule_many`` and
``Task.schedule`` keep Celery's verb, and make jobs); a *schedule* is a
periodic definition (``Client.schedules``, ``beat_schedule``), which the
planner turns into *occurrences*, jobs keyed ``name@nominal-time``. The store
*adds* one job (:meth:`Jobs.add_job`), *loads* many at once with COPY
(:meth:`Jobs.load_jobs`, :meth:`Jobs.load_job_rows`) and *adds occurrences*
skipping those already there (:meth:`Jobs.add_occurrences`).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

from celery_sched.models import (
    DeliveryCheck,
    DueSpan,
    Job,
    JobQuery,
    JobStatus,
    LeaderReport,
    LeaderView,
    LedgerClaim,
    LedgerEntry,
    MinuteDispatches,
    NewJob,
    NewJobRow,
    NewSchedule,
    PageCursor,
    PlanCommit,
    ReconcileResult,
    RehomeResult,
    RequeueResult,
    ScheduleAdvance,
    ScheduleRuns,
    StoredSchedule,
    SyncResult,
    WorkerUpdate,
)
from celery_sched.timeutil import ensure_utc, to_epoch_seconds


class StoreLifecycle(abc.ABC):
    """What every role of the job store has: its lifecycle and its clock.

    The store is PostgreSQL; its roles (:class:`Jobs`, :class:`WorkerReports`,
    :class:`ScheduleStore`) are the parts of it that different callers need,
    and :class:`JobStore` is all of them. Due-ness and timeouts are judged by
    the store's clock (:meth:`now`, Postgres ``now()``), never the caller's.
    Every method is one transaction unless it says otherwise. Unreachable
    backends raise :class:`~celery_sched.errors.StoreUnavailable` after
    bounded retries.
    """

    @abc.abstractmethod
    def migrate(self) -> None:
        """Create or upgrade the schema. Idempotent; safe to run concurrently."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    @abc.abstractmethod
    def now(self) -> dt.datetime:
        """The store's current time (aware UTC)."""


class Jobs(StoreLifecycle):
    """The job rows: writing and reading them, a user's cancel, and the
    leader's work on them (fencing epochs, claims, requeues, the rescue of
    lost workers' jobs, pruning)."""

    # -- writing jobs -------------------------------------------------------

    @abc.abstractmethod
    def add_job(self, job: NewJob, *, if_exists: Literal["raise", "return"] = "raise") -> Job:
        """Insert one job.

        On an existing key, raise :class:`~celery_sched.errors.DuplicateJob`
        (``if_exists="raise"``) or return the existing job unchanged
        (``"return"``).
        """

    @abc.abstractmethod
    def load_jobs(self, jobs: Iterable[NewJob]) -> int:
        """Insert many jobs atomically (COPY); return how many were written.

        All or nothing: a duplicate key (already stored, or twice in
        ``jobs``) raises :class:`~celery_sched.errors.DuplicateJob` and writes
        nothing.
        """

    def load_job_rows(self, rows: Iterable[NewJobRow]) -> int:
        """:meth:`load_jobs` for rows already validated into
        :data:`~celery_sched.models.NEW_JOB_ROW` tuples (the bulk fast path:
        no :class:`NewJob` per row). Same atomicity and errors."""
        return self.load_jobs(map(NewJob.from_row, rows))

    @abc.abstractmethod
    def add_occurrences(self, jobs: Sequence[NewJob]) -> list[uuid.UUID]:
        """Insert jobs whose keys may already exist, skipping those that do.

        Returns the ids actually written. Racing callers never create the same
        key twice (periodic planners rely on this).
        """

    # -- reading ------------------------------------------------------------

    @abc.abstractmethod
    def get(self, key: str) -> Job | None:
        """The job with ``key``, or ``None``."""

    @abc.abstractmethod
    def get_by_id(self, job_id: uuid.UUID) -> Job | None:
        """The job with ``job_id``, or ``None``."""

    @abc.abstractmethod
    def counts_by_status(self) -> dict[JobStatus, int]:
        """Number of jobs per status (statuses with no jobs are omitted)."""

    @abc.abstractmethod
    def counts_by_hour(self, status: JobStatus | None = None) -> dict[dt.datetime, int]:
        """Number of jobs per UTC hour of ``due_at``, optionally for one status."""

    @abc.abstractmethod
    def oldest_due_pending(self, *, shard: int) -> dt.datetime | None:
        """The due time of the oldest ``pending`` job of ``shard`` that is due
        by the store's clock, or ``None`` when none is (the backlog).

        Cheap at any table size: it reads the first entry of the pending index.
        """

    @abc.abstractmethod
    def dispatches_by_minute(
        self, *, since: dt.datetime, until: dt.datetime
    ) -> dict[dt.datetime, MinuteDispatches]:
        """Per UTC minute of ``due_at`` in ``[since, until)``: how many of
        the jobs due then were dispatched and their mean
        :func:`~celery_sched.models.dispatch_lag` (minutes with none are
        omitted). One aggregate over the due range, read by the web
        console's overview chart."""

    @abc.abstractmethod
    def recent_failures(self, *, limit: int) -> list[Job]:
        """The ``failed`` and ``dead`` jobs, the latest to finish first, at
        most ``limit``."""

    @abc.abstractmethod
    def list_jobs(
        self, query: JobQuery, *, after: PageCursor | None = None, limit: int
    ) -> list[Job]:
        """The jobs ``query`` selects, in its order of ``(due_at, id)``, only
        those beyond ``after`` in that order (keyset paging), at most
        ``limit``. Read-only. How PostgreSQL finds them (which index, for
        which filters) is said in ``store/postgres/listing.py``."""

    # -- user transitions ---------------------------------------------------

    @abc.abstractmethod
    def cancel(self, key: str) -> bool:
        """pending -> cancelled. True if the job was pending and is now cancelled."""

    @abc.abstractmethod
    def requeue(self, keys: Sequence[str], *, allowance: int | None = None) -> RequeueResult:
        """Requeue the jobs of ``keys`` by hand; one transaction.

        Only jobs in :data:`~celery_sched.models.REQUEUABLE_STATUSES` move:
        pending again, due now (``due_at``, ``due_bucket``), ``attempt + 1``,
        ``max_attempts`` per :func:`~celery_sched.models.requeued_allowance`
        (``allowance`` more dispatches, default the job's ``max_attempts``);
        ``dispatched_at``, ``started_at`` and ``finished_at`` cleared (an
        unfinished job must not be pruned), everything else kept (the last
        error, the worker, the epoch). The attempt moves on, never back: a
        late delivery of an older attempt is told apart by the fence. Keys
        of jobs in any other status are reported ``refused`` with it;
        unknown keys ``unknown``. ``ValueError`` for an allowance below 1.
        """

    @abc.abstractmethod
    def requeue_dead(
        self,
        *,
        died_by: dt.datetime,
        task: str | None = None,
        limit: int,
        allowance: int | None = None,
    ) -> list[Job]:
        """Requeue, as :meth:`requeue` does, up to ``limit`` ``dead`` jobs
        that died at or before ``died_by`` (``finished_at``), of ``task``
        only if given, soonest due first; return them. One transaction per
        call: a caller requeues millions a batch at a time, with the same
        ``died_by`` so that jobs dying meanwhile are left for later."""

    # -- leadership fencing -------------------------------------------------

    @abc.abstractmethod
    def acquire_epoch(self, shard: int, holder: str) -> int:
        """Bump and return the shard's epoch, recording ``holder``.

        Called once per lease acquisition; every later claim by an older
        epoch is refused.
        """

    @abc.abstractmethod
    def current_epoch(self, shard: int) -> int:
        """The shard's current epoch (0 if no leader was ever elected)."""

    # -- dispatch transitions (all fenced) -----------------------------------

    @abc.abstractmethod
    def due_soon(
        self,
        *,
        shard: int,
        within: float,
        limit: int,
        after: dt.datetime | None = None,
    ) -> list[tuple[uuid.UUID, dt.datetime]]:
        """``(id, due_at)`` of pending jobs with ``due_at <= now() + within``
        (overdue ones included), and ``due_at > after`` when ``after`` is
        given (incremental staging), ordered by due_at, at most ``limit``.
        Read-only."""

    @abc.abstractmethod
    def claim_due(self, *, shard: int, epoch: int, limit: int) -> list[Job]:
        """Claim up to ``limit`` pending jobs with ``due_at <= now()``.

        One transaction: pending -> dispatched, ``dispatched_at = now()``,
        ``leader_epoch = epoch``, ``claim_id`` a new random id shared by the
        claim's jobs (a retried try draws another); oldest due first; rows
        locked by another claimer are skipped. Raises
        :class:`~celery_sched.errors.StaleEpoch` (claiming nothing) when
        ``epoch`` is not the shard's current epoch.
        """

    @abc.abstractmethod
    def claim_ids(self, ids: Sequence[uuid.UUID], *, shard: int, epoch: int) -> list[Job]:
        """Like :meth:`claim_due`, restricted to ``ids``; ids that are not
        pending or not yet due are ignored."""

    @abc.abstractmethod
    def record_published(self, claim_ids: Sequence[int], *, shard: int) -> None:
        """Record that the claims ``claim_ids`` went out: every job of theirs
        still ``dispatched`` was published.

        Unfenced (a fact, not a transition) and idempotent. Call it only once
        every job of the claim that was not sent left ``dispatched``
        (released, expired, failed or missed): :meth:`reconcile` marks the
        dispatched jobs of a recorded claim ``sent`` when no worker tracks
        their task, and requeues those of a claim never recorded.
        """

    @abc.abstractmethod
    def release(self, ids: Sequence[uuid.UUID], *, epoch: int, due: DueSpan) -> int:
        """dispatched -> pending for jobs this epoch claimed but could not publish.

        Fenced: only rows with ``leader_epoch = epoch`` move. Returns the count.
        ``due`` spans the jobs' due times (the claimed jobs'): a job due
        outside it is not looked for, and so not moved; so for every
        transition by id of the leader (:meth:`mark_expired`,
        :meth:`fail_dispatch`, :meth:`mark_missed`).
        """

    @abc.abstractmethod
    def mark_expired(
        self, ids: Sequence[uuid.UUID], *, epoch: int, reason: str, due: DueSpan
    ) -> int:
        """dispatched -> expired (fenced), with ``reason`` as ``last_error``.

        Only jobs whose ``expires_at`` has passed by the store's clock move:
        a caller whose clock ran ahead leaves the others dispatched (the
        reconciler sends them again)."""

    @abc.abstractmethod
    def fail_dispatch(
        self, failures: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> ReconcileResult:
        """Count a failed publish against each job: ``(id, why)`` pairs.

        For a job whose own message could not be published (unroutable,
        unencodable, refused by the broker for this message or its queue
        only). One statement, fenced like :meth:`release`: dispatched jobs
        claimed by ``epoch`` go back to pending with ``attempt + 1`` and
        ``last_error`` saying why, or become dead (``finished_at`` set) once
        ``attempt + 1`` reaches ``max_attempts``, as the reconciler decides.
        Returns how many were requeued and how many died (``timed_out`` 0).
        """

    @abc.abstractmethod
    def mark_missed(
        self, dropped: Sequence[tuple[uuid.UUID, str]], *, epoch: int, due: DueSpan
    ) -> list[uuid.UUID]:
        """dispatched -> missed: ``(id, why)`` pairs of occurrences the misfire
        policy drops at their first dispatch.

        Fenced like :meth:`release`, and only jobs never sent before
        (``attempt`` 0) move: a requeued job follows ``max_attempts``.
        ``finished_at`` is set and ``last_error`` says why. Returns the ids
        that moved (the caller publishes the others).
        """

    @abc.abstractmethod
    def unfinished_by_shard(self, *, from_shard: int) -> dict[int, dict[JobStatus, int]]:
        """Unfinished jobs (pending, dispatched, running, retrying) in shards
        ``>= from_shard``: per shard, the count per status (shards and
        statuses with none are omitted). Read-only; reads only the partial
        indexes of those statuses, so it is cheap on a large table."""

    # -- changing the shard count ---------------------------------------------

    @abc.abstractmethod
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
        """Move up to ``limit`` unfinished jobs (pending, dispatched, running,
        retrying) whose shard is not ``shard_of(key)`` to that shard; one
        transaction. The key of a job without one is its id's text, as reads
        present it; ``shard_of`` is the client's, so rows land where new
        inserts of the same key would.

        ``stranded_only``: only rows in shards ``>= shards`` (no beat leads
        them), pending ones soonest due first, then the others; no cursor is
        needed since moved rows leave that set; ``in_flight=False`` leaves
        out the dispatched, running and retrying ones (their scan reads every
        job in flight, so the leader does it less often). Otherwise one page of a full
        pass in id order from ``after`` (exclusive), moving the misplaced
        rows of the page; the result's ``after`` is where the next page
        starts.

        No global lock: each row moves only if it is still unfinished and in
        the shard it was read in (re-checked on the row's latest version),
        so a row claimed, reported or finished meanwhile is never lost or
        moved twice. ``dry_run``: read and report, move nothing.
        """

    @abc.abstractmethod
    def placed_for(self) -> int | None:
        """The shard count the rows were last all placed for (see
        :meth:`record_placement`); None when never recorded."""

    @abc.abstractmethod
    def record_placement(self, shards: int) -> None:
        """Record that every unfinished row sits in the shard its key hashes
        to under ``shards`` (after a full :meth:`rehome` pass)."""

    @abc.abstractmethod
    def reconcile(
        self, *, shard: int, epoch: int, limit: int, default_visibility_timeout: float
    ) -> ReconcileResult:
        """Requeue jobs dispatched longer ago than their visibility timeout.

        Only jobs whose task some worker process tracks: a heartbeat row
        (live or not yet pruned) lists the task or lists none (see
        :meth:`WorkerReports.heartbeat`), or whose claim was never recorded
        as published (:meth:`record_published`; jobs claimed before that
        record existed count as published). A stale dispatched job whose
        task no worker tracks and whose claim went out is not requeued
        (nothing would report that it ran, so a requeue could only run it
        twice): it becomes ``sent``, finished, counted in ``untracked``.

        Also ``retrying`` jobs whose retry was due (their ``dispatched_at``,
        see :meth:`mark_retrying`) longer ago than their visibility timeout:
        the retry message was lost. Either goes pending again with
        ``attempt + 1``; past ``max_attempts`` dead, with the reason. At most
        ``limit`` rows, dispatched jobs first (requeued, then marked sent),
        then retrying, then running past ``max_runtime``. Fenced like a claim
        (raises ``StaleEpoch``).
        """

    @abc.abstractmethod
    def rescue(
        self, *, shard: int, epoch: int, limit: int, worker_timeout: float
    ) -> ReconcileResult:
        """Rescue running jobs whose worker process stopped beating.

        A ``running`` job of ``shard`` started more than ``worker_timeout``
        seconds ago is rescued when its process, ``(worker, worker_pid)``
        (every process of host ``worker`` if ``worker_pid`` is NULL), has a
        heartbeat row and none of those rows was seen within
        ``worker_timeout`` seconds by a process started before the job (a
        later start reuses the pid). Jobs of hosts with no heartbeat row at
        all (workers that do not beat) are left alone. A rescued job whose
        ledger entry (key ``coalesce(key, id::text)``) is completed for this
        job id becomes ``succeeded``; any other is requeued: pending with
        ``attempt + 1``, or dead past ``max_attempts``, ``last_error`` naming
        the host, pid and last heartbeat. One statement, oldest start first,
        at most ``limit`` rows; fenced like a claim (raises ``StaleEpoch``).
        """

    # -- housekeeping -------------------------------------------------------

    @abc.abstractmethod
    def prepare_storage(self) -> None:
        """Storage upkeep ahead of the inserts, run by shard 0's leader each
        housekeeping round: PostgreSQL creates the ``jobs`` partitions of
        today and the next days, so the day's first inserts never wait for
        DDL (an insert creates a missing partition itself otherwise)."""

    @abc.abstractmethod
    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        """Delete finished jobs whose finished_at is more than ``older_than``
        seconds ago, ``batch`` rows per transaction, at most ``max_batches``
        transactions (None: until none is left); return the total.

        PostgreSQL first drops each partition whose every job finished
        before then (whole, with its keys), then deletes in batches."""


class WorkerReports(StoreLifecycle):
    """What workers report: their processes' heartbeats and their jobs'
    transitions (started, retrying, finished, lost)."""

    @abc.abstractmethod
    def heartbeat(
        self,
        hostname: str,
        pid: int,
        *,
        first: bool = False,
        tasks: Sequence[str] | None = None,
    ) -> None:
        """Record that worker process ``(hostname, pid)`` is alive: its
        ``seen_at`` becomes now, and its ``started_at`` too when the row is
        new or ``first`` (the process's first beat: a reused pid is a new
        process). ``tasks`` are the names of the tasks whose jobs it tracks
        (``None``: every task); the reconciler requeues only jobs of tracked
        tasks (see :meth:`Jobs.reconcile`)."""

    @abc.abstractmethod
    def mark_running(
        self,
        job_id: uuid.UUID,
        *,
        worker: str,
        worker_pid: int | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        """dispatched/retrying/pending -> running (started_at, worker, worker_pid).

        ``due_at`` (every transition of a worker's): the job's due time from
        its message; a job due at another time is not moved. ``None`` (a
        message without the header) finds the job among those due by
        :data:`~celery_sched.models.SENT_DUE_MARGIN` from now."""

    @abc.abstractmethod
    def mark_finished(
        self,
        job_id: uuid.UUID,
        status: JobStatus,
        *,
        error: str | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        """Any unfinished status -> ``status`` (a finished one), finished_at set."""

    @abc.abstractmethod
    def mark_retrying(
        self,
        job_id: uuid.UUID,
        *,
        error: str | None = None,
        retry_in: float | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        """running -> retrying (a Celery retry is on its way), ``dispatched_at``
        set to when the retry is due: the store's now plus ``retry_in``
        seconds (now if ``None``). ``ValueError`` for a ``retry_in`` that
        :func:`~celery_sched.models.check_retry_in` refuses."""

    @abc.abstractmethod
    def apply_worker_updates(self, updates: Sequence[WorkerUpdate]) -> int:
        """Apply workers' status reports in one transaction; return rows changed.

        Equivalent to applying each update in order with :meth:`mark_running`
        (``running``), :meth:`mark_retrying` (``retrying``, with its
        ``retry_in``) or
        :meth:`mark_finished` (``succeeded`` / ``failed``): finished jobs are
        never changed, and timestamps come from the store's clock; each
        report's ``due_at`` applies as in :meth:`mark_running`. A
        ``pending`` report (its worker process was lost) requeues a
        dispatched or running job whose ``attempt`` is the report's (any, if
        the report has none): pending with ``attempt + 1`` and the report's
        error, or dead past ``max_attempts``.
        """

    @abc.abstractmethod
    def prune_workers(self, *, older_than: float) -> int:
        """Delete heartbeat rows not seen for ``older_than`` seconds; return how many."""


class ScheduleStore(StoreLifecycle):
    """The periodic schedules, and the occurrences (job rows) the planner
    writes for them.

    A schedule's future occurrences are pending job rows (``schedule_id``
    set, key ``name@<nominal>``). Every change a user makes *withdraws*
    them: pending occurrences of the schedule not yet due (``due_at >
    now()``) are deleted (they were never dispatched, and deleting frees
    their keys for re-planning), and, unless the change restarts the
    timing, the cursor rolls back to the earliest withdrawn one
    (``last_nominal_at = NULL``, ``next_nominal_at`` = its due time), so the
    planner materializes them again from the current definition. Every
    change also bumps ``version``.

    A schedule the planner cannot plan is marked *broken* (``broken_at``,
    ``broken_reason``) and left out of planning; a user's change to it
    (replace, resume, a changed static definition) clears the mark so the
    planner tries it again.
    """

    @abc.abstractmethod
    def add_schedules(self, schedules: Sequence[NewSchedule]) -> int:
        """Insert new schedules atomically; return how many.

        All or nothing: a name already stored, or twice in ``schedules``,
        raises :class:`~celery_sched.errors.ScheduleExists` and writes nothing.
        """

    @abc.abstractmethod
    def get_schedule(self, name: str) -> StoredSchedule | None:
        """The schedule called ``name``, or ``None``."""

    @abc.abstractmethod
    def schedules_by_id(self, schedule_ids: Sequence[int]) -> dict[int, StoredSchedule]:
        """The schedules among ``schedule_ids`` that exist, by id. Read-only."""

    @abc.abstractmethod
    def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[StoredSchedule]:
        """Schedules ordered by name, those named after ``after`` only, at most ``limit``."""

    @abc.abstractmethod
    def count_schedules(self) -> dict[str, int]:
        """Number of schedules per state: ``active``, ``paused``, ``disabled``,
        ``broken`` (states with none are omitted). Each schedule counts once,
        in the first of ``disabled``, ``paused``, ``broken`` that applies."""

    @abc.abstractmethod
    def schedule_runs(self, schedule_ids: Sequence[int]) -> dict[int, ScheduleRuns]:
        """Per schedule id: its earliest pending occurrence due after now and
        its latest occurrence due at or before now (ids with neither are omitted)."""

    @abc.abstractmethod
    def schedule_history(self, schedule_id: int, *, limit: int) -> list[Job]:
        """The occurrences of schedule ``schedule_id`` due at or before now,
        newest due first (ties: newest id first), at most ``limit``;
        triggered ones included. Read-only; bounded by ``limit`` whatever
        the history's size (PostgreSQL walks ``jobs_schedule_due_idx``
        backwards). The jobs outlive the schedule: a deleted schedule's id
        still finds its history."""

    @abc.abstractmethod
    def replace_schedule(
        self, schedule: NewSchedule, *, expected_version: int, restart: bool
    ) -> StoredSchedule | None:
        """Replace the definition of the schedule ``schedule.name`` and withdraw its
        future occurrences.

        With ``restart`` the cursor is reset (``last_nominal_at = NULL``,
        ``next_nominal_at = schedule.next_nominal_at``); otherwise it rolls
        back as described above. ``source`` and ``paused`` are kept; the
        broken mark is cleared. Returns the new row, or ``None`` (writing
        nothing) when the stored version is not ``expected_version``. Raises
        :class:`~celery_sched.errors.UnknownSchedule` if there is no such schedule.
        """

    @abc.abstractmethod
    def set_schedule_paused(self, name: str, paused: bool) -> StoredSchedule:
        """Pause (withdrawing future occurrences, cursor rolled back) or resume.

        Already in that state: nothing changes, except that resuming always
        clears the broken mark (so the planner tries the schedule again; a
        pause keeps it). Resuming leaves the cursor where it was, so the
        planner treats the time paused as missed (misfire policy). Raises
        :class:`~celery_sched.errors.UnknownSchedule`.
        """

    @abc.abstractmethod
    def delete_schedule(self, name: str) -> bool:
        """Withdraw the schedule's future occurrences and delete it; False if unknown.

        Occurrences already due or dispatched, and the finished history, stay.
        """

    @abc.abstractmethod
    def trigger_occurrence(self, job: NewJob, *, skip_if_busy: bool) -> Job | None:
        """Insert an extra occurrence of schedule ``job.schedule_id`` now.

        One transaction holding the schedule row's lock (the planner's
        commits take it too). With ``skip_if_busy``, returns ``None`` and
        writes nothing while an occurrence of the schedule is due or running
        (pending with ``due_at <= now()``, dispatched, running, retrying); a
        pending occurrence not yet due does not count. An existing key
        returns the stored job. Raises
        :class:`~celery_sched.errors.UnknownSchedule` if the schedule is gone.
        """

    @abc.abstractmethod
    def sync_static_schedules(self, schedules: Sequence[NewSchedule]) -> SyncResult:
        """Make the static schedules match ``schedules`` (the code's definitions).

        One transaction. New names are inserted; a stored static schedule
        whose definition differs is replaced (a timing change or a
        re-enabled schedule restarts from ``next_nominal_at``, any other
        change rolls back); static schedules not in ``schedules`` are
        disabled (``enabled = false``, ``disabled_at`` set, future
        occurrences withdrawn, history kept). Dynamic schedules are never
        touched, even when a static definition has their name (reported in
        ``conflicts``). Pause state survives; a replaced schedule's broken
        mark is cleared, an unchanged one's kept.
        """

    @abc.abstractmethod
    def due_schedules(
        self,
        *,
        horizon: dt.datetime,
        shard: int,
        shards: int,
        limit: int,
        after: tuple[dt.datetime, int] | None = None,
    ) -> list[StoredSchedule]:
        """Enabled, unpaused, unbroken schedules with ``next_nominal_at <=
        horizon`` and ``id % shards == shard``, ordered by ``(next_nominal_at,
        id)``, only those after ``after`` in that order (paging through one
        pass), at most ``limit``. Read-only."""

    @abc.abstractmethod
    def busy_schedules(self, schedule_ids: Sequence[int]) -> set[int]:
        """The ids among ``schedule_ids`` with an unfinished occurrence
        (pending, dispatched, running or retrying). Read-only."""

    @abc.abstractmethod
    def commit_plans(self, advances: Sequence[ScheduleAdvance]) -> PlanCommit:
        """Apply planner advances in one transaction (see :class:`ScheduleAdvance`).

        Each advance applies only if its schedule still has the version the
        planner read, is enabled, unpaused and not broken, and its cursor would not move
        back (a slower planner that read the row earlier); the others are
        counted as ``stale`` and write nothing. Occurrence keys that exist
        are skipped, so racing planners never create one twice.
        """

    @abc.abstractmethod
    def mark_schedule_broken(self, schedule_id: int, *, version: int, reason: str) -> bool:
        """Set the schedule aside as broken (``broken_at = now()``, ``broken_reason
        = reason``): the planner could not plan it.

        Fenced like :meth:`commit_plans`: applies only if the schedule still
        has ``version`` and is not broken already, so a user's concurrent
        change (which may be the fix) wins. Does not bump the version. True if
        it was marked. ``reason`` is stored as given: it must be text
        PostgreSQL accepts (no NUL, no lone surrogate).
        """


class JobStore(Jobs, WorkerReports, ScheduleStore):
    """The source of truth for jobs (PostgreSQL): every role of the store.

    Callers that need only a part of it may ask for that role instead.
    """


class LeaseBackend(abc.ABC):
    """Atomic primitives of the leader lease (Redis).

    Never GET-then-SET: every operation is one atomic command or script.
    Unreachable backends raise :class:`~celery_sched.errors.LeaseUnavailable`.
    """

    @abc.abstractmethod
    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        """Take the lease if free (SET NX PX). True if ``token`` now holds it."""

    @abc.abstractmethod
    def renew(self, shard: int, token: str, ttl: float) -> bool:
        """Extend the lease if ``token`` still holds it (compare-and-pexpire)."""

    @abc.abstractmethod
    def release(self, shard: int, token: str) -> bool:
        """Drop the lease if ``token`` holds it (compare-and-del)."""

    @abc.abstractmethod
    def holder(self, shard: int) -> str | None:
        """The token holding the lease, or ``None``."""


class Membership(abc.ABC):
    """Which beats are alive, for beats that share the shards between them
    (:mod:`celery_sched.leader.balancing`); Redis in production.

    A beat stays listed for ``ttl`` seconds after its last :meth:`heartbeat`
    (by the backend's clock, never the caller's). Unreachable backends raise
    :class:`~celery_sched.errors.LeaseUnavailable`.
    """

    @abc.abstractmethod
    def heartbeat(self, beat: str, ttl: float) -> list[str]:
        """List ``beat`` as alive for ``ttl`` more seconds, forget beats whose
        time ran out, and return the ids of every live beat, sorted."""

    @abc.abstractmethod
    def leave(self, beat: str) -> None:
        """Stop listing ``beat`` (a clean shutdown), at once."""


class LeaderBoard(abc.ABC):
    """Where each shard's leader says it is at work, for operators (Redis).

    The leader posts a :class:`~celery_sched.models.LeaderReport` after its
    passes (at most about once a second: one small write); a reader sees,
    per shard, the lease's holder and time left beside the last report.
    Nothing decides anything from it. Unreachable backends raise
    :class:`~celery_sched.errors.LeaseUnavailable`.
    """

    @abc.abstractmethod
    def post(self, report: LeaderReport) -> None:
        """Record ``report`` as its shard's last one (kept for a day)."""

    @abc.abstractmethod
    def read(self, shards: Sequence[int]) -> list[LeaderView]:
        """Each of ``shards``' lease holder (``host:pid``), the seconds its
        lease has left, and its last report; one round trip."""


class Staging(abc.ABC):
    """The near-future copy of due jobs (a Redis sorted set per shard).

    Only a copy: losing it delays jobs, never loses them. Scores are epoch
    seconds of ``due_at``. Unreachable backends raise
    :class:`~celery_sched.errors.StagingUnavailable`.
    """

    @abc.abstractmethod
    def add(self, shard: int, items: Iterable[tuple[uuid.UUID, dt.datetime]]) -> int:
        """Stage ``(id, due_at)`` pairs; return how many were new."""

    @abc.abstractmethod
    def pop_due(
        self,
        shard: int,
        now: dt.datetime,
        limit: int,
        *,
        drop_through: dt.datetime | None = None,
    ) -> list[uuid.UUID]:
        """Atomically remove and return up to ``limit`` ids scored at or before
        ``now``, earliest first.

        ``drop_through``: first discard, unreturned, every id scored at or
        before it (the sweep has claimed past that time, so those copies
        would only be found taken; any it skipped stay pending in the store).
        """

    @staticmethod
    def pop_scores(
        now: dt.datetime, limit: int, drop_through: dt.datetime | None
    ) -> tuple[float, float | None]:
        """:meth:`pop_due`'s arguments checked and turned into scores, as every
        backend reads them: ``(max score, drop score or None)``."""
        if limit < 0:
            raise ValueError(f"limit must not be negative, got {limit}")
        max_score = to_epoch_seconds(ensure_utc(now, name="now"))
        if drop_through is None:
            return max_score, None
        return max_score, to_epoch_seconds(ensure_utc(drop_through, name="drop_through"))

    @abc.abstractmethod
    def next_due(self, shard: int) -> dt.datetime | None:
        """The earliest staged due time, or ``None`` when empty."""

    @abc.abstractmethod
    def remove(self, shard: int, ids: Iterable[uuid.UUID]) -> int:
        """Unstage ``ids`` (cancelled jobs); return how many were staged."""

    @abc.abstractmethod
    def size(self, shard: int) -> int:
        """How many ids are staged."""

    def drop_legacy(self, shard: int) -> int:
        """Retire ``shard``'s staging set of clients and leaders before hash
        tags: stage its ids in the current set (an id staged there already
        keeps its score), then remove them from the old one; return how many
        job ids it held. For a leader, once no old beat runs. A backend
        without such a set (the in-memory fake) has nothing to retire."""
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PublishResult:
    """Outcome of one batch publish: every job id appears in exactly one field.

    - ``sent``: published.
    - ``failed``: not published because the broker is unavailable (connection
      level, after retries); the job itself is fine.
    - ``rejected``: job id -> why its own message (or its queue) could not be
      published; retrying at once would fail the same way.
    - ``expired``: expired at ``now``, not sent.
    - ``withheld``: not attempted because ``may_publish`` said no (the
      lease is gone): the caller releases them, fenced by the claim's epoch.
    """

    sent: list[uuid.UUID] = dataclasses.field(default_factory=list)
    failed: list[uuid.UUID] = dataclasses.field(default_factory=list)
    expired: list[uuid.UUID] = dataclasses.field(default_factory=list)
    rejected: dict[uuid.UUID, str] = dataclasses.field(default_factory=dict)
    withheld: list[uuid.UUID] = dataclasses.field(default_factory=list)


class Dispatcher(abc.ABC):
    """Publishes claimed jobs as Celery protocol-2 messages (Kombu).

    Broker failures are retried with backoff inside; what still failed is
    reported in the :class:`PublishResult`, never raised mid-batch.
    """

    @abc.abstractmethod
    def publish(
        self,
        jobs: Sequence[Job],
        *,
        epoch: int,
        now: dt.datetime,
        may_publish: Callable[[], bool] | None = None,
    ) -> PublishResult:
        """Publish ``jobs``; every job is reported exactly once in the result.

        Jobs already expired at ``now`` (``expires_at <= now``) are judged
        before any broker I/O and reported ``expired``, never sent, whatever
        the broker or ``may_publish`` does. ``may_publish`` is asked before
        every chunk goes to the broker (a stale leader must not publish);
        once it answers ``False`` the jobs not yet sent are reported
        ``withheld``. A job its destination refuses is ``rejected`` with the
        reason; jobs the broker could not take after the retries are
        ``failed``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the broker connection; idempotent.

        Not final: a later :meth:`publish` connects again (the leader closes
        its dispatcher when it steps down and publishes again if re-elected).
        """


OptionMap = Mapping[str, object]


class Ledger(abc.ABC):
    """The idempotency ledger of :class:`celery_sched.Task` (the ``ledger`` table).

    One row per idempotency key. Before running a task a worker *acquires*
    its key under a lease (seconds by the store's clock, renewed while the
    task runs); afterwards it *completes* the key (success) or *releases* it
    (failure, so that a retry can run). Owner tokens are unique per
    execution: every change names its owner and does nothing once another
    owner has taken the key over. Every method is one transaction unless it
    says otherwise; unreachable backends raise
    :class:`~celery_sched.errors.StoreUnavailable` after bounded retries.
    """

    @abc.abstractmethod
    def acquire(
        self,
        key: str,
        *,
        owner: str,
        lease: float,
        job_id: uuid.UUID | None = None,
        attempt: int | None = None,
        take_completed: bool = False,
        due_at: dt.datetime | None = None,
    ) -> LedgerClaim:
        """Take ``key`` for ``owner`` unless it is completed or held under a live lease.

        Atomic: of racing callers exactly one acquires. A new key, or a
        running key whose lease has expired (its holder died), is
        ``ACQUIRED`` with ``attempts`` counting every take. A completed key
        is ``COMPLETED`` with its recorded result; a key held under a live
        lease is ``HELD`` with its holder and the seconds until that lease
        expires. A key this very owner already holds (a retry after a lost
        reply) is ``ACQUIRED`` again. One round trip when the key is new or
        expired.

        The delivery fence: when the job row ``job_id`` exists and
        :func:`~celery_sched.models.delivery_fence` refuses this delivery
        (the job is cancelled, dead, expired or succeeded, or its attempt is
        newer than ``attempt``), nothing is taken and the answer is
        ``FENCED`` with the reason; the row is read in the same statement.
        A missing job row does not fence (the delivery runs). A delivery of
        an older attempt while the row is pending or dispatched (nobody has
        started the job since it was requeued) is not refused but adopted,
        as :meth:`check_delivery` does, in the same statement:
        ``ACQUIRED`` with ``adopted`` set. ``due_at``: the job's due time
        from the message (see :meth:`check_delivery`); a row due at another
        time is not found (the ledger still keeps one completed execution
        per key).

        ``take_completed``: a completed key whose recorded job id is set and
        differs from ``job_id`` belongs to an earlier job that used the same
        key; it is taken over as if new (``attempts`` 1, result cleared) and
        ``ACQUIRED``. Used when the key is the job key, not an explicit
        idempotency key.
        """

    @abc.abstractmethod
    def check_delivery(
        self, job_id: uuid.UUID, attempt: int | None, *, due_at: dt.datetime | None = None
    ) -> DeliveryCheck:
        """Whether a delivery of ``job_id`` at ``attempt`` may run (the fence
        of :meth:`acquire`, for deliveries that take no ledger key).

        Refused (``reason`` set) when :func:`~celery_sched.models.delivery_fence`
        says so; allowed when the job row is missing. One exception, the
        adoption: a delivery of an older attempt while the row is
        ``pending`` or ``dispatched`` (it was requeued because the queue was
        slower than its visibility timeout, and no copy has started since)
        takes the job over: atomically, only if the row still has the
        attempt read, the row becomes ``running`` at ``attempt + 1`` with
        no worker (the start report of the process that runs it names it)
        and the answer's ``adopted`` is that attempt, which the delivery
        runs as. Of racing older copies exactly one adopts; the others, and
        every later copy, are refused. One statement on one
        job row by primary key, tried once: an unreachable backend raises
        :class:`~celery_sched.errors.StoreUnavailable` at once (the caller
        decides to run the delivery).

        ``due_at``: the job's due time from the message (its
        ``celery_sched_due`` header). No row due then (a requeue by hand made
        the job due again since), or no ``due_at`` (a message without the
        header), and the row is looked for among the jobs due by
        :data:`~celery_sched.models.SENT_DUE_MARGIN` from now; found at
        another due time, the answer's ``due_at`` is the row's."""

    @abc.abstractmethod
    def renew(self, held: Sequence[tuple[str, str]], *, lease: float) -> set[str]:
        """Extend to ``now + lease`` the lease of every ``(key, owner)`` pair whose
        key that owner still holds running; return the keys renewed (a key
        missing from the answer was taken over or is gone). One statement."""

    @abc.abstractmethod
    def complete(
        self,
        key: str,
        *,
        owner: str,
        result: str | None = None,
        job_id: uuid.UUID | None = None,
    ) -> bool:
        """Mark ``key`` completed by ``owner`` and record ``result`` (JSON text;
        ``None`` records nothing). False, changing nothing, if another owner
        holds the key. A missing key (its take was lost, e.g. an
        asynchronous commit forgotten by a database crash) is created
        completed for ``owner`` with ``job_id``; the entry keeps the job id
        it was taken for. Repeating it for the same owner only updates the
        result (``completed_at`` keeps its first value). One statement."""

    @abc.abstractmethod
    def release(self, key: str, *, owner: str) -> bool:
        """Forget ``key`` while ``owner`` holds it running, so a retry can
        acquire it; a completed key stays completed. True if it was released."""

    @abc.abstractmethod
    def transaction(
        self, key: str, *, owner: str, job_id: uuid.UUID | None = None
    ) -> AbstractContextManager[Any]:
        """A database transaction that completes ``key`` for ``owner`` when it commits.

        Yields the connection the caller's statements run on (a SQLAlchemy
        ``Connection`` for PostgreSQL). Leaving the block normally completes
        the key (no result recorded) and commits both together; an exception
        rolls everything back and propagates. A missing key is re-taken and
        completed for ``owner`` in the same transaction (as :meth:`complete`
        does). Only if another owner holds the key at commit is everything
        rolled back and :class:`~celery_sched.errors.LedgerConflict` raised.
        """

    @abc.abstractmethod
    def get(self, key: str) -> LedgerEntry | None:
        """The entry of ``key``, or ``None``."""

    @abc.abstractmethod
    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        """Delete completed entries whose ``completed_at`` is more than
        ``older_than`` seconds ago, then running entries whose lease expired
        that long ago (their holder died and no retry came), ``batch`` rows per
        transaction and at most ``max_batches`` transactions; return the total."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections the ledger opened itself."""
