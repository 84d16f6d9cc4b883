"""Looking through jobs and steering them by hand: a listing's filter and
page position, the outcome of a requeue, and what a shard's leader reports.

Used by the store (:meth:`~celery_sched.interfaces.Jobs.list_jobs`,
:meth:`~celery_sched.interfaces.Jobs.requeue`), the client and the
``sched jobs`` family of commands; the web console reads the same objects.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import uuid
from typing import Any

from celery_sched.errors import InvalidCursor
from celery_sched.models.checks import check_aware
from celery_sched.models.jobs import Job, JobStatus
from celery_sched.timeutil import UTC

#: The statuses a user may requeue: a job given up on (``dead``) or one
#: whose task raised (``failed``). Any other job either still has a
#: delivery coming (pending ... retrying), ran (succeeded), or was stopped
#: on purpose (cancelled, expired, missed, sent).
REQUEUABLE_STATUSES = frozenset({JobStatus.DEAD, JobStatus.FAILED})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MinuteDispatches:
    """The jobs due in one UTC minute that were dispatched, and their mean
    dispatch lag (``dispatched_at - due_at``, never below 0) in seconds."""

    count: int
    mean_lag: float


def dispatch_lag(job: Job) -> float | None:
    """Seconds from ``job``'s due time to its dispatch (0 when sent early),
    ``None`` when it is not dispatched, or waits for a retry (its
    ``dispatched_at`` is then the retry's due time, not a send)."""
    if job.dispatched_at is None or job.status is JobStatus.RETRYING:
        return None
    return max((job.dispatched_at - job.due_at).total_seconds(), 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobQuery:
    """Which jobs a listing shows, and in which order.

    Every field narrows the listing (``statuses`` empty: any status). The
    due range is half-open, ``due_after <= due_at < due_before``, so that
    consecutive windows never share a job. ``key_prefix`` matches the key
    as reads present it (a keyless job's key is its id's text). Order is
    ``(due_at, id)``, soonest first, or newest first with ``newest``.
    """

    statuses: frozenset[JobStatus] = frozenset()
    task: str | None = None
    key_prefix: str | None = None
    due_after: dt.datetime | None = None
    due_before: dt.datetime | None = None
    newest: bool = False

    def __post_init__(self) -> None:
        check_aware(self, "due_after", "due_before")
        object.__setattr__(
            self, "statuses", frozenset(JobStatus(status) for status in self.statuses)
        )
        if self.key_prefix == "":
            object.__setattr__(self, "key_prefix", None)

    def matches(self, job: Job) -> bool:
        """Whether ``job`` passes every filter (the memory store's test, and
        the rule the PostgreSQL statement spells in SQL)."""
        return (
            (not self.statuses or job.status in self.statuses)
            and (self.task is None or job.task == self.task)
            and (self.key_prefix is None or job.key.startswith(self.key_prefix))
            and (self.due_after is None or job.due_at >= self.due_after)
            and (self.due_before is None or job.due_at < self.due_before)
        )

    def beyond(self, job: Job, cursor: PageCursor | None) -> bool:
        """Whether ``job`` comes after ``cursor`` in this query's order."""
        if cursor is None:
            return True
        mark = (job.due_at, job.id.bytes)
        at = (cursor.due_at, cursor.id.bytes)
        return mark < at if self.newest else mark > at


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PageCursor:
    """Where a page of a listing ended: the ``(due_at, id)`` of its last job.

    The next page holds the jobs strictly beyond it in the listing's order
    (keyset paging): a job inserted or finished meanwhile neither shifts
    the pages nor repeats one. :meth:`encode` gives an opaque, shell-safe
    token; :meth:`decode` reads it back or raises :class:`InvalidCursor`.
    """

    due_at: dt.datetime
    id: uuid.UUID

    def __post_init__(self) -> None:
        check_aware(self, "due_at")

    @classmethod
    def of(cls, job: Job) -> PageCursor:
        return cls(due_at=job.due_at, id=job.id)

    def encode(self) -> str:
        micros = round((self.due_at - _EPOCH) / dt.timedelta(microseconds=1))
        raw = micros.to_bytes(8, "big", signed=True) + self.id.bytes
        return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")

    @classmethod
    def decode(cls, token: str) -> PageCursor:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError) as exc:
            raise InvalidCursor(f"cursor {token!r} is not one a job listing printed") from exc
        if len(raw) != 24 or cls._encoded(raw) != token:
            raise InvalidCursor(f"cursor {token!r} is not one a job listing printed")
        micros = int.from_bytes(raw[:8], "big", signed=True)
        try:
            due_at = _EPOCH + dt.timedelta(microseconds=micros)
        except OverflowError as exc:
            raise InvalidCursor(f"cursor {token!r} holds a time out of range") from exc
        return cls(due_at=due_at, id=uuid.UUID(bytes=raw[8:]))

    @staticmethod
    def _encoded(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobPage:
    """One page of a listing; ``next`` is the cursor of the page after it,
    ``None`` on the last page."""

    jobs: list[Job]
    next: PageCursor | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RequeueResult:
    """The outcome of :meth:`~celery_sched.interfaces.Jobs.requeue`, per key given.

    ``requeued``: the jobs as they are now (pending, due now, attempt + 1).
    ``refused``: key -> the status that kept it from being requeued (only
    :data:`REQUEUABLE_STATUSES` are). ``unknown``: keys no job has.
    """

    requeued: list[Job] = dataclasses.field(default_factory=list)
    refused: dict[str, JobStatus] = dataclasses.field(default_factory=dict)
    unknown: list[str] = dataclasses.field(default_factory=list)


def requeued_allowance(attempt: int, max_attempts: int, allowance: int | None) -> int:
    """The ``max_attempts`` of a job requeued by hand from ``attempt``.

    The requeue moves the job to ``attempt + 1`` (so the fence still tells
    every older delivery from the new one) and gives it ``allowance`` more
    dispatches counted from there, by default as many as its
    ``max_attempts`` allowed it from the start.
    """
    extra = max_attempts if allowance is None else allowance
    if extra < 1:
        raise ValueError(f"a requeue must allow at least one attempt, got {extra}")
    return attempt + 1 + extra


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LeaderReport:
    """What a shard's leader writes after a pass: who it is, its epoch, and
    when the pass ended by the store's clock (:attr:`pass_at`)."""

    shard: int
    host: str
    pid: int
    epoch: int
    pass_at: dt.datetime

    def __post_init__(self) -> None:
        check_aware(self, "pass_at")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LeaderView:
    """One shard's leadership as an operator sees it.

    ``holder``: the ``host:pid`` holding the lease now (``None``: free);
    ``ttl``: seconds until that lease expires unless renewed; ``report``:
    the last report written by a leader of the shard, maybe a former one
    (it is kept for a day so a dead leader's last pass stays visible).
    """

    shard: int
    holder: str | None = None
    ttl: float | None = None
    report: LeaderReport | None = None


def job_fields(job: Job) -> dict[str, Any]:
    """Every stored field of ``job`` but its body, JSON-ready (see ``echo_json``)."""
    return {
        "id": str(job.id),
        "key": job.key,
        "task": job.task,
        "status": job.status.value,
        "due_at": job.due_at,
        "due_bucket": job.due_bucket,
        "expires_at": job.expires_at,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "shard": job.shard,
        "schedule_id": job.schedule_id,
        "leader_epoch": job.leader_epoch,
        "visibility_timeout": job.visibility_timeout,
        "max_runtime": job.max_runtime,
        "created_at": job.created_at,
        "dispatched_at": job.dispatched_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "worker": job.worker,
        "worker_pid": job.worker_pid,
        "last_error": job.last_error,
        "argsrepr": job.argsrepr,
        "kwargsrepr": job.kwargsrepr,
        "options": dict(job.options),
        "content_type": job.content_type,
        "content_encoding": job.content_encoding,
        "body_bytes": len(job.body),
    }
