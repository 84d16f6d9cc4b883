"""Frozen value objects shared by every part. No I/O here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from collections.abc import Mapping
from typing import Any

from celery_sched.timeutil import UTC, ensure_utc, to_bucket


class JobStatus(enum.StrEnum):
    """Where a job is in its life. Stored as text in ``jobs.status``."""

    PENDING = "pending"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.DEAD,
        JobStatus.CANCELLED,
        JobStatus.EXPIRED,
    }
)

#: Per-job message options accepted by ``Client.schedule`` and kept in
#: ``jobs.options``; everything else is refused with ``UnknownOption``.
MESSAGE_OPTIONS = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "priority",
        "headers",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
    }
)


def _check_aware(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        # Already UTC is the common case on hot paths (bulk scheduling, claims).
        if value is not None and value.tzinfo is not UTC:
            object.__setattr__(obj, name, ensure_utc(value, name=name))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NewJob:
    """A validated job ready to be written: the body is already serialized.

    ``body`` is the Celery protocol-2 body ``[args, kwargs, embed]`` encoded
    with the app's task serializer, so dispatch publishes it unchanged.
    """

    id: uuid.UUID
    key: str
    task: str
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    due_at: dt.datetime
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    expires_at: dt.datetime | None = None
    max_attempts: int = 5
    shard: int = 0
    schedule_id: int | None = None
    visibility_timeout: float | None = None
    max_runtime: float | None = None

    def __post_init__(self) -> None:
        _check_aware(self, "due_at", "expires_at")
        if not self.key:
            raise ValueError("job key must not be empty")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")

    @property
    def due_bucket(self) -> int:
        return to_bucket(self.due_at)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A job as stored. ``id`` is also the Celery task id."""

    id: uuid.UUID
    key: str
    task: str
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    due_at: dt.datetime
    due_bucket: int
    status: JobStatus
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    expires_at: dt.datetime | None = None
    attempt: int = 0
    max_attempts: int = 5
    shard: int = 0
    schedule_id: int | None = None
    leader_epoch: int | None = None
    visibility_timeout: float | None = None
    max_runtime: float | None = None
    created_at: dt.datetime | None = None
    dispatched_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    worker: str | None = None
    last_error: str | None = None

    def __post_init__(self) -> None:
        _check_aware(
            self,
            "due_at",
            "expires_at",
            "created_at",
            "dispatched_at",
            "started_at",
            "finished_at",
        )
        object.__setattr__(self, "status", JobStatus(self.status))

    def decode(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return ``(args, kwargs)`` decoded from the stored body."""
        from kombu.serialization import loads

        args, kwargs, _embed = loads(
            self.body, self.content_type, self.content_encoding, accept=None
        )
        return tuple(args), dict(kwargs)

    @property
    def args(self) -> tuple[Any, ...]:
        return self.decode()[0]

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.decode()[1]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """A held leader lease for one shard.

    ``valid_until`` is a ``time.monotonic()`` deadline taken *before* the
    SET was sent, minus a safety margin: past it the holder must stop
    claiming even if no renewal has failed yet.
    """

    shard: int
    token: str
    epoch: int
    valid_until: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileResult:
    """What one reconciler pass moved."""

    requeued: int = 0
    dead: int = 0
    timed_out: int = 0
