"""Frozen value objects shared by every part. No I/O here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import types
import uuid
from collections.abc import Iterable, Mapping, Sequence
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

    def as_row(self) -> NewJobRow:
        """This job as a tuple in :data:`NEW_JOB_ROW` order."""
        return (
            self.id,
            self.key,
            self.task,
            self.body,
            self.content_type,
            self.content_encoding,
            self.argsrepr,
            self.kwargsrepr,
            self.options,
            self.due_at,
            to_bucket(self.due_at),
            self.expires_at,
            self.max_attempts,
            self.shard,
            self.schedule_id,
            self.visibility_timeout,
            self.max_runtime,
        )

    @classmethod
    def from_row(cls, row: NewJobRow) -> NewJob:
        """The job of a :data:`NEW_JOB_ROW` tuple, validated as usual.

        ``due_bucket`` is recomputed from ``due_at``; the options are copied
        so that jobs never share a mutable mapping.
        """
        values = dict(zip(NEW_JOB_ROW, row, strict=True))
        del values["due_bucket"]
        values["options"] = dict(values["options"])
        return cls(**values)


#: The fields of a new job as a plain tuple, in the column order of the bulk
#: load. ``schedule_many`` moves a million of these: building a tuple costs
#: a fraction of a frozen dataclass, and the store writes it unchanged.
#: ``due_bucket`` must equal ``to_bucket(due_at)``; ``options`` is a mapping
#: that nobody mutates (:data:`EMPTY_OPTIONS` when there are none).
NEW_JOB_ROW: tuple[str, ...] = (
    "id",
    "key",
    "task",
    "body",
    "content_type",
    "content_encoding",
    "argsrepr",
    "kwargsrepr",
    "options",
    "due_at",
    "due_bucket",
    "expires_at",
    "max_attempts",
    "shard",
    "schedule_id",
    "visibility_timeout",
    "max_runtime",
)

NewJobRow = tuple[Any, ...]

#: The shared, read-only options of a job row without options.
EMPTY_OPTIONS: Mapping[str, Any] = types.MappingProxyType({})


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


_JOB_FIELDS = tuple(field.name for field in dataclasses.fields(Job))
_JOB_DATETIMES = (
    "due_at",
    "expires_at",
    "created_at",
    "dispatched_at",
    "started_at",
    "finished_at",
)
_STATUS_OF = {status.value: status for status in JobStatus}


class _JobDraft:
    """A mutable object with exactly :class:`Job`'s slot layout.

    Claims turn thousands of rows per second into Jobs. The frozen
    dataclass ``__init__`` sets each of its 26 fields through
    ``object.__setattr__``, which costs more than the database's own work
    per row; filling this twin with plain attribute stores and then
    retyping it as a Job gives the same object for a fraction of that.
    """

    __slots__ = _JOB_FIELDS

    def __init__(
        self,
        id: Any,
        key: Any,
        task: Any,
        body: Any,
        content_type: Any,
        content_encoding: Any,
        argsrepr: Any,
        kwargsrepr: Any,
        due_at: Any,
        due_bucket: Any,
        status: Any,
        options: Any,
        expires_at: Any,
        attempt: Any,
        max_attempts: Any,
        shard: Any,
        schedule_id: Any,
        leader_epoch: Any,
        visibility_timeout: Any,
        max_runtime: Any,
        created_at: Any,
        dispatched_at: Any,
        started_at: Any,
        finished_at: Any,
        worker: Any,
        last_error: Any,
    ) -> None:
        self.id = id
        self.key = key
        self.task = task
        self.body = body
        self.content_type = content_type
        self.content_encoding = content_encoding
        self.argsrepr = argsrepr
        self.kwargsrepr = kwargsrepr
        self.due_at = due_at
        self.due_bucket = due_bucket
        self.status = status
        self.options = options
        self.expires_at = expires_at
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.shard = shard
        self.schedule_id = schedule_id
        self.leader_epoch = leader_epoch
        self.visibility_timeout = visibility_timeout
        self.max_runtime = max_runtime
        self.created_at = created_at
        self.dispatched_at = dispatched_at
        self.started_at = started_at
        self.finished_at = finished_at
        self.worker = worker
        self.last_error = last_error


def jobs_from_rows(names: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from stored rows whose columns are ``names`` (every Job field once).

    Checks what ``Job.__post_init__`` checks: the status is a known
    :class:`JobStatus` and datetimes are aware (converted to UTC).
    """
    if tuple(names) != _JOB_FIELDS:
        if sorted(names) != sorted(_JOB_FIELDS):
            raise ValueError(f"rows must have exactly the Job fields, got {list(names)}")
        order = [list(names).index(name) for name in _JOB_FIELDS]
        rows = ([row[i] for i in order] for row in rows)
    jobs: list[Job] = []
    append = jobs.append
    status_of = _STATUS_OF
    for row in rows:
        draft = _JobDraft(*row)
        status = status_of.get(draft.status)
        draft.status = JobStatus(draft.status) if status is None else status
        for name in _JOB_DATETIMES:
            value = getattr(draft, name)
            if value is not None and value.tzinfo is not UTC:
                setattr(draft, name, ensure_utc(value, name=name))
        draft.__class__ = Job  # type: ignore[assignment]
        append(draft)  # type: ignore[arg-type]
    return jobs


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


#: Statuses a worker reports for a job it runs.
WORKER_STATUSES = frozenset(
    {JobStatus.RUNNING, JobStatus.RETRYING, JobStatus.SUCCEEDED, JobStatus.FAILED}
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerUpdate:
    """One status change reported by a worker, applied later in a batch."""

    job_id: uuid.UUID
    status: JobStatus
    worker: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))
        if self.status not in WORKER_STATUSES:
            raise ValueError(f"a worker cannot report status {self.status.value!r}")
