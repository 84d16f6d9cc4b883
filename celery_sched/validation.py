"""Turning user input into :class:`~celery_sched.models.NewJob`, with every check.

:class:`JobBuilder` runs before anything is written, so a rejected job leaves
no trace. Every rejection is a :class:`~celery_sched.errors.InvalidJob`
subclass whose message names the problem. The body and reprs are encoded by
:class:`celery_sched.protocol.BodyEncoder`, ids come from
:class:`celery_sched.ids.UUID7Source`; this module only checks.

``Client.schedule_many`` pushes a million rows through :meth:`JobBuilder.build`
in one call, so the per-row path avoids repeated lookups: the task registry,
timezone, serializer and limits are resolved once.
"""

from __future__ import annotations

import datetime as dt
import inspect
import json
import math
import re
import string
import zlib
import zoneinfo
from collections.abc import Callable, Mapping
from typing import Any

import kombu.compression

from celery_sched.errors import (
    CelerySchedError,
    ConfigurationError,
    InvalidArguments,
    InvalidJob,
    InvalidTime,
    PayloadTooLarge,
    UnknownOption,
    UnknownTask,
    UnknownTimezone,
)
from celery_sched.ids import UUID7Source
from celery_sched.models import (
    DUE_FLOOR,
    DUE_LIMIT,
    EMPTY_OPTIONS,
    MAX_INT32,
    MAX_SECONDS,
    MESSAGE_OPTIONS,
    NewJob,
    NewJobRow,
    id_of_key,
)
from celery_sched.protocol import (
    MAX_KEY_LENGTH,
    RESERVED_HEADER_PREFIX,
    RESERVED_HEADERS,
    BodyEncoder,
    is_reserved_header,
)
from celery_sched.settings import Settings
from celery_sched.timeutil import EPOCH, UTC, resolve_local

#: Scheduling options that shape the job row rather than the message.
JOB_OPTIONS = frozenset({"expires", "max_attempts", "visibility_timeout", "max_runtime"})

#: Every option ``schedule`` accepts besides its named parameters.
ALLOWED_OPTIONS = MESSAGE_OPTIONS | JOB_OPTIONS

#: Task attributes (``@app.task(base=celery_sched.Task, max_attempts=3)``) that
#: become the defaults of every job scheduled for that task; a job's own
#: options override them. ``expires`` is Celery's own (``@app.task(expires=20)``):
#: a one-off job's counts from its due time like the option, so it is fixed
#: here, in ``expires_at``, for the store to expire the job by. The task's
#: time limits are applied when the message is sent
#: (:func:`celery_sched.protocol.task_defaults`), as is a periodic
#: occurrence's ``expires``, which counts from the send.
TASK_JOB_DEFAULTS = ("visibility_timeout", "max_attempts", "max_runtime", "expires")

#: The shape of a periodic occurrence's key, exactly as
#: ``schedules.occurrence_key`` writes it: ``<schedule name>@`` and the
#: nominal UTC instant as naive ``isoformat()`` (microseconds only when not
#: zero) plus ``Z``. The planner skips keys that exist, so a caller's job
#: holding one would silently take that occurrence's place.
_OCCURRENCE_KEY = re.compile(r".+@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?Z", re.DOTALL)


def is_occurrence_key(key: str) -> bool:
    """Whether ``key`` has the form reserved for periodic occurrences."""
    return key[-1:] == "Z" and _OCCURRENCE_KEY.fullmatch(key) is not None


Clock = Callable[[], dt.datetime]

_MINUTE = dt.timedelta(minutes=1)

#: The row fields options decide: message options, expires_at,
#: max_attempts, visibility_timeout, max_runtime.
_OptionFields = tuple[Mapping[str, Any], dt.datetime | None, int, float | None, float | None]


def shard_of_key(key: str, shards: int) -> int:
    """The shard of ``shards`` a job key belongs to (stable across processes):
    where inserts put a job, and where a changed shard count moves it."""
    return 0 if shards == 1 else zlib.crc32(key.encode()) % shards


