"""After dispatch: what workers report about the jobs they run, and what a
reconciler pass moved."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

from celery_sched.models.jobs import JobStatus
from celery_sched.timeutil import ensure_utc


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileResult:
    """What one reconciler pass moved."""

    requeued: int = 0
    dead: int = 0
    timed_out: int = 0
    #: Running jobs whose worker process stopped beating (the rescuer):
    #: counted in ``requeued`` / ``dead`` too, except those in ``succeeded``.
    rescued: int = 0
    #: Rescued jobs that the idempotency ledger records as completed by
    #: this very job: marked succeeded instead of requeued.
    succeeded: int = 0
    #: Dispatched jobs no worker tracks (no heartbeat lists their task):
    #: marked ``sent`` instead of requeued.
    untracked: int = 0


#: Statuses a worker reports for a job it runs. ``pending`` is the report of
#: a lost worker process (a prefork child that died mid-task): requeue it.
WORKER_STATUSES = frozenset(
    {
        JobStatus.RUNNING,
        JobStatus.RETRYING,
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.PENDING,
    }
)

#: Longest error text a worker report keeps, in characters.
REPORT_ERROR_LIMIT = 2000
#: Longest worker host name a worker report keeps, in characters.
REPORT_WORKER_LIMIT = 255
#: Longest delay a ``retrying`` report may announce, in seconds (ten years):
#: far enough for any real ETA, near enough that the store's clock plus it
#: stays a valid timestamp.
REPORT_RETRY_IN_LIMIT = 10 * 365 * 86400.0


def clean_text(value: str | None, limit: int) -> str | None:
    """``value`` made storable as PostgreSQL text: NUL characters become
    U+FFFD, lone surrogates (undecodable bytes of a file name, say) ``?``,
    and at most ``limit`` characters are kept."""
    if value is None:
        return None
    if not isinstance(value, str):
        value = str(value)
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    if not value.isascii():
        # UTF-8 cannot encode a lone surrogate: "replace" gives "?" for each.
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value[:limit]


def check_retry_in(value: object) -> float | None:
    """``value`` as the delay of a retrying report (see :class:`WorkerUpdate`);
    ``ValueError`` unless ``None`` or seconds from 0 to ``REPORT_RETRY_IN_LIMIT``."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= REPORT_RETRY_IN_LIMIT
    ):
        raise ValueError(
            f"retry_in must be a number of seconds from 0 to {REPORT_RETRY_IN_LIMIT:g}, "
            f"got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerUpdate:
    """One status change reported by a worker, applied later in a batch.

    Its text is cleaned on construction (:func:`clean_text`), so one odd
    exception message can never make a batch of reports unwritable.
    ``worker_pid`` is the process a ``running`` job runs in (the rescuer
    matches it against that process's heartbeat). A ``pending`` report says
    the process running the job was lost: the job is requeued, only while
    its row is running or dispatched (at ``attempt``, when known).
    ``retry_in`` (``retrying`` reports only) is how many seconds after the
    report the retry message is due (its ETA); ``None`` if unknown (due now).
    """

    job_id: uuid.UUID
    status: JobStatus
    worker: str | None = None
    error: str | None = None
    #: The attempt of the delivery that reports (its ``celery_sched_attempt``
    #: header), ``None`` if unknown (not checked). A ``running`` report of an
    #: attempt older than the row's is not applied: a stale delivery must not
    #: move a requeued job.
    attempt: int | None = None
    worker_pid: int | None = None
    #: The store keeps a retrying job's ``dispatched_at`` at report time plus
    #: this, so the reconciler requeues it once the retry is overdue by the
    #: visibility timeout (its message was lost, say with the broker).
    retry_in: float | None = None
    #: The job's due time (its message's ``celery_sched_due`` header), which
    #: keeps the report to the job's own partition; ``None`` for a message
    #: sent before the header existed (the store then looks the job up
    #: among those due by tomorrow, as before).
    due_at: dt.datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))
        if self.due_at is not None:
            object.__setattr__(self, "due_at", ensure_utc(self.due_at, name="due_at"))
        if self.status not in WORKER_STATUSES:
            raise ValueError(f"a worker cannot report status {self.status.value!r}")
        if self.retry_in is not None and self.status != JobStatus.RETRYING:
            raise ValueError(
                f"retry_in belongs to a retrying report, not a {self.status.value!r} one"
            )
        object.__setattr__(self, "retry_in", check_retry_in(self.retry_in))
        object.__setattr__(self, "worker", clean_text(self.worker, REPORT_WORKER_LIMIT))
        object.__setattr__(self, "error", clean_text(self.error, REPORT_ERROR_LIMIT))
