"""The worker-side delivery fence for plain tasks.

A delivery of a celery_sched job must not run when its job moved on: the
job was cancelled, given up on (``dead``), expired or already succeeded, or
it was requeued since this message was sent (the row's ``attempt`` is newer
than the message's ``celery_sched_attempt`` header); the rule is
:func:`celery_sched.models.delivery_fence`. ``celery_sched.Task`` applies
it inside its ledger acquire. A plain task has no ledger, and Celery
swallows what a ``task_prerun`` handler raises, so the fence wraps the
task's ``run`` (:class:`FencedRun`): in the process that executes the task
(the pool child on prefork, the thread or greenlet on threads and gevent),
just before the task body, one read of the job row by primary key. A
fenced delivery raises :class:`~celery.exceptions.Ignore`: it is
acknowledged and skipped, with no result stored and no status reported (the
``running`` report of a fenced task is sent by the wrapper once the
delivery passed, not by ``task_prerun``), and the job's current delivery
(same task id) is untouched.

Where the check runs (issue #31; ``benchmarks/worker_overhead.py --jobs
5000 --rounds 3``, prefork x2, Redis, on the 2-core machine): it used to
run in the worker request's ``revoked()``, which the worker's *main*
process calls for every message on its consumer loop, the loop that
bounds a prefork worker's rate for short tasks: one blocking read per
message (the adopting statement, planned per call, about 190 us) took
tracking from plain's 3,127/s to 1,249/s (2.5x the time). Options measured:

- check in the pool process (chosen): the read no longer stalls the
  consumer loop; 1,796/s, 1.6x;
- make the read cheap (chosen, with it): a plain read of the row
  (``PostgresLedger.check_delivery``), from the partition that holds the
  delivery's due time, prepared: 190 -> 39 us a check; the adopting
  statement runs only when the row's attempt is newer than the
  delivery's, the one case where it can change anything;
- batch the prefetched window (tried, dropped): the main process gave
  each delivery a ticket in shared memory and the first pool process to
  need a verdict read every undecided row in one statement (about 12 us
  a job for 32 ids). But a prefork pool is handed each message as soon as
  the main process has it, so the window held one or two deliveries and
  the batches were as small as the single reads; a reader thread in the
  main process (batching for 2 ms) halved the rate instead (GIL against
  the consumer loop, 739/s);
- merge the check into a synchronous ``running`` report: a write per
  delivery and two row versions per job instead of the one the batched
  ``ran`` report writes; not taken;
- a set of fenced ids pushed by the store: every transition to a fenced
  status (cancel, requeue, give-up, expiry, another copy's success) would
  have to announce itself, and a missed notice would run a fenced
  delivery; not taken.

With the fence off (``celery_sched_worker_fence``), tracking costs about
1.05x; what remains of the fence's cost is the round trip each task makes
before its body on a machine whose cores the consumer loop, the pool,
PostgreSQL and the broker share.

:func:`install` (called by :func:`celery_sched.tracking.install`) wraps the
``run`` of every task of the app when a worker starts (``worker_init``,
before the pool's processes build their tracers), so tasks registered after
``install`` are covered too. Setting ``celery_sched_worker_fence`` to false
turns it off.

What it does not cover: a worker without tracking installed; a delivery
already running when its job is cancelled (the check is one read at
delivery time); and a delivery that arrives while the database is
unreachable, which runs (at-least-once), as do all deliveries for
:data:`REOPEN_AFTER` seconds after such a failure.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.exceptions import Ignore

from celery_sched import backends
from celery_sched.errors import CelerySchedError
from celery_sched.models import DeliveryCheck
from celery_sched.protocol import (
    ATTEMPT_HEADER,
    DUE_HEADER,
    request_attempt,
    request_due,
    request_job_id,
)

if TYPE_CHECKING:
    from celery_sched.interfaces import Ledger

logger = logging.getLogger(__name__)

#: Seconds deliveries run unchecked after the job store could not be read,
#: so that an outage costs one failed read per period, not one per message.
REOPEN_AFTER = 10.0


class DeliveryFence:
    """Checks the deliveries one process receives against their job rows.

    Fails open: when the row cannot be read the delivery runs, and so do
    all deliveries for ``reopen_after`` seconds (at-least-once wins over
    stalling the worker).
    """

    def __init__(self, ledger: Ledger, *, reopen_after: float = REOPEN_AFTER) -> None:
        self.ledger = ledger
        self.reopen_after = reopen_after
        self._open_until = 0.0

    def check(
        self, job_id: uuid.UUID, attempt: int | None, due_at: dt.datetime | None = None
    ) -> DeliveryCheck:
        """Whether the delivery runs, and as which attempt (see
        :meth:`~celery_sched.interfaces.Ledger.check_delivery`)."""
        if time.monotonic() < self._open_until:
            return DeliveryCheck()
        try:
            return self.ledger.check_delivery(job_id, attempt, due_at=due_at)
        except CelerySchedError as exc:
            self._open_until = time.monotonic() + self.reopen_after
            logger.warning(
                "delivery fence: cannot read job %s (%s); running its delivery, and every "
                "delivery for the next %gs, unchecked",
                job_id,
                exc,
                self.reopen_after,
            )
            return DeliveryCheck()


def fence_for(app: Any) -> DeliveryFence:
    """This process's fence for ``app``, built on first use (after any fork)."""
    side = backends.worker_side(app)
    return side.part(DeliveryFence, lambda: DeliveryFence(side.ledger))