class JobBuilder:
    """Validates scheduling input against a Celery app and builds NewJobs.

    ``now`` arguments are callables so the store's clock is consulted only
    when a row actually needs it (a countdown, or no due time at all).
    """

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        # The registry is a live dict: tasks registered later are still seen.
        self._tasks: Mapping[str, Any] = app.tasks
        self._task_defaults: dict[str, dict[str, Any] | None] = {}
        try:
            self._zone: dt.tzinfo = app.timezone
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise UnknownTimezone(
                f"the Celery app's timezone {app.conf.timezone!r} is unknown"
            ) from exc
        self._max_payload = settings.max_payload_bytes
        self._max_attempts = settings.max_attempts
        self._shards = settings.shards
        self._ids = UUID7Source()
        self._no_options: _OptionFields = (EMPTY_OPTIONS, None, self._max_attempts, None, None)
        encoder = BodyEncoder(app)
        self._encode = encoder.encode
        self._content_type = encoder.content_type
        self._content_encoding = encoder.content_encoding

    # -- public -------------------------------------------------------------

    @property
    def content_type(self) -> str:
        """The content type of the bodies built (the app's task serializer)."""
        return self._content_type

    def build(
        self,
        task_name: str,
        args: Any = (),
        kwargs: Any = None,
        *,
        eta: Any = None,
        countdown: Any = None,
        key: Any = None,
        check_task: bool = True,
        now: Clock,
        options: Mapping[str, Any] | None = None,
        caller_key: bool = False,
    ) -> NewJob:
        """Validate one job and return it ready to write.

        ``now`` supplies the store's current time for countdowns and for
        jobs given no due time. ``caller_key`` says the key is a caller's
        (``Client.schedule``), which may not have the form of a periodic
        occurrence's key; the planner's own sample occurrences pass False.
        Raises an :class:`InvalidJob` subclass.
        """
        return NewJob.from_row(
            self._build(
                task_name, args, kwargs, eta, countdown, key, check_task, now, options, caller_key
            )
        )

    def build_row(
        self, row: Mapping[str, Any], now: Clock, row_fields: frozenset[str]
    ) -> NewJobRow:
        """:meth:`build` from one ``schedule_many`` row, as a :data:`NEW_JOB_ROW`
        tuple (the bulk path never builds a NewJob).

        ``row_fields`` are the keys that are not options; any other key is
        one. Reading the mapping here, not in the caller, saves a keyword
        call per row on the bulk path. Every key is a caller's (see
        :meth:`build`).
        """
        get = row.get
        task = get("task")
        if task is None:
            task = get("task_name")
        return self._build(
            task,
            get("args", ()),
            get("kwargs"),
            get("eta"),
            get("countdown"),
            get("key"),
            get("check_task", True),
            now,
            None
            if row_fields.issuperset(row)
            else {name: value for name, value in row.items() if name not in row_fields},
            True,
        )

    def _build(
        self,
        task_name: Any,
        args: Any,
        kwargs: Any,
        eta: Any,
        countdown: Any,
        key: Any,
        check_task: Any,
        now: Clock,
        options: Mapping[str, Any] | None,
        caller_key: bool,
    ) -> NewJobRow:
        if type(task_name) is not str or not task_name:
            raise UnknownTask(f"task name must be a non-empty string, got {task_name!r}")
        if not task_name.isascii() or "\x00" in task_name:
            check_text("task name", task_name)
        if check_task and task_name not in self._tasks:
            raise UnknownTask(
                f"task {task_name!r} is not registered with Celery app {self.app.main!r}; "
                "import the module that defines it or pass check_task=False"
            )
        if args is None:
            args = ()
        elif (
            type(args) is not tuple
            and type(args) is not list
            and not isinstance(args, (list, tuple))
        ):
            raise InvalidArguments(
                f"args of task {task_name!r} must be a list or tuple, got {type(args).__name__}"
            )
        if kwargs is None:
            kwargs = {}
        elif type(kwargs) is not dict:
            if not isinstance(kwargs, Mapping):
                raise InvalidArguments(
                    f"kwargs of task {task_name!r} must be a mapping, got {type(kwargs).__name__}"
                )
            kwargs = dict(kwargs)
        for name in kwargs:
            if type(name) is not str:
                raise InvalidArguments(
                    f"kwargs of task {task_name!r} must have string keys, got {name!r}"
                )

        body, argsrepr, kwargsrepr = self._encode(task_name, args, kwargs)
        if len(body) > self._max_payload:
            raise PayloadTooLarge(
                f"serialized arguments of task {task_name!r} are {len(body)} bytes, "
                f"over the limit of {self._max_payload} bytes (celery_sched_max_payload_bytes)"
            )

        # The common bulk case, an aware UTC eta, needs no conversion.
        if countdown is None and type(eta) is dt.datetime and eta.tzinfo is UTC:
            due_at = eta
        else:
            due_at = self._due_at(eta, countdown, now)
        if due_at >= DUE_LIMIT:
            raise InvalidTime(
                f"due time {due_at.isoformat()} is too late: the store holds due times "
                f"before {DUE_LIMIT.isoformat()} (minutes since 1970 in a 32-bit integer)"
            )
        if due_at < DUE_FLOOR:
            raise InvalidTime(
                f"due time {due_at.isoformat()} is too early: due times before "
                f"{DUE_FLOOR.isoformat()} are refused as mistakes (a past due time "
                "runs at once: give now or a recent time)"
            )

        # A job without a key has its id as its key; so does a job whose key
        # is a UUID in canonical text form (the id is that UUID), which keeps
        # such a key unique against the ids of keyless jobs. Either way the
        # row carries None: the store does not keep the key twice.
        if key is None:
            job_id = self._ids.next()
        else:
            if type(key) is not str:
                raise InvalidJob(f"job key must be a string, got {type(key).__name__}")
            if not key or len(key) > MAX_KEY_LENGTH:
                raise InvalidJob(
                    f"job key must be 1 to {MAX_KEY_LENGTH} characters, got {len(key)}"
                )
            if not key.isascii() or "\x00" in key:
                check_text("job key", key)
            if caller_key and is_occurrence_key(key):
                raise InvalidJob(
                    f"job key {key!r} has the form <name>@<UTC instant>Z, which is reserved "
                    "for the occurrences of periodic schedules; choose another key"
                )
            key_id = id_of_key(key)
            # A caller's key that is a UUID's text becomes the id, and the
            # row keeps the key too: the bulk load then knows the id is the
            # caller's, not generated, and checks that no job has it (0012).
            job_id = self._ids.next() if key_id is None else key_id

        if self._shards == 1:
            shard = 0
        else:
            shard = zlib.crc32((str(job_id) if key is None else key).encode()) % self._shards

        try:
            defaults = self._task_defaults[task_name]
        except KeyError:
            defaults = self._defaults_of(task_name)
        if defaults is not None:
            options = {**defaults, **options} if options else defaults
        if options:
            message, expires_at, max_attempts, visibility_timeout, max_runtime = self._options(
                task_name, due_at, options
            )
        else:
            message, expires_at, max_attempts, visibility_timeout, max_runtime = self._no_options
        # NEW_JOB_ROW order; what NewJob.__post_init__ would check holds by
        # construction (aware UTC due_at, non-empty key, max_attempts >= 1).
        return (
            job_id,
            key,
            task_name,
            body,
            self._content_type,
            self._content_encoding,
            argsrepr,
            kwargsrepr,
            message,
            due_at,
            int((due_at - EPOCH) // _MINUTE),
            expires_at,
            max_attempts,
            shard,
            None,
            visibility_timeout,
            max_runtime,
        )

    def _defaults_of(self, task_name: str) -> dict[str, Any] | None:
        """The job defaults the task declares (cached per task name)."""
        task = self._tasks.get(task_name)
        defaults = {
            name: value
            for name in TASK_JOB_DEFAULTS
            if (value := getattr(task, name, None)) is not None
        }
        self._task_defaults[task_name] = result = defaults or None
        return result

    def shard_of(self, key: str) -> int:
        """The shard a job key belongs to (stable across processes)."""
        return shard_of_key(key, self._shards)

    # -- time -----------------------------------------------------------------

    def _due_at(self, eta: Any, countdown: Any, now: Clock) -> dt.datetime:
        if eta is not None:
            if countdown is not None:
                raise InvalidTime("give eta or countdown, not both")
            return self._instant(eta, "eta")
        if countdown is None:
            return now()
        if type(countdown) is bool or not isinstance(countdown, (int, float)):
            raise InvalidTime(f"countdown must be a number of seconds, got {countdown!r}")
        if not math.isfinite(countdown) or countdown < 0:
            raise InvalidTime(f"countdown must be a finite number >= 0, got {countdown!r}")
        try:
            return now() + dt.timedelta(seconds=countdown)
        except OverflowError as exc:
            raise InvalidTime(f"countdown {countdown!r} is out of range") from exc

    def _instant(self, value: Any, name: str) -> dt.datetime:
        """An aware UTC instant from a datetime or ISO 8601 string."""
        if isinstance(value, str):
            try:
                value = dt.datetime.fromisoformat(value)
            except ValueError as exc:
                raise InvalidTime(f"{name} is not an ISO 8601 datetime: {value!r}") from exc
        if not isinstance(value, dt.datetime):
            raise InvalidTime(f"{name} must be a datetime, got {type(value).__name__}")
        tz = value.tzinfo
        if tz is UTC:
            return value
        if tz is not None and value.utcoffset() is not None:
            return value.astimezone(UTC)
        # Naive: the app's timezone, as Celery reads a naive eta. Raises
        # AmbiguousTime / NonExistentTime (both InvalidTime) around DST.
        return resolve_local(value.replace(tzinfo=None), self._zone)

    # -- options --------------------------------------------------------------

    def _options(
        self, task_name: str, due_at: dt.datetime, options: Mapping[str, Any]
    ) -> _OptionFields:
        unknown = [name for name in options if name not in ALLOWED_OPTIONS]
        if unknown:
            raise UnknownOption(
                f"unknown option(s) {', '.join(sorted(map(str, unknown)))} for task "
                f"{task_name!r}; allowed: {', '.join(sorted(ALLOWED_OPTIONS))}"
            )
        message: dict[str, Any] = {}
        for name in MESSAGE_OPTIONS:
            value = options.get(name)
            if value is not None:
                message[name] = _check_message_option(name, value)

        expires_at: dt.datetime | None = None
        expires = options.get("expires")
        if expires is not None:
            expires_at = self._expires_at(expires, due_at)

        max_attempts = options.get("max_attempts")
        if max_attempts is None:
            max_attempts = self._max_attempts
        elif type(max_attempts) is not int or not 1 <= max_attempts <= MAX_INT32:
            raise InvalidJob(
                f"max_attempts must be an integer from 1 to {MAX_INT32}, got {max_attempts!r}"
            )
        return (
            message or EMPTY_OPTIONS,
            expires_at,
            max_attempts,
            _positive_seconds("visibility_timeout", options.get("visibility_timeout")),
            _positive_seconds("max_runtime", options.get("max_runtime")),
        )

    def _expires_at(self, expires: Any, due_at: dt.datetime) -> dt.datetime:
        if isinstance(expires, (int, float)) and type(expires) is not bool:
            if not 0 < expires <= MAX_SECONDS:  # also refuses NaN
                raise InvalidTime(
                    f"expires must be a positive number of seconds after the due time, "
                    f"at most {MAX_SECONDS:.0f} (1000 years), got {expires!r}"
                )
            try:
                return due_at + dt.timedelta(seconds=expires)
            except OverflowError as exc:
                raise InvalidTime(f"expires {expires!r} is out of range") from exc
        if isinstance(expires, (dt.datetime, str)):
            expires_at = self._instant(expires, "expires")
            if expires_at <= due_at:
                raise InvalidTime(
                    f"expires ({expires_at.isoformat()}) must be after the due time "
                    f"({due_at.isoformat()})"
                )
            return expires_at
        raise InvalidTime(
            "expires must be seconds after the due time or a datetime, "
            f"got {type(expires).__name__}"
        )


# -- celery_sched.Task decorator options -------------------------------------------


def _positive_number(value: Any) -> bool:
    return type(value) in (int, float) and value > 0


def check_task_options(cls: Any) -> None:
    """Validate the decorator options of a ``celery_sched.Task`` class when it
    is created (raises :class:`~celery_sched.errors.ConfigurationError`)."""
    name = cls.__dict__.get("name") or cls.__name__
    for option in ("visibility_timeout", "max_runtime"):
        value = getattr(cls, option)
        if value is not None and not _positive_number(value):
            raise ConfigurationError(
                f"task {name}: {option} must be a positive number of seconds, got {value!r}"
            )
    attempts = cls.max_attempts
    if attempts is not None and (type(attempts) is not int or attempts < 1):
        raise ConfigurationError(
            f"task {name}: max_attempts must be an integer >= 1, got {attempts!r}"
        )
    spec = cls.idempotency_key
    if spec is None or callable(spec):
        return
    if not isinstance(spec, str) or not spec:
        raise ConfigurationError(
            f"task {name}: idempotency_key must be a format string or a callable, got {spec!r}"
        )
    run = cls.__dict__.get("run")
    if run is None:
        return
    function = getattr(run, "__func__", run)
    try:
        parameters = inspect.signature(function).parameters
        fields = [field for _, field, _, _ in string.Formatter().parse(spec) if field]
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"task {name}: invalid idempotency_key {spec!r}: {exc}") from exc
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for field in fields:
        root = field.split(".", 1)[0].split("[", 1)[0]
        if root and not root.isdigit() and root not in parameters and not takes_any:
            raise ConfigurationError(
                f"task {name}: idempotency_key {spec!r} names {root!r}, which is not a "
                f"parameter of the task ({', '.join(parameters) or 'none'})"
            )


