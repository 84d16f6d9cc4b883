"""The idempotency ledger of :class:`celery_sched.Task`: keys, claims and the
worker-side fence."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from typing import Any

from celery_sched.models.checks import check_aware
from celery_sched.models.jobs import JobStatus


class LedgerState(enum.StrEnum):
    """State of an idempotency key in ``ledger.state``."""

    RUNNING = "running"  # a worker holds the key under a lease
    COMPLETED = "completed"  # an execution finished; duplicates must not run


class ClaimOutcome(enum.StrEnum):
    """What a worker may do with a key it tried to take."""

    ACQUIRED = "acquired"  # run the task (a new key, or taken over from a dead holder)
    COMPLETED = "completed"  # do not run: return the recorded result
    HELD = "held"  # do not run now: another live worker holds the key
    FENCED = "fenced"  # never run this delivery: its job moved on (see delivery_fence)


#: Job statuses whose deliveries a worker does not run: the job was
#: cancelled, given up on, expired, dropped by its misfire policy, or
#: already succeeded.
FENCED_STATUSES = frozenset(
    {JobStatus.CANCELLED, JobStatus.DEAD, JobStatus.EXPIRED, JobStatus.MISSED, JobStatus.SUCCEEDED}
)


#: Job statuses in which nobody has started the job's current attempt: a
#: delivery of an older attempt may take the job over (see
#: :class:`DeliveryCheck`) instead of being refused.
ADOPTABLE_STATUSES = frozenset({JobStatus.PENDING, JobStatus.DISPATCHED})


def delivery_fence(status: JobStatus | str, job_attempt: int, attempt: int | None) -> str | None:
    """Why a delivery of ``attempt`` must not run, given its job row's
    ``status`` and ``job_attempt``; ``None`` if it may run.

    The one rule of the worker-side fence; the PostgreSQL ledger's acquire
    statement applies the same rule in SQL (the contract suite checks both).
    ``attempt`` ``None`` (a message without the header) is not compared.
    """
    status = JobStatus(status)
    if status in FENCED_STATUSES:
        return f"the job is {status.value}"
    if attempt is not None and job_attempt > attempt:
        return f"attempt {attempt} is older than the job's attempt {job_attempt}"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeliveryCheck:
    """The answer of :meth:`~celery_sched.interfaces.Ledger.check_delivery`.

    ``reason``: why the delivery must not run (:func:`delivery_fence`), or
    ``None`` to run it. ``adopted``: set when the delivery was of an older
    attempt than its job row's while nobody had started the job since (the
    row was pending or dispatched: the queue was slower than the visibility
    timeout, not lost): the delivery then took the job over, the row moved
    to ``running`` at this new attempt (with no worker until the process
    that runs it reports its start), and the delivery runs as it: the later
    copies of the job find it started, at a newer attempt, and are refused.
    ``due_at``: the job row's due time when it is not the one the delivery
    named (a requeue by hand made the job due again after this message was
    sent), so that the delivery's status reports find the row.
    """

    reason: str | None = None
    adopted: int | None = None
    due_at: dt.datetime | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LedgerClaim:
    """The answer of :meth:`~celery_sched.interfaces.Ledger.acquire`.

    ``attempts`` counts how often the key has been taken, this time
    included (above 1: taken over from a holder whose lease expired).
    ``holder`` and ``retry_in`` (seconds until the holder's lease expires, by
    the store's clock) describe a ``HELD`` key; ``result`` (decoded JSON,
    meaningful when ``result_recorded``) and ``completed_at`` a ``COMPLETED`` one;
    ``reason`` (see :func:`delivery_fence`) a ``FENCED`` delivery.
    """

    outcome: ClaimOutcome
    attempts: int = 0
    holder: str | None = None
    retry_in: float = 0.0
    result: Any = None
    result_recorded: bool = False
    completed_at: dt.datetime | None = None
    reason: str | None = None
    #: The attempt a delivery of an older attempt took its job over as (see
    #: :class:`DeliveryCheck`; whatever the outcome for the key), else ``None``.
    adopted: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LedgerEntry:
    """One row of the idempotency ledger, as stored.

    ``result_recorded`` tells a recorded ``None`` (JSON ``null``) from no
    recorded result (the task returned something not JSON-able or too large).
    """

    key: str
    state: LedgerState
    job_id: uuid.UUID | None = None
    owner: str | None = None
    lease_expires_at: dt.datetime | None = None
    attempts: int = 0
    result: Any = None
    result_recorded: bool = False
    created_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None

    def __post_init__(self) -> None:
        check_aware(self, "lease_expires_at", "created_at", "completed_at")
        object.__setattr__(self, "state", LedgerState(self.state))
