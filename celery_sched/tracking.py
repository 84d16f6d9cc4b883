"""Job status from workers, through Celery signals.

``install(app)`` (call it in the module that defines the Celery app, so worker
processes run it) connects handlers that move a job to ``running`` when a
worker starts it and to ``succeeded`` / ``failed`` / ``retrying`` when it ends.
They act only on messages that carry celery_sched's headers, so plain Celery
tasks sent by other means are untouched. This is what keeps the reconciler
from requeueing work that a worker has taken.

A status write that fails is logged and dropped, never raised into the task:
the worst outcome is a job that looks untaken and is requeued, which the
idempotency ledger (``celery_sched.Task``) turns into no second execution.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from celery import signals

from celery_sched.errors import CelerySchedError
from celery_sched.models import JobStatus

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore

logger = logging.getLogger(__name__)

KEY_HEADER = "celery_sched_key"

_stores: weakref.WeakKeyDictionary[Any, JobStore] = weakref.WeakKeyDictionary()
_installed: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


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
    if getattr(task.request, KEY_HEADER, None) is None:
        return None
    try:
        return uuid.UUID(task_id)
    except ValueError:
        return None


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    job_id = _job_id(task, task_id)
    if job_id is None:
        return
    try:
        store_for(task.app).mark_running(job_id, worker=str(task.request.hostname or ""))
    except CelerySchedError as exc:
        logger.warning("could not mark job %s running: %s", job_id, exc)


def _on_postrun(
    sender: Any = None,
    task_id: str | None = None,
    task: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    job_id = _job_id(task, task_id)
    if job_id is None:
        return
    store = store_for(task.app)
    try:
        if state == "SUCCESS":
            store.mark_finished(job_id, JobStatus.SUCCEEDED)
        elif state == "RETRY":
            store.mark_retrying(job_id, error=_describe(retval))
        elif state in ("FAILURE", "REJECTED"):
            store.mark_finished(job_id, JobStatus.FAILED, error=_describe(retval))
    except CelerySchedError as exc:
        logger.warning("could not record %s for job %s: %s", state, job_id, exc)


def _describe(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"[:2000]
    return repr(value)[:2000]
