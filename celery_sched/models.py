"""Frozen value objects shared by every part. No I/O here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import types
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_sched.errors import (
    ConfigurationError,
    InvalidSchedule,
    UndecodableBody,
    UntrustedContent,
)
from celery_sched.timeutil import EPOCH, UTC, ensure_utc, get_zone, to_bucket


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


#: The first due time the store cannot hold: ``jobs.due_bucket`` is a 32-bit
#: count of minutes since the Unix epoch, which ends early in 6053. Later
#: due times are refused with ``InvalidTime``.
DUE_LIMIT = EPOCH + dt.timedelta(minutes=2**31)

#: The largest span, in seconds, of any duration a job or schedule may give
#: (interval, expires, catch-up window, visibility timeout, max_runtime, time
#: limits): 1000 years. Longer ones are no use, and would overflow the
#: arithmetic the planner (datetime) or the reconciler (PostgreSQL intervals
#: off ``now()``) does with them.
MAX_SECONDS = 1000 * 365.25 * 86400

#: The largest value of an ``integer`` column (``max_attempts``, ``max_catchup``).
MAX_INT32 = 2**31 - 1

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
#: is None when the key is the id's text (``str(id)``), as for every job
#: scheduled without a key: the bulk path never formats it.
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
    dataclass ``__init__`` sets each of its 27 fields through
    ``object.__setattr__``, which costs more than the database's own work
    per row; filling this twin with plain attribute stores and then
    retyping it as a Job gives the same object for a fraction of that.
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
    #: Running jobs whose worker process stopped beating (the rescuer):
    #: counted in ``requeued`` / ``dead`` too, except those in ``succeeded``.
    rescued: int = 0
    #: Rescued jobs that the idempotency ledger records as completed by
    #: this very job: marked succeeded instead of requeued.
    succeeded: int = 0


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))
        if self.status not in WORKER_STATUSES:
            raise ValueError(f"a worker cannot report status {self.status.value!r}")
        if self.retry_in is not None and self.status != JobStatus.RETRYING:
            raise ValueError(
                f"retry_in belongs to a retrying report, not a {self.status.value!r} one"
            )
        object.__setattr__(self, "retry_in", check_retry_in(self.retry_in))
        object.__setattr__(self, "worker", clean_text(self.worker, REPORT_WORKER_LIMIT))
        object.__setattr__(self, "error", clean_text(self.error, REPORT_ERROR_LIMIT))


# -- periodic schedules (the pure logic lives in celery_sched.schedules) ------


class MisfirePolicy(enum.StrEnum):
    """What happens to occurrences missed while no planner ran."""

    SKIP = "skip"  # drop them; run only future occurrences
    ONCE = "once"  # run the latest missed occurrence once (beat's behaviour)
    ALL = "all"  # run each missed one within the catch-up window, up to a maximum count


class OverlapPolicy(enum.StrEnum):
    """Whether an occurrence may start while the previous one is unfinished."""

    ALLOW = "allow"
    SKIP = "skip"  # no new occurrence while the previous is pending, dispatched or running


#: Mirrors ``celery_sched.store.schema.SCHEDULE_KINDS`` (the table's CHECK
#: constraint); models must not import the store, a unit test keeps them equal.
SCHEDULE_KINDS = frozenset({"crontab", "interval", "solar", "clocked"})
SCHEDULE_SOURCES = frozenset({"static", "dynamic"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """A periodic schedule as stored in ``schedules``: what runs, and when.

    ``spec`` is the JSON-able definition of the ``kind``:

    - ``crontab``: ``{"minute", "hour", "day_of_week", "day_of_month", "month_of_year"}``,
      each a Celery cron field string, evaluated on the wall clock of ``timezone``;
    - ``interval``: ``{"seconds": float}`` (positive);
    - ``solar``: ``{"event", "lat", "lon"}`` as :class:`celery.schedules.solar` takes them;
    - ``clocked``: ``{"at": "<ISO 8601 UTC>"}``, a one-off.

    Construction checks the generic fields (name, task, kind, timezone,
    policies, numbers) and raises :class:`~celery_sched.errors.InvalidSchedule`
    or :class:`~celery_sched.errors.UnknownTimezone`; the definition itself is
    checked by :func:`celery_sched.schedules.make_spec`. ``None`` policies and
    catch-up limits mean "the project default" (settings).
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    timezone: str = "UTC"
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    misfire: MisfirePolicy | None = None
    overlap: OverlapPolicy = OverlapPolicy.ALLOW
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    enabled: bool = True
    source: str = "dynamic"

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name.strip():
            raise InvalidSchedule(f"schedule name must be a non-empty string, got {self.name!r}")
        what = f"schedule {self.name!r}"
        if type(self.task) is not str or not self.task:
            raise InvalidSchedule(f"{what}: task must be a non-empty string, got {self.task!r}")
        if self.kind not in SCHEDULE_KINDS:
            raise InvalidSchedule(
                f"{what}: unknown schedule kind {self.kind!r}; "
                f"expected one of {', '.join(sorted(SCHEDULE_KINDS))}"
            )
        if not isinstance(self.spec, Mapping):
            raise InvalidSchedule(f"{what}: spec must be a mapping, got {type(self.spec).__name__}")
        if type(self.timezone) is not str:
            raise InvalidSchedule(f"{what}: timezone must be an IANA name, got {self.timezone!r}")
        get_zone(self.timezone)  # raises UnknownTimezone
        if self.source not in SCHEDULE_SOURCES:
            raise InvalidSchedule(
                f"{what}: source must be 'static' or 'dynamic', got {self.source!r}"
            )
        for name in ("relative", "enabled"):
            if type(getattr(self, name)) is not bool:
                raise InvalidSchedule(f"{what}: {name} must be a bool")
        try:
            if self.misfire is not None:
                object.__setattr__(self, "misfire", MisfirePolicy(self.misfire))
        except ValueError:
            raise InvalidSchedule(
                f"{what}: unknown misfire policy {self.misfire!r}; expected skip, once or all"
            ) from None
        try:
            object.__setattr__(self, "overlap", OverlapPolicy(self.overlap))
        except ValueError:
            raise InvalidSchedule(
                f"{what}: unknown overlap policy {self.overlap!r}; expected allow or skip"
            ) from None
        window = self.catchup_window
        if window is not None:
            if (
                type(window) is bool
                or not isinstance(window, (int, float))
                or not 0 <= window <= MAX_SECONDS
            ):
                raise InvalidSchedule(
                    f"{what}: catchup_window must be a number of seconds from 0 to "
                    f"{MAX_SECONDS:.0f} (1000 years), got {window!r}"
                )
            object.__setattr__(self, "catchup_window", float(window))
        count = self.max_catchup
        if count is not None and (type(count) is not int or not 0 <= count <= MAX_INT32):
            raise InvalidSchedule(
                f"{what}: max_catchup must be an integer from 0 to {MAX_INT32}, got {count!r}"
            )
        if isinstance(self.spec, Mapping):
            _check_plannable(what, self.kind, self.spec)
        if not isinstance(self.args, tuple):
            if not isinstance(self.args, list):
                raise InvalidSchedule(f"{what}: args must be a list or tuple")
            object.__setattr__(self, "args", tuple(self.args))
        for name in ("kwargs", "options"):
            if not isinstance(getattr(self, name), Mapping):
                raise InvalidSchedule(f"{what}: {name} must be a mapping")


