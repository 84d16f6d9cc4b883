"""Jobs: a new job ready to be written, a job as stored, its status, and the
stored body's decoding."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import types
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_sched.errors import ConfigurationError, UndecodableBody, UntrustedContent
from celery_sched.models.checks import check_aware
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
    #: Published once; no worker tracks its task (``tracking.install``), so
    #: nothing reports whether it ran and it is not sent again (stock beat's
    #: at-most-once). Set by the reconciler a visibility timeout after dispatch.
    SENT = "sent"
    #: An occurrence of a schedule that its misfire policy dropped at its
    #: first dispatch: it was late by more than ``celery_sched_misfire_grace``
    #: and ``skip``, ``once`` (a later occurrence was missed too) or ``all``
    #: (outside the catch-up window or past ``max_catchup``) says it does not
    #: run. Never sent; finished and prunable.
    MISSED = "missed"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


#: How far past now a job a worker reports on (or a leader releases by id)
#: may be due. Such a job was due when it was claimed (a requeue by hand
#: makes it due now), so its due time is at most now and the day is a
#: margin; a report about a job due later is about no job a worker can hold,
#: and is ignored. On PostgreSQL the bound lets each statement by id skip
#: the partitions of later days (issue #17).
SENT_DUE_MARGIN = dt.timedelta(days=1)


def sendable(job: Job, now: dt.datetime) -> bool:
    """Whether ``job`` is due early enough for a worker to hold it (see
    :data:`SENT_DUE_MARGIN`)."""
    return job.due_at <= now + SENT_DUE_MARGIN


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DueSpan:
    """The due times, earliest to latest, of the jobs a transition by id names.

    Whoever names a job by id also knows its due time (the leader holds the
    claimed :class:`Job`, a worker reads its message's ``celery_sched_due``
    header), and the job is looked for only between these bounds: on
    PostgreSQL, whose ``jobs`` table is partitioned by due time, that keeps
    the statement to the partitions of the span (issue #30).
    """

    earliest: dt.datetime
    latest: dt.datetime

    def __post_init__(self) -> None:
        earliest = ensure_utc(self.earliest, name="earliest")
        latest = ensure_utc(self.latest, name="latest")
        if latest < earliest:
            raise ValueError(f"due span ends ({latest}) before it starts ({earliest})")
        object.__setattr__(self, "earliest", earliest)
        object.__setattr__(self, "latest", latest)

    @classmethod
    def of(cls, due_times: Iterable[dt.datetime]) -> DueSpan:
        """The span of ``due_times`` (at least one)."""
        times = list(due_times)
        if not times:
            raise ValueError("a due span needs at least one due time")
        return cls(earliest=min(times), latest=max(times))

    def holds(self, due_at: dt.datetime) -> bool:
        return self.earliest <= due_at <= self.latest


FINISHED_STATUSES = frozenset(
    {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.DEAD,
        JobStatus.CANCELLED,
        JobStatus.EXPIRED,
        JobStatus.SENT,
        JobStatus.MISSED,
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
        "compression",
    }
)


#: The content types a stored body is decoded from when no Celery app says
#: which it accepts: JSON only, never an executable format such as pickle.
DEFAULT_ACCEPT: frozenset[str] = frozenset({"application/json"})


def accepted_content_types(accept: Iterable[str] | None) -> frozenset[str]:
    """Content types of a Celery ``accept_content`` list (serializer names
    such as ``"json"`` or content types); raises ConfigurationError for a
    serializer that is not installed."""
    if accept is None:
        return DEFAULT_ACCEPT
    if isinstance(accept, str):
        accept = [accept]
    from kombu.exceptions import SerializerNotInstalled
    from kombu.serialization import prepare_accept_content

    try:
        return frozenset(prepare_accept_content(list(accept)) or ())
    except SerializerNotInstalled as exc:
        raise ConfigurationError(f"accept_content names an unknown serializer: {exc}") from exc


def decode_body(
    body: bytes,
    content_type: str,
    content_encoding: str,
    accept: frozenset[str],
    what: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a stored protocol-2 body, decoded only if its
    content type is in ``accept`` (content types, see
    :func:`accepted_content_types`).

    Raises :class:`~celery_sched.errors.UntrustedContent` naming the content
    type when it is not accepted, before anything is deserialized, and
    :class:`~celery_sched.errors.UndecodableBody` when the body is corrupt.
    """
    from kombu.exceptions import ContentDisallowed, DecodeError
    from kombu.serialization import loads

    if content_type not in accept:
        # Checked here, not left to kombu: kombu trusts raw binary and text
        # content whatever `accept` says.
        raise UntrustedContent(
            f"{what} is stored as {content_type!r}, which is not in the accepted content "
            f"types ({', '.join(sorted(accept))}); add its serializer to the app's "
            "accept_content to read it"
        )
    try:
        args, kwargs, _embed = loads(body, content_type, content_encoding, accept=accept)
        return tuple(args), dict(kwargs)
    except (ContentDisallowed, DecodeError, TypeError, ValueError) as exc:
        raise UndecodableBody(f"{what} cannot be decoded as {content_type!r}: {exc}") from exc


def id_of_key(key: str) -> uuid.UUID | None:
    """The UUID whose canonical text (``str(uuid)``) is ``key``, else None.

    Such a key is its job's id: a keyless job's key is its id's text.
    """
    if len(key) != 36 or key[8] != "-":
        return None
    try:
        value = uuid.UUID(key)
    except ValueError:
        return None
    return value if str(value) == key else None


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
        check_aware(self, "due_at", "expires_at")
        if not self.key:
            raise ValueError("job key must not be empty")
        key_id = id_of_key(self.key)
        if key_id is not None and key_id != self.id:
            # The store keeps such a key as the id: it must be this job's.
            raise ValueError(f"job key {self.key!r} is a UUID's text, so it must be the job's id")
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
        if values["key"] is None:
            values["key"] = str(values["id"])
        values["options"] = dict(values["options"])
        return cls(**values)


#: The fields of a new job as a plain tuple, in the column order of the bulk
#: load. ``schedule_many`` moves a million of these: building a tuple costs
#: a fraction of a frozen dataclass, and the store writes it unchanged.
#: ``due_bucket`` must equal ``to_bucket(due_at)``; ``options`` is a mapping
#: that nobody mutates (:data:`EMPTY_OPTIONS` when there are none). ``key``
#: is None for every job scheduled without a key (its key is its generated
#: id's text, which the bulk path never formats); a caller's key that is a
#: UUID's text is the id and is kept here too, so that the bulk load knows
#: the id is the caller's and checks that no job has it.
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
    #: When the job was last claimed; for a ``retrying`` job, when its
    #: Celery retry is due (possibly in the future).
    dispatched_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    worker: str | None = None
    last_error: str | None = None
    #: The pid of the worker process (on host ``worker``) running the job.
    worker_pid: int | None = None
    #: The claim that last dispatched the job (a random id per claim).
    claim_id: int | None = None

    def __post_init__(self) -> None:
        check_aware(
            self,
            "due_at",
            "expires_at",
            "created_at",
            "dispatched_at",
            "started_at",
            "finished_at",
        )
        object.__setattr__(self, "status", JobStatus(self.status))

    def decode(self, accept: Iterable[str] | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return ``(args, kwargs)`` decoded from the stored body.

        ``accept`` lists the serializers (``"json"``, ``"pickle"``) or content
        types that may be decoded, as Celery's ``accept_content`` does; by
        default JSON only, since a job carries no app to ask. A body of any
        other type raises :class:`~celery_sched.errors.UntrustedContent`
        without being deserialized. ``Client.decode(job)`` passes the app's
        ``accept_content``.
        """
        return decode_body(
            self.body,
            self.content_type,
            self.content_encoding,
            accepted_content_types(accept),
            f"the body of job {self.key!r}",
        )

    @property
    def args(self) -> tuple[Any, ...]:
        """The positional arguments, decoded as :meth:`decode` does by default."""
        return self.decode()[0]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments, decoded as :meth:`decode` does by default."""
        return self.decode()[1]


#: The fields of :class:`Job`, in order (row loaders select columns in this order).
JOB_FIELDS = tuple(field.name for field in dataclasses.fields(Job))
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
    dataclass ``__init__`` sets each of its 28 fields through
    ``object.__setattr__``, which costs more than the database's own work
    per row; filling this twin with plain attribute stores and then
    retyping it as a Job gives the same object for a fraction of that.
    Any per-field write into a Job itself goes through a frozen
    ``__setattr__`` or a slot wrapper: 100k rows took 3.7x as long with
    ``object.__setattr__`` and 2.8x with the slots' own ``__set__``
    (CPython 3.11, December 2026).
    """

    __slots__ = JOB_FIELDS

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
        worker_pid: Any,
        claim_id: Any,
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
        self.worker_pid = worker_pid
        self.claim_id = claim_id


def jobs_from_rows(names: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from stored rows whose columns are ``names`` (every Job field once).

    Checks what ``Job.__post_init__`` checks: the status is a known
    :class:`JobStatus` and datetimes are aware (converted to UTC).
    """
    if tuple(names) != JOB_FIELDS:
        if sorted(names) != sorted(JOB_FIELDS):
            raise ValueError(f"rows must have exactly the Job fields, got {list(names)}")
        order = [list(names).index(name) for name in JOB_FIELDS]
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
