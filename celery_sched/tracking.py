"""Job status from workers, through Celery signals.

``install(app)`` (call it in the module that defines the Celery app, so worker
processes run it) connects handlers that move a job to ``running`` when a
worker starts it and to ``succeeded`` / ``failed`` / ``retrying`` when it ends.
They act only on messages that carry celery_sched's headers, so plain Celery
tasks sent by other means are untouched. This is what keeps the reconciler
from requeueing work that a worker has taken.

Status writes must not throttle workers, so handlers only enqueue: one
background thread per worker process applies the queued reports in a single
transaction every ``FLUSH_INTERVAL`` seconds (or as soon as ``FLUSH_SIZE``
are waiting). Reports are never raised into the task. While PostgreSQL is
unreachable they are kept (up to ``MAX_HELD``) and written once it is back,
so an outage shorter than the visibility timeout makes the reconciler requeue
nothing. A report that still cannot be written (the oldest beyond
``MAX_HELD``, one the store refuses, or the last ones when the process exits)
is logged and dropped: the worst outcome is a job that looks untaken and is
requeued after its visibility timeout, which the idempotency ledger
(``celery_sched.Task``) turns into no second execution.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from celery import signals

from celery_sched.errors import CelerySchedError, StoreUnavailable
from celery_sched.models import JobStatus, WorkerUpdate

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore

logger = logging.getLogger(__name__)

KEY_HEADER = "celery_sched_key"

_stores: weakref.WeakKeyDictionary[Any, JobStore] = weakref.WeakKeyDictionary()
_installed: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.RLock()


def install(app: Any, store: JobStore | None = None) -> None:
    """Track the status of celery_sched jobs executed by ``app``'s workers.

    Idempotent. ``store`` is for tests; by default each worker process builds
    its own store from the app's settings on first use (after any fork).
    """
    with _lock:
        if store is not None:
            _stores[app] = store
        if app in _installed:
            return
        _installed.add(app)
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)
    signals.worker_process_shutdown.connect(flush_all, weak=False)
    signals.worker_shutdown.connect(flush_all, weak=False)
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


class StatusWriter:
    """Batches workers' status reports into one store call per flush.

    Owned by one process: after a fork the child builds its own (the thread
    does not survive a fork).
    """

    def __init__(
        self,
        store: JobStore,
        *,
        interval: float = FLUSH_INTERVAL,
        retry_interval: float = RETRY_INTERVAL,
        max_held: int = MAX_HELD,
    ) -> None:
        self.store = store
        self.pid = os.getpid()
        self._interval = interval
        self._retry_interval = retry_interval
        self._max_held = max_held
        self._pending: list[WorkerUpdate] = []
        self._cond = threading.Condition()
        self._closed = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="celery_sched-status", daemon=True)
        self._thread.start()

    def report(self, update: WorkerUpdate) -> None:
        with self._cond:
            self._pending.append(update)
            # While the store is unavailable the thread waits out its retry
            # interval; a full batch does not cut that short.
            if len(self._pending) >= FLUSH_SIZE and not self._failing:
                self._cond.notify()

    def flush(self, *, final: bool = False) -> bool:
        """Write everything reported so far (called by the thread and at exit).

        Returns False when the store was unavailable: the batch is then kept,
        ahead of newer reports, for the next flush (unless ``final``).
        """
        with self._cond:
            batch, self._pending = self._pending, []
        if not batch:
            return True
        try:
            self.store.apply_worker_updates(batch)
        except StoreUnavailable as exc:
            if final:
                logger.warning("could not record %d job status reports: %s", len(batch), exc)
                return False
            with self._cond:
                held = batch + self._pending
                dropped = len(held) - self._max_held
                if dropped > 0:
                    del held[:dropped]
                self._pending = held
            logger.warning(
                "could not record %d job status reports, keeping them for the next try: %s",
                len(batch),
                exc,
            )
            if dropped > 0:
                logger.error(
                    "dropped the %d oldest job status reports (more than %d waiting); "
                    "the reconciler requeues those jobs after their visibility timeout",
                    dropped,
                    self._max_held,
                )
            return False
        except CelerySchedError as exc:
            logger.warning("could not record %d job status reports: %s", len(batch), exc)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self.flush(final=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    if self._failing:
                        self._cond.wait(self._retry_interval)
                    elif len(self._pending) < FLUSH_SIZE:
                        self._cond.wait(self._interval)
                closed = self._closed
            if closed:
                return
            ok = self.flush()
            with self._cond:
                self._failing = not ok


_writers: dict[int, StatusWriter] = {}


def writer_for(app: Any) -> StatusWriter:
    """This process's status writer for ``app``, started on first use."""
    with _lock:
        writer = _writers.get(id(app))
        if writer is None or writer.pid != os.getpid():
            writer = _writers[id(app)] = StatusWriter(store_for(app))
        return writer


def flush_all(**_: Any) -> None:
    """Write every queued report of this process (worker shutdown, tests);
    nothing later would write what fails now."""
    for writer in list(_writers.values()):
        if writer.pid == os.getpid():
            writer.flush(final=True)


def store_for(app: Any) -> JobStore:
    """The job store of ``app`` in this process, built on first use."""
    with _lock:
        store = _stores.get(app)
        if store is None:
            from celery_sched.backends import build_store
            from celery_sched.settings import Settings

            store = _stores[app] = build_store(Settings.from_app(app))
        return store


def _job_id(task: Any, task_id: str | None) -> uuid.UUID | None:
    if task is None or task_id is None or task.app not in _installed:
        return None
    request = task.request
    # A worker exposes message headers as request attributes; an eager
    # apply(headers=...) keeps them in request.headers.
    if getattr(request, KEY_HEADER, None) is None and KEY_HEADER not in (
        getattr(request, "headers", None) or {}
    ):
        return None
    try:
        return uuid.UUID(task_id)
    except ValueError:
        return None


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    job_id = _job_id(task, task_id)
    if job_id is not None:
        worker = str(task.request.hostname or "")
        writer_for(task.app).report(
            WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker=worker)
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
    writer_for(task.app).report(WorkerUpdate(job_id=job_id, status=status, error=error))


def _describe(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"[:2000]
    return repr(value)[:2000]