def _check_plannable(what: str, kind: str, spec: Mapping[str, Any]) -> None:
    """Refuse definition values the store cannot hold or the planner cannot
    compute with (the definition's shape is checked by ``schedules.make_spec``)."""
    if kind == "interval":
        seconds = spec.get("seconds")
        # Only the upper bound here (and NaN); make_spec refuses the rest.
        if (
            isinstance(seconds, (int, float))
            and type(seconds) is not bool
            and not seconds <= MAX_SECONDS
        ):
            raise InvalidSchedule(
                f"{what}: interval must be a finite number of seconds, at most "
                f"{MAX_SECONDS:.0f} (1000 years), got {seconds!r} seconds"
            )
    elif kind == "clocked":
        at = spec.get("at")
        try:
            instant = dt.datetime.fromisoformat(at) if isinstance(at, str) else None
        except ValueError:
            instant = None  # make_spec names the problem
        if instant is not None and instant.utcoffset() is not None and instant >= DUE_LIMIT:
            raise InvalidSchedule(
                f"{what}: clocked time {at} is not before {DUE_LIMIT.isoformat()}, "
                "the last due time the store can hold"
            )


# -- periodic schedules: store rows and the public ScheduleInfo ----------------

#: Job statuses in which an occurrence is still in flight: the overlap policy
#: ``skip`` adds no new occurrence while one of these exists.
UNFINISHED_STATUSES = frozenset(
    {JobStatus.PENDING, JobStatus.DISPATCHED, JobStatus.RUNNING, JobStatus.RETRYING}
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NewSchedule:
    """A validated schedule ready to be written: a ``schedules`` row without its state.

    ``body`` is the task's protocol-2 body, serialized once when the schedule
    is added or synced; every occurrence copies it. ``options`` holds the
    message options and ``expires`` as JSON. ``next_nominal_at`` is the first
    instant the planner considers (``None``: the schedule never fires).
    ``misfire``, ``catchup_window`` and ``max_catchup`` are ``None`` when the
    project default applies.
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    timezone: str = "UTC"
    misfire: str | None = None
    overlap: str = "allow"
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    enabled: bool = True
    source: str = "dynamic"
    next_nominal_at: dt.datetime | None = None

    def __post_init__(self) -> None:
        _check_aware(self, "next_nominal_at")
        if not self.name:
            raise ValueError("schedule name must not be empty")
        if self.source not in ("static", "dynamic"):
            raise ValueError(f"schedule source must be 'static' or 'dynamic', got {self.source!r}")
        # The schedules table's CHECK constraints refuse anything else; the
        # memory store must refuse it as well, and before any write.
        if self.misfire is not None and self.misfire not in set(MisfirePolicy):
            raise ValueError(
                f"schedule misfire policy {self.misfire!r} is not one of skip, once, all"
            )
        if self.overlap not in set(OverlapPolicy):
            raise ValueError(f"schedule overlap policy {self.overlap!r} is not one of allow, skip")

    def timing(self) -> tuple[Any, ...]:
        """The fields that decide *when* it fires; a change restarts it from now."""
        return (self.kind, dict(self.spec), self.timezone, self.relative)

    def definition(self) -> tuple[Any, ...]:
        """Everything a user defines (compared by the static sync)."""
        return (
            *self.timing(),
            self.task,
            self.body,
            self.content_type,
            self.content_encoding,
            self.argsrepr,
            self.kwargsrepr,
            dict(self.options),
            self.misfire,
            self.overlap,
            self.catchup_window,
            self.max_catchup,
            self.enabled,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoredSchedule:
    """A ``schedules`` row as stored: the definition plus the planner's state.

    ``last_nominal_at`` is the planner's cursor, the last instant it
    considered (materialized or skipped). When it is ``None``,
    ``next_nominal_at`` is the next instant to consider, exactly; otherwise
    the next one follows the cursor. ``version`` grows with every change a
    user (or the static sync) makes, so a planner that read an older version
    writes nothing for it. ``enabled`` is false for a static schedule that is
    no longer in the code; ``paused`` is the user's switch.
    """

    id: int
    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    options: Mapping[str, Any]
    timezone: str
    misfire: str | None
    overlap: str
    catchup_window: float | None
    max_catchup: int | None
    relative: bool
    enabled: bool
    source: str
    paused: bool
    version: int
    last_nominal_at: dt.datetime | None
    next_nominal_at: dt.datetime | None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    disabled_at: dt.datetime | None = None
    #: Set when the planner could not plan the schedule (``broken_reason``
    #: says why); the planner skips it until a change replaces it.
    broken_at: dt.datetime | None = None
    broken_reason: str | None = None

    def __post_init__(self) -> None:
        _check_aware(
            self,
            "last_nominal_at",
            "next_nominal_at",
            "created_at",
            "updated_at",
            "disabled_at",
            "broken_at",
        )

    def as_new(self) -> NewSchedule:
        """The definition part of this row."""
        return NewSchedule(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(NewSchedule)}
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleAdvance:
    """One planner step for one schedule, written atomically by ``commit_plans``.

    Applied only if the schedule still has ``version`` and is enabled and not
    paused; then the cursor moves to ``last_nominal_at`` / ``next_nominal_at``
    and the ``occurrences`` are inserted (existing keys skipped). With
    ``skip_if_busy`` (overlap ``skip``) the occurrences are not inserted while
    the schedule has an unfinished one; the cursor moves all the same.
    """

    schedule_id: int
    version: int
    last_nominal_at: dt.datetime | None
    next_nominal_at: dt.datetime | None
    occurrences: Sequence[NewJob] = ()
    skip_if_busy: bool = False

    def __post_init__(self) -> None:
        _check_aware(self, "last_nominal_at", "next_nominal_at")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanCommit:
    """What one ``commit_plans`` call wrote.

    ``written`` holds ``(id, due_at, shard)`` of every inserted occurrence
    (for staging); ``stale`` counts schedules whose advance was dropped
    because they changed meanwhile; ``busy`` counts occurrences not written
    because of the overlap policy.
    """

    written: list[tuple[uuid.UUID, dt.datetime, int]] = dataclasses.field(default_factory=list)
    stale: int = 0
    busy: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What a static schedule sync changed.

    ``conflicts`` names static definitions whose name is taken by a dynamic
    schedule (left untouched).
    """

    added: int = 0
    updated: int = 0
    disabled: int = 0
    unchanged: int = 0
    conflicts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleRuns:
    """A schedule's next pending occurrence and its latest one due so far."""

    next_due_at: dt.datetime | None = None
    last_due_at: dt.datetime | None = None
    last_status: JobStatus | None = None

    def __post_init__(self) -> None:
        _check_aware(self, "next_due_at", "last_due_at")
        if self.last_status is not None:
            object.__setattr__(self, "last_status", JobStatus(self.last_status))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleInfo:
    """A periodic schedule as users see it (``Client.schedules.get`` / ``list``).

    ``next_run_at`` is the due time of its next pending occurrence, or the
    next instant the planner will materialize; ``None`` when it is paused,
    disabled, broken or will never fire again. ``last_run_at`` /
    ``last_status`` are the latest occurrence due so far and its job status.
    ``broken_at`` / ``broken_reason``: when and why the planner set it aside
    (until it is updated or resumed).
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    timezone: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    misfire: str | None = None
    overlap: str = "allow"
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    source: str = "dynamic"
    enabled: bool = True
    paused: bool = False
    next_run_at: dt.datetime | None = None
    last_run_at: dt.datetime | None = None
    last_status: JobStatus | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    disabled_at: dt.datetime | None = None
    broken_at: dt.datetime | None = None
    broken_reason: str | None = None

    def __post_init__(self) -> None:
        _check_aware(
            self,
            "next_run_at",
            "last_run_at",
            "created_at",
            "updated_at",
            "disabled_at",
            "broken_at",
        )
        if self.last_status is not None:
            object.__setattr__(self, "last_status", JobStatus(self.last_status))

    @property
    def state(self) -> str:
        """``disabled`` (gone from the code), ``paused``, ``broken`` (the
        planner could not plan it: ``broken_reason``), ``finished`` (never
        fires again) or ``active``."""
        if not self.enabled:
            return "disabled"
        if self.paused:
            return "paused"
        if self.broken_at is not None:
            return "broken"
        if self.next_run_at is None:
            return "finished"
        return "active"


# -- idempotency ledger (celery_sched.Task) ------------------------------------


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
#: cancelled, given up on, expired, or already succeeded.
FENCED_STATUSES = frozenset(
    {JobStatus.CANCELLED, JobStatus.DEAD, JobStatus.EXPIRED, JobStatus.SUCCEEDED}
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
    """

    reason: str | None = None
    adopted: int | None = None


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
        _check_aware(self, "lease_expires_at", "created_at", "completed_at")
        object.__setattr__(self, "state", LedgerState(self.state))
