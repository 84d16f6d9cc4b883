"""The worker-side delivery fence for plain tasks.

A delivery of a celery_sched job must not run when its job moved on: the
job was cancelled, given up on (``dead``), expired or already succeeded, or
it was requeued since this message was sent (the row's ``attempt`` is newer
than the message's ``celery_sched_attempt`` header); the rule is
:func:`celery_sched.models.delivery_fence`. ``celery_sched.Task`` applies
it inside its ledger acquire. A plain task has no ledger, and Celery
swallows what a ``task_prerun`` handler raises, so the fence sits where a
stock worker decides whether to run a message at all: the worker request
class (``Task.Request``). Its :meth:`~celery.worker.request.Request.revoked`
check, which the worker's main process runs before it hands a message to
the pool (and again when an ETA comes due), also reads the job row by
primary key; a fenced delivery is acknowledged and skipped, as a revoked
task is, but with no revoked state stored or signalled: nothing reports a
status for it, and the job's current delivery (same task id) is untouched.

:func:`install` (called by :func:`celery_sched.tracking.install`) makes every
task of the app use such a request class when a worker starts
(``worker_init``), so tasks registered after ``install`` are covered too; a
task's own request class is kept, with the fence mixed in. Setting
``celery_sched_worker_fence`` to false turns it off.

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
from celery.utils.imports import symbol_by_name
from celery.worker.state import task_ready

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


class FencedRequest:
    """Mixed into a worker request class: a fenced delivery counts as revoked."""

    def revoked(self) -> bool:
        if super().revoked():  # type: ignore[misc]
            return True
        request: Any = self
        job_id = request_job_id(request, request.id)
        if job_id is None:
            return False
        attempt = request_attempt(request)
        check = fence_for(request.task.app).check(job_id, attempt, request_due(request))
        if check.due_at is not None:
            # The job was made due again (a requeue by hand) since this
            # message was sent: its status reports must name the row's due
            # time, or they would find no row.
            request._request_dict[DUE_HEADER] = check.due_at.isoformat()
        if check.adopted is not None:
            # This copy runs as the job's new attempt: the pool child reads
            # its headers from the request dict, so its status reports and
            # retries carry that attempt, and the later copies are fenced.
            logger.info(
                "task %s[%s]: delivery of attempt %s took over the job, nobody had started "
                "it since its requeue; running it as attempt %d",
                request.name,
                request.id,
                attempt,
                check.adopted,
            )
            request._request_dict[ATTEMPT_HEADER] = check.adopted
            return False
        reason = check.reason
        if reason is None:
            return False
        logger.warning(
            "task %s[%s]: not running this delivery (attempt %s): %s",
            request.name,
            request.id,
            "?" if attempt is None else attempt,
            reason,
        )
        # What Celery's own revoke does, minus the revoked result, event and
        # signal: the job's current delivery has this same task id.
        request._already_revoked = True
        task_ready(request)
        request.acknowledge()
        return True


_fenced_classes: dict[type, type] = {}
_fenced_classes_lock = threading.Lock()


def fenced(base: type) -> type:
    """``base`` (a worker request class) with the delivery fence mixed in."""
    if issubclass(base, FencedRequest):
        return base
    with _fenced_classes_lock:
        cls = _fenced_classes.get(base)
        if cls is None:
            cls = _fenced_classes[base] = type(
                f"Fenced{base.__name__}", (FencedRequest, base), {"__module__": __name__}
            )
        return cls


def apply(app: Any) -> int:
    """Give every task of ``app`` a fenced request class (unless the
    ``celery_sched_worker_fence`` setting is off); returns how many changed."""
    if not backends.worker_side(app).settings.worker_fence:
        logger.info("delivery fence is off (celery_sched_worker_fence)")
        return 0
    changed = 0
    for task in list(app.tasks.values()):
        if getattr(task, "fenced_by_ledger", False):
            # A celery_sched.Task: its ledger take applies the same fence in
            # the statement it runs anyway; a second read here would only
            # cost the worker's main process a round trip per delivery.
            continue
        current = symbol_by_name(task.Request)
        if not issubclass(current, FencedRequest):
            task.Request = fenced(current)
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

    # Before the worker builds its task strategies, which read Task.Request.
    signals.worker_init.connect(on_worker_init, weak=False)
