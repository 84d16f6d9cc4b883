"""Job status from workers, through Celery signals, and their heartbeats.

``install(app)`` (call it in the module that defines the Celery app, so worker
processes run it) connects handlers that move a job to ``running`` when a
worker starts it and to ``succeeded`` / ``failed`` / ``retrying`` when it ends.
They act only on messages that carry celery_sched's headers, so plain Celery
tasks sent by other means are untouched. This is what keeps the reconciler
from requeueing work that a worker has taken. A ``retrying`` report says
when the retry's message is due (``WorkerUpdate.retry_in``): the reconciler
requeues a retry that has not started a visibility timeout after that (its
message was lost with the broker).

Status writes must not throttle workers, so handlers only enqueue: one
background thread per worker process applies the queued reports in a single
transaction every ``FLUSH_INTERVAL`` seconds (at once after a ``retrying``
report, or as soon as ``FLUSH_SIZE`` are waiting). Reports are never raised
into the task, and their text is cleaned when they are made
(:func:`celery_sched.models.clean_text`). While
PostgreSQL is unreachable they are kept (up to ``MAX_HELD``) and written once
it is back, so an outage shorter than the visibility timeout makes the
reconciler requeue nothing. A batch the store refuses for another reason is
written in halves until the one report it refuses is found and dropped; the
thread survives anything a write raises, and :func:`writer_for` replaces a
writer whose thread is gone.

The same thread keeps the process's heartbeat (``workers`` row keyed by
hostname and pid, every ``HEARTBEAT_INTERVAL`` seconds) once the process has
started a job; ``running`` reports carry the pid. A report that is lost (the
oldest beyond ``MAX_HELD``, the last ones when the process is killed, one
the store refuses) leaves its job ``running`` with a process that no longer
beats: the leader's rescuer requeues it after ``celery_sched_worker_timeout``
(or marks it ``succeeded`` when the idempotency ledger records that the job
completed), so the job runs again unless it was a ``celery_sched.Task`` that
finished. When a prefork child dies mid-task, the worker's main process
reports the lost job at once (``WorkerLostError``) and it is requeued
without waiting for the heartbeat to go stale.
"""

from __future__ import annotations

import atexit
import collections
import datetime as dt
import logging
import math
import numbers
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from billiard.exceptions import WorkerLostError
from celery import signals
from celery.utils.time import maybe_iso8601

from celery_sched import backends, fence
from celery_sched.errors import SchemaMissing, StoreUnavailable
from celery_sched.metrics import worker as worker_metrics
from celery_sched.models import REPORT_RETRY_IN_LIMIT, JobStatus, WorkerUpdate
from celery_sched.protocol import request_attempt, request_due, request_job_id

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore

logger = logging.getLogger(__name__)