def check_request(task: Any, request: Any) -> str | None:
    """Apply the fence to ``task``'s current delivery ``request``: why it must
    not run, or ``None`` (then its headers name the attempt and due time it
    runs as, for its status reports and retries)."""
    job_id = request_job_id(request, request.id)
    if job_id is None:
        return None
    attempt = request_attempt(request)
    check = fence_for(task.app).check(job_id, attempt, request_due(request))
    if check.due_at is not None:
        # The job was made due again (a requeue by hand) since this message
        # was sent: its status reports must name the row's due time, or
        # they would find no row.
        _set_header(request, DUE_HEADER, check.due_at.isoformat())
    if check.adopted is not None:
        # This copy runs as the job's new attempt: its status reports and
        # retries carry that attempt, and the later copies are fenced.
        logger.info(
            "task %s[%s]: delivery of attempt %s took over the job, nobody had started "
            "it since its requeue; running it as attempt %d",
            task.name,
            request.id,
            attempt,
            check.adopted,
        )
        _set_header(request, ATTEMPT_HEADER, check.adopted)
        return None
    reason = check.reason
    if reason is not None:
        logger.warning(
            "task %s[%s]: not running this delivery (attempt %s): %s",
            task.name,
            request.id,
            "?" if attempt is None else attempt,
            reason,
        )
    return reason


def _set_header(request: Any, name: str, value: Any) -> None:
    # A worker's request has its headers as attributes; an eager apply
    # keeps them in a mapping too (celery_sched.protocol.header).
    setattr(request, name, value)
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        headers[name] = value


class FencedRun:
    """A task's ``run``, behind the delivery fence.

    Reports the delivery's start (:func:`celery_sched.tracking.report_running`)
    once it passed, with the attempt and due time it runs as; a direct call
    (``mytask(...)``) is not checked.
    """

    def __init__(self, task: Any, run: Any) -> None:
        self.task = task
        self.run = run
        self.__wrapped__ = run
        self.__doc__ = getattr(run, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task = self.task
        request = task.request_stack.top
        if request is not None and not request.called_directly:
            reason = check_request(task, request)
            if reason is not None:
                raise Ignore(reason)
            from celery_sched import tracking  # tracking imports this module

            tracking.report_running(task, request.id)
        return self.run(*args, **kwargs)


def fenced_run(task: Any) -> bool:
    """Whether ``task`` runs behind the fence (its start is then reported by
    :class:`FencedRun`, not by ``task_prerun``)."""
    return isinstance(getattr(task, "run", None), FencedRun)


_apply_lock = threading.Lock()


def apply(app: Any) -> int:
    """Put every task of ``app`` behind the fence (unless the
    ``celery_sched_worker_fence`` setting is off); returns how many changed."""
    if not backends.worker_side(app).settings.worker_fence:
        logger.info("delivery fence is off (celery_sched_worker_fence)")
        return 0
    changed = 0
    with _apply_lock:
        for task in list(app.tasks.values()):
            if getattr(task, "fenced_by_ledger", False):
                # A celery_sched.Task: its ledger take applies the same fence
                # in the statement it runs anyway.
                continue
            if task.name.startswith("celery.") or fenced_run(task):
                continue
            # An instance attribute: Celery's tracer calls ``task.run`` (or
            # ``task.__call__``, which calls it) in the process that executes.
            task.run = FencedRun(task, task.run)
            changed += 1
    return changed


def install(app: Any, *, ledger: Ledger | None = None) -> None:
    """Fence deliveries of ``app``'s tasks in every worker started in this process.

    Idempotent. ``ledger`` is for tests (the fence reads job rows through
    :meth:`~celery_sched.interfaces.Ledger.check_delivery`).
    """
    if not backends.worker_side(app).install(__name__, ledger=ledger):
        return

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            apply(app)

    # Before the worker builds its tracers (in each pool process), which
    # take ``task.run``.
    signals.worker_init.connect(on_worker_init, weak=False)