# -- option checks -------------------------------------------------------------


def _check_message_option(name: str, value: Any) -> Any:
    if name in ("queue", "exchange", "routing_key"):
        if not isinstance(value, str) or (name == "queue" and not value):
            raise InvalidJob(f"option {name} must be a non-empty string, got {value!r}")
        check_text(f"option {name}", value)
        return value
    if name == "priority":
        if type(value) is not int or not 0 <= value <= 255:
            raise InvalidJob(f"option priority must be an integer 0-255, got {value!r}")
        return value
    if name in ("time_limit", "soft_time_limit"):
        return _positive_seconds(name, value)
    if name == "ignore_result":
        if type(value) is not bool:
            raise InvalidJob(f"option ignore_result must be a bool, got {value!r}")
        return value
    if name == "compression":
        # A name or content type Kombu compresses with ("zlib", "bzip2", ...).
        try:
            kombu.compression.get_encoder(value)
        except (KeyError, TypeError):
            raise InvalidJob(
                "option compression must name a compression method Kombu knows "
                f"(such as 'zlib', 'bzip2' or 'lzma'), got {value!r}"
            ) from None
        return value
    if name == "headers":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise InvalidJob("option headers must be a mapping with string keys")
        reserved = sorted(k for k in value if is_reserved_header(k))
        if reserved:
            raise InvalidJob(
                f"option headers must not set {', '.join(map(repr, reserved))}: Celery's "
                f"protocol headers ({', '.join(sorted(RESERVED_HEADERS))}) and every "
                f"{RESERVED_HEADER_PREFIX}* header are reserved"
            )
        headers = dict(value)
        try:
            # Options are stored as JSON; refuse what would not survive.
            text = json.dumps(headers)
        except (TypeError, ValueError) as exc:
            raise InvalidJob(f"option headers must be JSON-serializable: {exc}") from exc
        if "\\u0000" in text:
            raise InvalidJob("option headers must not contain NUL characters (jsonb refuses them)")
        return headers
    raise AssertionError(f"unhandled message option {name}")  # pragma: no cover


def check_text(what: str, value: str, *, error: type[CelerySchedError] = InvalidJob) -> None:
    """Refuse text PostgreSQL cannot store (NUL characters, lone surrogates)
    with ``error`` naming ``what``."""
    if "\x00" in value:
        raise error(f"{what} must not contain NUL characters: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid Unicode text: {value!r}") from exc


def _positive_seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if type(value) is bool or not isinstance(value, (int, float)):
        raise InvalidJob(f"option {name} must be a number of seconds, got {value!r}")
    if not 0 < value <= MAX_SECONDS:  # also refuses NaN
        raise InvalidJob(
            f"option {name} must be a number of seconds > 0 and at most {MAX_SECONDS:.0f} "
            f"(1000 years), got {value!r}"
        )
    return float(value)