def install(app: Any, store: JobStore | None = None) -> None:
    """Track the status of celery_sched jobs executed by ``app``'s workers.

    Idempotent. ``store`` is for tests; by default the store is built from
    the app's settings on first use (:class:`celery_sched.backends.WorkerSide`).
    """
    if not backends.worker_side(app).install(__name__, store=store):
        return
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)
    # Workers skip deliveries whose job moved on (celery_sched.fence).
    fence.install(app)
    signals.task_failure.connect(_on_failure, weak=False)
    signals.worker_init.connect(_on_worker_init, weak=False)
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.worker_process_shutdown.connect(flush_all, weak=False)
    signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
    signals.worker_shutdown.connect(flush_all, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
    atexit.register(flush_all)


#: Longest a status report waits before it is written.
FLUSH_INTERVAL = 0.05
#: Reports that trigger an early flush.
FLUSH_SIZE = 500
#: Reports kept through a database outage; beyond it the oldest are dropped.
MAX_HELD = 20_000
#: Pause before the next write once one failed (the store has already
#: retried the write itself).
RETRY_INTERVAL = 1.0
#: Seconds between heartbeats of a worker process; well below the default
#: ``celery_sched_worker_timeout`` (180 s) so that a few lost beats (a
#: database blip) never make a live process look dead.
HEARTBEAT_INTERVAL = 5.0


class StatusWriter:
    """Batches workers' status reports into one store call per flush, and
    keeps the process's heartbeat.

    Owned by one process: after a fork the child builds its own (the thread
    does not survive a fork). ``pending`` / ``hostnames``: what a writer
    whose thread died hands over to its replacement.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        interval: float = FLUSH_INTERVAL,
        retry_interval: float = RETRY_INTERVAL,
        max_held: int = MAX_HELD,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        pending: Iterable[WorkerUpdate] = (),
        hostnames: dict[str, bool] | None = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        self.store = store
        self.pid = os.getpid()
        #: The tasks whose jobs this process tracks, sent with every beat
        #: (``None``: every task); the reconciler requeues only those.
        self.tasks = None if tasks is None else sorted(tasks)
        self._interval = interval
        self._retry_interval = retry_interval
        self._max_held = max_held
        self._heartbeat_interval = heartbeat_interval
        self._pending: list[WorkerUpdate] = list(pending)
        # Host names this process ran jobs under -> whether a beat of this
        # process has reached the store (its first beat resets started_at).
        self._hostnames: dict[str, bool] = dict(hostnames or {})
        self._next_beat = 0.0
        self._beat_failing = False
        self._cond = threading.Condition()
        self._closed = False
        self._failing = False
        # A retrying report waits: write at once.
        self._urgent = False
        self._thread = threading.Thread(target=self._run, name="celery_sched-status", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread is running (it ends only when closed)."""
        return self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def handover(self) -> tuple[list[WorkerUpdate], dict[str, bool]]:
        """Take what a replacement writer needs: the unwritten reports and the hosts."""
        with self._cond:
            pending, self._pending = self._pending, []
            return pending, dict(self._hostnames)

    def watch(self, hostname: str) -> None:
        """Beat for ``hostname`` from now on (a worker that just started, so
        that the reconciler knows its tasks are tracked before any job ran)."""
        with self._cond:
            if hostname and hostname not in self._hostnames:
                self._hostnames[hostname] = False
                self._next_beat = 0.0
                self._cond.notify()

    def report(self, update: WorkerUpdate) -> None:
        with self._cond:
            self._pending.append(update)
            if (
                update.status == JobStatus.RUNNING
                and update.worker
                and update.worker_pid == self.pid
                and update.worker not in self._hostnames
            ):
                # A job started here: the process beats from now on, and
                # before this report is written.
                self._hostnames[update.worker] = False
                self._next_beat = 0.0
                self._cond.notify()
            # A retry's message is already sent, and another process may
            # start it within milliseconds: its start report is refused
            # unless the job is retrying by then, and the row would say
            # retrying while the retry runs (requeued a visibility timeout
            # after its ETA). So a retrying report does not wait the interval.
            elif update.status == JobStatus.RETRYING and not self._failing:
                self._urgent = True
                self._cond.notify()
            # While the store is unavailable the thread waits out its retry
            # interval; a full batch does not cut that short.
            elif len(self._pending) >= FLUSH_SIZE and not self._failing:
                self._cond.notify()

    def flush(self, *, final: bool = False) -> bool:
        """Write everything reported so far (called by the thread and at exit).

        Returns False when the store was unavailable: the reports not written
        are then kept, ahead of newer reports, for the next flush (unless
        ``final``). A report the store refuses is logged and dropped alone.
        """
        with self._cond:
            batch, self._pending = self._pending, []
            self._urgent = False
        if not batch:
            return True
        chunks = collections.deque([batch])
        while chunks:
            chunk = chunks.popleft()
            try:
                self.store.apply_worker_updates(chunk)
            except StoreUnavailable as exc:
                unwritten = [update for part in (chunk, *chunks) for update in part]
                if final:
                    logger.warning(
                        "could not record %d job status reports: %s", len(unwritten), exc
                    )
                else:
                    self._hold(unwritten, exc)
                return False
            except SchemaMissing as exc:
                # Every report would fail alike: no point in looking for one.
                logger.warning("could not record %d job status reports: %s", len(chunk), exc)
            except Exception as exc:
                # The store refused something in the batch (or a bug broke
                # the write): one bad report must not cost the others, so
                # write the batch in halves until the refused one is alone.
                if len(chunk) == 1:
                    logger.error(
                        "dropped a job status report the store refuses (%s: %s): %r",
                        type(exc).__name__,
                        exc,
                        chunk[0],
                    )
                    continue
                if chunk is batch:
                    logger.warning(
                        "could not record %d job status reports (%s: %s); "
                        "writing them in parts to drop only what is refused",
                        len(chunk),
                        type(exc).__name__,
                        exc,
                    )
                middle = len(chunk) // 2
                chunks.appendleft(chunk[middle:])
                chunks.appendleft(chunk[:middle])
        return True

    def _hold(self, unwritten: list[WorkerUpdate], exc: Exception) -> None:
        with self._cond:
            held = unwritten + self._pending
            dropped = len(held) - self._max_held
            if dropped > 0:
                del held[:dropped]
            self._pending = held
        logger.warning(
            "could not record %d job status reports, keeping them for the next try: %s",
            len(unwritten),
            exc,
        )
        if dropped > 0:
            logger.error(
                "dropped the %d oldest job status reports (more than %d waiting); "
                "the rescuer requeues those jobs once this process stops beating",
                dropped,
                self._max_held,
            )

    def beat(self) -> bool:
        """Refresh this process's heartbeat rows; False if the store refused."""
        with self._cond:
            hostnames = dict(self._hostnames)
        ok = True
        for hostname, reached in hostnames.items():
            try:
                self.store.heartbeat(hostname, self.pid, first=not reached, tasks=self.tasks)
            except Exception as exc:
                if not self._beat_failing:
                    logger.warning(
                        "could not record the heartbeat of %s pid %d: %s: %s",
                        hostname,
                        self.pid,
                        type(exc).__name__,
                        exc,
                    )
                ok = False
                continue
            with self._cond:
                self._hostnames[hostname] = True
        self._beat_failing = not ok
        return ok

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self.flush(final=True)

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    if not self._closed:
                        wait = self._interval
                        if self._failing:
                            wait = self._retry_interval
                        elif len(self._pending) >= FLUSH_SIZE or self._urgent:
                            wait = 0.0
                        if self._hostnames:
                            wait = min(wait, self._next_beat - time.monotonic())
                        if wait > 0:
                            self._cond.wait(wait)
                    closed = self._closed
                    beat_due = bool(self._hostnames) and time.monotonic() >= self._next_beat
                if closed:
                    return
                if beat_due:
                    # Before the reports: a job's start is then never
                    # recorded ahead of its process's first beat.
                    beaten = self.beat()
                    delay = self._heartbeat_interval if beaten else self._retry_interval
                    with self._cond:
                        self._next_beat = time.monotonic() + delay
                ok = self.flush()
                with self._cond:
                    self._failing = not ok
                    held = len(self._pending)
                worker_metrics.reports_held(held)
            except Exception:
                # Nothing may end this thread: every later report of the
                # process would queue for ever.
                logger.exception("job status writer: unexpected error; going on")
                with self._cond:
                    self._failing = True


def writer_for(app: Any) -> StatusWriter:
    """This process's status writer for ``app``, started on first use and
    replaced (taking over its unwritten reports) if its thread is gone."""
    side = backends.worker_side(app)

    def build() -> StatusWriter:
        return StatusWriter(side.store, tasks=tracked_tasks(app))

    writer = side.part(StatusWriter, build, keep=True)
    if writer.alive:
        return writer
    with side.lock:
        writer = side.part(StatusWriter, build, keep=True)
        if not writer.alive:
            if not writer.closed:
                logger.error("the job status writer thread of this process ended; replacing it")
            pending, hostnames = writer.handover()
            writer = StatusWriter(
                side.store, pending=pending, hostnames=hostnames, tasks=writer.tasks
            )
            side.replace_part(StatusWriter, writer)
        return writer


def tracked_tasks(app: Any) -> list[str]:
    """The names of ``app``'s tasks whose jobs its workers track (Celery's
    own ``celery.*`` tasks are never celery_sched jobs)."""
    return sorted(name for name in app.tasks if not name.startswith("celery."))


def _installed_app(sender: Any) -> Any:
    """The app of a worker signal's sender, if it installed tracking."""
    app = getattr(sender, "app", None)
    if app is None or __name__ not in backends.worker_side(app).installed:
        return None
    return app


def _metrics_port(app: Any) -> int:
    try:
        return backends.worker_side(app).settings.worker_metrics_port
    except Exception:
        logger.exception("celery_sched: cannot read the settings; no worker metrics")
        return 0


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    # Before the pool forks: its processes count into the same directory.
    app = _installed_app(sender)
    if app is not None:
        worker_metrics.setup(_metrics_port(app))


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    # The worker's main process beats from its start, listing the tracked
    # tasks, so the reconciler requeues their lost messages even before any
    # job ran here.
    app = _installed_app(sender)
    hostname = getattr(sender, "hostname", None)
    if app is None:
        return
    worker_metrics.serve(_metrics_port(app))
    if hostname:
        writer_for(app).watch(str(hostname))


def _on_process_shutdown(**_: Any) -> None:
    worker_metrics.process_exiting()


def _on_worker_shutdown(**_: Any) -> None:
    worker_metrics.shutdown()


def flush_all(**_: Any) -> None:
    """Write every queued report of this process (worker shutdown, tests);
    nothing later would write what fails now."""
    for side in backends.worker_sides():
        writer = side.built(StatusWriter)
        if writer is not None and writer.pid == os.getpid():
            writer.flush(final=True)


def _job_id(task: Any, task_id: str | None) -> uuid.UUID | None:
    """The job a signal is about: only for apps that installed tracking, and
    only messages of celery_sched jobs."""
    if task is None or task_id is None or __name__ not in backends.worker_side(task.app).installed:
        return None
    return request_job_id(task.request, task_id)


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    # A task behind the delivery fence reports its start once the fence
    # let it pass (celery_sched.fence.FencedRun), as the attempt it runs as.
    if not fence.fenced_run(task):
        report_running(task, task_id)


def report_running(task: Any, task_id: str | None) -> None:
    """Report that ``task`` (its current request) started the job ``task_id``
    (also after a delivery took its job over as a new attempt)."""
    job_id = _job_id(task, task_id)
    if job_id is not None:
        worker = str(task.request.hostname or "")
        writer_for(task.app).report(
            # With the attempt: the store ignores the start of a stale delivery.
            WorkerUpdate(
                job_id=job_id,
                status=JobStatus.RUNNING,
                worker=worker,
                worker_pid=os.getpid(),
                attempt=request_attempt(task.request),
                due_at=request_due(task.request),
            )
        )


def _on_failure(
    sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
) -> None:
    # Only a lost process matters here (the task's own failures arrive
    # through task_postrun). Celery's main process sends it, with the
    # delivery's request pushed, when a prefork child died mid-task; the
    # message may already be acknowledged, so nothing would run the job
    # again without this.
    if not isinstance(exception, WorkerLostError):
        return
    job_id = _job_id(sender, task_id)
    if job_id is None:
        return
    writer_for(sender.app).report(
        WorkerUpdate(
            job_id=job_id,
            status=JobStatus.PENDING,
            error=f"its worker process was lost: {_describe(exception)}",
            attempt=request_attempt(sender.request),
            due_at=request_due(sender.request),
        )
    )


_POSTRUN_STATUS = {
    "SUCCESS": JobStatus.SUCCEEDED,
    "RETRY": JobStatus.RETRYING,
    "FAILURE": JobStatus.FAILED,
    "REJECTED": JobStatus.FAILED,
}


def _on_postrun(
    sender: Any = None,
    task_id: str | None = None,
    task: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    job_id = _job_id(task, task_id)
    status = _POSTRUN_STATUS.get(state or "")
    if job_id is None or status is None:
        return
    error = None if status == JobStatus.SUCCEEDED else _describe(retval)
    # On RETRY, retval is the celery.exceptions.Retry the task raised: its
    # message is already sent, due at retval.when.
    retry_in = _retry_in(retval) if status == JobStatus.RETRYING else None
    writer_for(task.app).report(
        WorkerUpdate(
            job_id=job_id,
            status=status,
            error=error,
            retry_in=retry_in,
            due_at=request_due(task.request),
        )
    )


def _retry_in(retry: Any) -> float | None:
    """Seconds from now until a Celery retry's message is due, ``None`` if unknown.

    ``Task.retry`` sets ``when`` to its ``eta`` (a datetime, or an ISO 8601
    string, which Celery also sends) or else its ``countdown`` (seconds); a
    naive ETA is UTC, as the worker reads it. An ETA is compared with this
    host's clock, as the worker that holds the message will; a past ETA
    means now.
    """
    when = getattr(retry, "when", None)
    try:
        if isinstance(when, str):
            when = maybe_iso8601(when)
        if isinstance(when, dt.datetime):
            due = when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)
            seconds = (due - dt.datetime.now(dt.UTC)).total_seconds()
        elif isinstance(when, numbers.Real) and not isinstance(when, bool):
            seconds = float(when)
        else:
            return None
    except (TypeError, ValueError, OverflowError):
        return None
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), REPORT_RETRY_IN_LIMIT)


def _describe(value: Any) -> str | None:
    if value is None:
        return None
    try:
        if isinstance(value, BaseException):
            return f"{type(value).__name__}: {value}"
        return repr(value)
    except Exception:  # a broken __str__ must not cost the report
        return type(value).__name__
