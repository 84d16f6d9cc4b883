"""Turning user input into :class:`~celery_sched.models.NewJob`, with every check.

:class:`JobBuilder` runs before anything is written, so a rejected job leaves
no trace. Every rejection is a :class:`~celery_sched.errors.InvalidJob`
subclass whose message names the problem.

``Client.schedule_many`` pushes a million rows through :meth:`JobBuilder.build`
in one call, so the per-row path avoids repeated lookups: the task registry,
timezone, serializer and repr limits are resolved once, and the common case
of flat scalar arguments with the JSON serializer is encoded without the
generic (and several times slower) encoder and ``saferepr`` machinery, with
byte-identical output.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import struct
import uuid
import zlib
import zoneinfo
from collections.abc import Callable, Iterator, Mapping
from json.encoder import encode_basestring_ascii
from time import time_ns
from typing import Any

import kombu.serialization
from celery.utils.saferepr import saferepr
from kombu.serialization import dumps
from kombu.utils.json import dumps as kombu_json_dumps

from celery_sched.dispatch import RESERVED_HEADER_PREFIX, RESERVED_HEADERS, is_reserved_header
from celery_sched.errors import (
    InvalidArguments,
    InvalidJob,
    InvalidTime,
    PayloadTooLarge,
    UnknownOption,
    UnknownTask,
    UnknownTimezone,
)
from celery_sched.models import (
    DUE_LIMIT,
    EMPTY_OPTIONS,
    MAX_INT32,
    MAX_SECONDS,
    MESSAGE_OPTIONS,
    NewJob,
    NewJobRow,
    id_of_key,
)
from celery_sched.settings import Settings
from celery_sched.timeutil import EPOCH, UTC, resolve_local

#: Scheduling options that shape the job row rather than the message.
JOB_OPTIONS = frozenset({"expires", "max_attempts", "visibility_timeout", "max_runtime"})

#: Every option ``schedule`` accepts besides its named parameters.
ALLOWED_OPTIONS = MESSAGE_OPTIONS | JOB_OPTIONS

#: Task attributes (``@app.task(base=celery_sched.Task, max_attempts=3)``) that
#: become the defaults of every job scheduled for that task; a job's own
#: options override them.
TASK_JOB_DEFAULTS = ("visibility_timeout", "max_attempts", "max_runtime")

MAX_KEY_LENGTH = 512

#: The shape of a periodic occurrence's key, exactly as
#: ``schedules.occurrence_key`` writes it: ``<schedule name>@`` and the
#: nominal UTC instant as naive ``isoformat()`` (microseconds only when not
#: zero) plus ``Z``. The planner skips keys that exist, so a caller's job
#: holding one would silently take that occurrence's place.
_OCCURRENCE_KEY = re.compile(r".+@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?Z", re.DOTALL)


def is_occurrence_key(key: str) -> bool:
    """Whether ``key`` has the form reserved for periodic occurrences."""
    return key[-1:] == "Z" and _OCCURRENCE_KEY.fullmatch(key) is not None


#: The protocol-2 "embed" part of the body: scheduled jobs carry no canvas.
_EMBED: dict[str, None] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_JSON_TAIL = "}, " + json.dumps(_EMBED) + "]"

_DEFAULT_REPR_MAXLEVELS = 3

Clock = Callable[[], dt.datetime]

_MINUTE = dt.timedelta(minutes=1)


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
        self._serializer: str = app.conf.task_serializer
        self._argsrepr_max: int | None = app.amqp.argsrepr_maxsize
        self._kwargsrepr_max: int | None = app.amqp.kwargsrepr_maxsize
        maxlevels = app.conf.get("task_repr_maxlevels", _DEFAULT_REPR_MAXLEVELS)
        self._repr_maxlevels: int = _DEFAULT_REPR_MAXLEVELS if maxlevels is None else maxlevels
        self._max_payload = settings.max_payload_bytes
        self._max_attempts = settings.max_attempts
        self._shards = settings.shards
        self._ids = UUID7Source()
        self._content_type, self._content_encoding = _codec_of(self._serializer)
        # The flat-scalar fast path reproduces kombu's JSON output exactly;
        # only take it when the app uses kombu's own JSON encoder.
        self._fast_json = self._serializer == "json" and _registered_encoder("json") is (
            kombu_json_dumps
        )
        # Flat containers sit at repr level 1, which saferepr never elides
        # unless maxlevels is negative.
        self._fast_repr = self._repr_maxlevels >= 0

    # -- public -------------------------------------------------------------

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
            _check_text("task name", task_name)
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

        body, argsrepr, kwargsrepr = self._encode(task_name, args, kwargs)

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
                _check_text("job key", key)
            if caller_key and is_occurrence_key(key):
                raise InvalidJob(
                    f"job key {key!r} has the form <name>@<UTC instant>Z, which is reserved "
                    "for the occurrences of periodic schedules; choose another key"
                )
            key_id = id_of_key(key)
            if key_id is None:
                job_id = self._ids.next()
            else:
                job_id, key = key_id, None

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
            return self._with_options(
                job_id, key, task_name, body, argsrepr, kwargsrepr, due_at, shard, options
            )
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
            EMPTY_OPTIONS,
            due_at,
            int((due_at - EPOCH) // _MINUTE),
            None,
            self._max_attempts,
            shard,
            None,
            None,
            None,
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
        return 0 if self._shards == 1 else zlib.crc32(key.encode()) % self._shards

    # -- arguments ------------------------------------------------------------

    def _encode(
        self, task_name: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bytes, str, str]:
        """Serialize the protocol-2 body once; return it with argsrepr/kwargsrepr."""
        for name in kwargs:
            if type(name) is not str:
                raise InvalidArguments(
                    f"kwargs of task {task_name!r} must have string keys, got {name!r}"
                )
        fast = _flat_scalars(args, kwargs) if self._fast_repr else None
        if fast is None:
            body = self._serialize(task_name, args, kwargs)
            return (
                body,
                _pg_text(self._saferepr_args(args)),
                _pg_text(self._saferepr_kwargs(kwargs)),
            )
        arg_reprs, arg_jsons, kwarg_reprs, kwarg_jsons = fast
        inner = ", ".join(arg_reprs)
        if type(args) is list:
            argsrepr = "[" + inner + "]"
        elif len(arg_reprs) == 1:
            argsrepr = "(" + inner + ",)"
        else:
            argsrepr = "(" + inner + ")"
        # Only an untruncated saferepr equals the plain join.
        limit = self._argsrepr_max
        if limit is not None and len(argsrepr) >= limit:
            argsrepr = self._saferepr_args(args)
        kwargsrepr = "{" + ", ".join(kwarg_reprs) + "}" if kwarg_reprs else "{}"
        limit = self._kwargsrepr_max
        if limit is not None and len(kwargsrepr) >= limit:
            kwargsrepr = self._saferepr_kwargs(kwargs)
        if not argsrepr.isascii() or "\x00" in argsrepr:
            argsrepr = _pg_text(argsrepr)
        if not kwargsrepr.isascii() or "\x00" in kwargsrepr:
            kwargsrepr = _pg_text(kwargsrepr)
        if not self._fast_json:
            return self._serialize(task_name, args, kwargs), argsrepr, kwargsrepr
        body = (
            "[[" + ", ".join(arg_jsons) + "], {" + ", ".join(kwarg_jsons) + _EMBED_JSON_TAIL
        ).encode("ascii")
        if len(body) > self._max_payload:
            self._check_size(task_name, body)
        return body, argsrepr, kwargsrepr

    def _serialize(
        self, task_name: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bytes:
        try:
            _ctype, _cenc, payload = dumps((args, kwargs, _EMBED), serializer=self._serializer)
        except Exception as exc:  # serializers raise anything; all mean "cannot encode"
            cause = exc.__cause__ or exc
            raise InvalidArguments(
                f"arguments of task {task_name!r} cannot be serialized with "
                f"{self._serializer!r}: {type(cause).__name__}: {cause}"
            ) from exc
        body = payload.encode(self._text_encoding()) if isinstance(payload, str) else payload
        self._check_size(task_name, body)
        return body

    def _text_encoding(self) -> str:
        enc = self._content_encoding
        return "utf-8" if enc in ("binary", "") else enc

    def _check_size(self, task_name: str, body: bytes) -> None:
        if len(body) > self._max_payload:
            raise PayloadTooLarge(
                f"serialized arguments of task {task_name!r} are {len(body)} bytes, "
                f"over the limit of {self._max_payload} bytes (celery_sched_max_payload_bytes)"
            )

    def _saferepr_args(self, args: list[Any] | tuple[Any, ...]) -> str:
        return saferepr(args, self._argsrepr_max, maxlevels=self._repr_maxlevels)

    def _saferepr_kwargs(self, kwargs: dict[str, Any]) -> str:
        return saferepr(kwargs, self._kwargsrepr_max, maxlevels=self._repr_maxlevels)

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

    def _with_options(
        self,
        job_id: uuid.UUID,
        key: str | None,
        task_name: str,
        body: bytes,
        argsrepr: str,
        kwargsrepr: str,
        due_at: dt.datetime,
        shard: int,
        options: Mapping[str, Any],
    ) -> NewJobRow:
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
            job_id,
            key,
            task_name,
            body,
            self._content_type,
            self._content_encoding,
            argsrepr,
            kwargsrepr,
            message or EMPTY_OPTIONS,
            due_at,
            int((due_at - EPOCH) // _MINUTE),
            expires_at,
            max_attempts,
            shard,
            None,
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


# -- option checks -------------------------------------------------------------


def _check_message_option(name: str, value: Any) -> Any:
    if name in ("queue", "exchange", "routing_key"):
        if not isinstance(value, str) or (name == "queue" and not value):
            raise InvalidJob(f"option {name} must be a non-empty string, got {value!r}")
        _check_text(f"option {name}", value)
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


def _check_text(what: str, value: str) -> None:
    """Refuse text PostgreSQL cannot store: NUL characters, lone surrogates."""
    if "\x00" in value:
        raise InvalidJob(f"{what} must not contain NUL characters: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJob(f"{what} is not valid Unicode text: {value!r}") from exc


def _pg_text(text: str) -> str:
    """A repr made storable as PostgreSQL text (escaping NUL and lone surrogates)."""
    text = text.replace("\x00", "\\x00")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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


# -- serializer lookups ----------------------------------------------------------


def _registered_encoder(serializer: str) -> object:
    # kombu keeps its codec table private; without it the fast path is off.
    table = getattr(getattr(kombu.serialization, "registry", None), "_encoders", {})
    codec = table.get(serializer)
    return None if codec is None else codec[2]


def _codec_of(serializer: str) -> tuple[str, str]:
    """Content type and encoding of ``serializer`` (raises InvalidJob if unknown)."""
    try:
        content_type, content_encoding, _payload = dumps([], serializer=serializer)
    except Exception as exc:
        raise InvalidJob(f"task serializer {serializer!r} is not available: {exc}") from exc
    return content_type, content_encoding


# -- the flat-scalar fast path -----------------------------------------------------

_Part = tuple[str, str]  # (saferepr text, JSON text)


def _scalar(value: Any) -> _Part | None:
    """saferepr and kombu-JSON text of a plain scalar, or None if not plain."""
    kind = type(value)
    if kind is str:
        # saferepr quotes with ' and escapes only the quote, unlike repr().
        return "'" + value.replace("'", "\\'") + "'", encode_basestring_ascii(value)
    if kind is int:
        text: str = int.__repr__(value)
        return text, text
    if value is None:
        return "None", "null"
    if kind is bool:
        return ("True", "true") if value else ("False", "false")
    if kind is float and math.isfinite(value):
        text = float.__repr__(value)
        return text, text
    return None


def _flat_scalars(
    args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """saferepr and JSON texts of each arg and of each ``key: value`` kwarg,
    or None unless all are plain scalars."""
    arg_reprs: list[str] = []
    arg_jsons: list[str] = []
    for value in args:
        part = _scalar(value)
        if part is None:
            return None
        arg_reprs.append(part[0])
        arg_jsons.append(part[1])
    kwarg_reprs: list[str] = []
    kwarg_jsons: list[str] = []
    for name, value in kwargs.items():
        part = _scalar(value)
        if part is None:
            return None
        kwarg_reprs.append("'" + name.replace("'", "\\'") + "': " + part[0])
        kwarg_jsons.append(encode_basestring_ascii(name) + ": " + part[1])
    return arg_reprs, arg_jsons, kwarg_reprs, kwarg_jsons


# -- ids -------------------------------------------------------------------------


class UUID7Source:
    """Time-ordered (version 7, RFC 9562) UUIDs, drawing OS randomness in blocks.

    The id is the primary key (and, for jobs scheduled without a key, the
    key). Random (v4) ids scatter every insert over the B-tree, and once it
    outgrows shared_buffers each row costs page evictions and full-page WAL
    images: a bulk load ran ~2.4x slower than with ids that grow with time,
    whose inserts all land at the right edge. Every claim and status change
    also writes a new primary-key entry next to the old one, so ids of jobs
    scheduled together keep those writes on neighbouring pages (random ids
    cost a claim ~30% more server time). A v7 id is 48 bits of Unix milliseconds followed by 74
    random bits, so ids stay unguessable and unique (collisions need the
    same millisecond and the same 74 random bits). The local clock only
    orders ids; no decision depends on it.

    ``uuid.uuid4()`` also makes a syscall and runs ``UUID.__init__``'s
    checks per id, a large share of a bulk insert's per-row cost; drawing
    randomness in blocks and building the UUID directly avoids both.
    """

    # 80 random bits per id, unpacked as a 64-bit and a 16-bit part; the
    # version and variant bits are then overwritten (74 stay random).
    _PARTS = struct.Struct(">QH")
    _BLOCK = _PARTS.size * 4096
    _CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
    _SET = (0x8000 << 48) | (7 << 76)

    def __init__(self) -> None:
        self._parts: Iterator[tuple[int, int]] = iter(())
        self._fast = _can_build_uuid_directly()

    def next(self) -> uuid.UUID:
        # Thread-safe without a lock: each step of the C unpacking iterator
        # runs under the GIL, so no two calls get the same random bits (two
        # threads replacing an exhausted iterator at once just draw twice).
        try:
            high, low = next(self._parts)
        except StopIteration:
            self._parts = self._PARTS.iter_unpack(os.urandom(self._BLOCK))
            high, low = next(self._parts)
        value = ((time_ns() // 1_000_000) << 80 | high << 16 | low) & self._CLEAR | self._SET
        if not self._fast:
            return uuid.UUID(int=value)
        # _uuid_from_int, inlined: one call less per id.
        obj: uuid.UUID = _new(_UUID)
        _set(obj, "int", value)
        _set(obj, "is_safe", _SAFE_UNKNOWN)
        return obj


_new = object.__new__
_set = object.__setattr__
_SAFE_UNKNOWN = uuid.SafeUUID.unknown
_UUID = uuid.UUID


def _uuid_from_int(value: int) -> uuid.UUID:
    # What UUID.__init__ ends with, without re-checking a value built to be valid.
    obj: uuid.UUID = _new(uuid.UUID)
    _set(obj, "int", value)
    _set(obj, "is_safe", _SAFE_UNKNOWN)
    return obj


def _can_build_uuid_directly() -> bool:
    """True when this Python's UUID can be built by slot assignment."""
    try:
        probe = _uuid_from_int(0x12345678123441238123123456789ABC)
        return probe == uuid.UUID("12345678-1234-4123-8123-123456789abc") and probe.version == 4
    except Exception:
        return False
