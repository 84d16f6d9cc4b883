"""The message format of celery_sched's jobs: Celery protocol 2, plus our headers.

Every writer and reader of a job's message imports from here:

- the header names (:data:`KEY_HEADER` and friends), the names a user's
  ``headers`` option may not take, and :data:`MAX_KEY_LENGTH`;
- the headers of a message (:func:`base_headers`, :func:`message_headers`),
  built by the dispatchers, and their reading back on a worker
  (:func:`header`, :func:`request_job_id`, :func:`request_attempt`,
  :func:`request_due`), by
  ``celery_sched.Task``, the status tracking and the delivery fence;
- the body (``[args, kwargs, embed]`` in the app's task serializer) with its
  ``argsrepr`` / ``kwargsrepr``, encoded once when a job is scheduled
  (:class:`BodyEncoder`) and stored; dispatch never decodes or re-encodes it;
- what a task declares for its messages (:class:`TaskDefaults`: time limits
  and ``expires``) and expiry (:func:`is_expired`, :func:`send_expires_at`);
- the JSON envelope Kombu's Redis transport wraps a message in, which the
  dispatcher writes itself (:class:`RedisEnvelopes`). The AMQP properties of
  the RabbitMQ path are :mod:`celery_sched.dispatch.amqp_wire`;
- the body's compression (:func:`compress_body`, Kombu's ``compression``
  header) and what Celery's ``before_task_publish`` / ``after_task_publish``
  receivers are given for a message (:class:`PublishSignals`).

The job-scheduling path pushes a million bodies through :class:`BodyEncoder`
in one ``schedule_many`` call, and the beat builds headers and envelopes for
every message it publishes, so these paths avoid repeated lookups: the
serializer and repr limits are resolved once, the common case of flat scalar
arguments with the JSON serializer is encoded without the generic (and
several times slower) encoder and ``saferepr`` machinery, with byte-identical
output, and the constant part of the headers and envelopes is built once per
batch.
"""

from __future__ import annotations

import binascii
import contextvars
import dataclasses
import datetime as dt
import itertools
import json
import math
import uuid
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

import kombu.compression
import kombu.serialization
import orjson
from celery import signals
from celery.utils.saferepr import saferepr
from kombu.serialization import dumps
from kombu.utils.json import dumps as kombu_json_dumps

from celery_sched.errors import InvalidArguments, InvalidJob
from celery_sched.models import Job, decode_body
from celery_sched.timeutil import UTC, ensure_utc

# -- names ---------------------------------------------------------------------------

#: Our own message headers; a stock worker copies every header into
#: ``task.request``, so ``celery_sched.Task`` reads them there.
KEY_HEADER = "celery_sched_key"
ATTEMPT_HEADER = "celery_sched_attempt"
EPOCH_HEADER = "celery_sched_epoch"
#: Failed executions so far (a header ``celery_sched.Task``'s retries carry).
FAILURES_HEADER = "celery_sched_failures"
#: The job's due time (ISO 8601, UTC, to the microsecond): a worker's
#: statements about the job name its row by id *and* due time, so PostgreSQL
#: reads one partition of the jobs table instead of locking them all.
DUE_HEADER = "celery_sched_due"
#: celery_sched headers a retried message must keep.
CARRIED_HEADERS = (KEY_HEADER, ATTEMPT_HEADER, EPOCH_HEADER, FAILURES_HEADER, DUE_HEADER)

#: Longest job key, and longest idempotency key of ``celery_sched.Task``.
MAX_KEY_LENGTH = 512

#: Every header a message of ours carries whose name a user's ``headers``
#: option must not take: a stock worker reads them as protocol fields (a
#: ``shadow``, ``eta`` or ``retries`` of the user's would change what runs and
#: when), and ``celery_sched.Task`` trusts its own ``celery_sched_*`` headers
#: (key, attempt, epoch, failures) for the ledger and the fence. The names are
#: those of ``celery.app.amqp.AMQP.as_task_v2`` plus ``celery_beat_task``;
#: a test keeps them in step with the installed Celery.
RESERVED_HEADERS: frozenset[str] = frozenset(
    {
        "lang",
        "task",
        "id",
        "shadow",
        "eta",
        "expires",
        "group",
        "group_index",
        "retries",
        "timelimit",
        "root_id",
        "parent_id",
        "argsrepr",
        "kwargsrepr",
        "origin",
        "ignore_result",
        "replaced_task_nesting",
        "stamped_headers",
        "stamps",
        "celery_beat_task",
    }
)

#: Every header whose name starts with this is ours (present and future ones).
RESERVED_HEADER_PREFIX = "celery_sched_"


def is_reserved_header(name: str) -> bool:
    """Whether a user's ``headers`` option may not use ``name``."""
    return name in RESERVED_HEADERS or name.startswith(RESERVED_HEADER_PREFIX)


# -- writing headers -----------------------------------------------------------------


def base_headers(*, origin: str, epoch: int) -> dict[str, Any]:
    """The part of the protocol-2 headers that is the same for every job of a batch.

    Keys and defaults follow ``celery.app.amqp.AMQP.as_task_v2``;
    ``celery_beat_task`` is what ``celery.beat`` adds to the tasks it sends.
    """
    return {
        "lang": "py",
        "task": None,
        "id": None,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": None,
        "parent_id": None,
        "argsrepr": None,
        "kwargsrepr": None,
        "origin": origin,
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
        "celery_beat_task": True,
        KEY_HEADER: None,
        ATTEMPT_HEADER: 0,
        EPOCH_HEADER: epoch,
    }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskDefaults:
    """What a task declares for its messages, below a job's own options:
    the execution options ``send_task`` takes from the task's attributes
    (``@app.task(time_limit=5, soft_time_limit=3, expires=20)``) that the
    dispatchers do not already apply through routing.

    ``expires`` is seconds (counted from the send, as for a periodic
    occurrence; a one-off job gets its task's ``expires`` when it is built,
    counted from its due time) or an aware instant.
    """

    time_limit: float | None = None
    soft_time_limit: float | None = None
    expires: float | dt.datetime | None = None

    @property
    def has_time_limits(self) -> bool:
        return self.time_limit is not None or self.soft_time_limit is not None


def task_defaults(task: Any) -> TaskDefaults | None:
    """The :class:`TaskDefaults` of a registered Celery task, None for an
    unknown task or one that declares none of them.

    Read as Celery's ``Task._get_exec_options`` reads them: a task's
    ``time_limit`` defaults to the app's ``task_time_limit``, so that
    setting reaches the header too, as it does under stock beat.
    """
    if task is None:
        return None
    time_limit = _number(getattr(task, "time_limit", None))
    soft_time_limit = _number(getattr(task, "soft_time_limit", None))
    expires = getattr(task, "expires", None)
    if isinstance(expires, dt.datetime):
        expires = ensure_utc(expires, name="expires") if expires.tzinfo is not None else None
    else:
        expires = _number(expires)
    if time_limit is None and soft_time_limit is None and expires is None:
        return None
    return TaskDefaults(time_limit=time_limit, soft_time_limit=soft_time_limit, expires=expires)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value):
        return float(value)
    return None


#: The isoformat() of recent UTC due times (cleared when full; a plain
#: dict's get and set are atomic, so threads may share it).
_ISOFORMATS: dict[dt.datetime, str] = {}
_ISOFORMATS_KEPT = 4096


def message_headers(
    base: dict[str, Any],
    job: Job,
    task_id: str,
    *,
    expires_at: dt.datetime | None = None,
    defaults: TaskDefaults | None = None,
) -> dict[str, Any]:
    """The full headers of ``job``'s message: ``base`` plus the per-job fields.

    One dict literal per message: this is the hot path of a publish. The
    job's own ``headers`` option can only add headers: validation refuses
    reserved names, and any a row stored before that check carries are
    dropped here, so no protocol field (and no ``celery_sched_*`` header)
    ever comes from it.

    ``expires_at`` is the message's expiry when it is not the job's own
    (:func:`send_expires_at` of a periodic occurrence); ``defaults`` are
    what the job's task declares: each of ``time_limit`` and
    ``soft_time_limit`` the job's options leave out comes from there, as
    ``send_task`` merges a task's attributes under the caller's options.
    """
    options = job.options
    if expires_at is None:
        expires_at = job.expires_at
    due_at = job.due_at
    # Jobs of a batch mostly share their due times (a bulk schedule, a
    # periodic tick), and an aware datetime's isoformat() is a tenth of a
    # message's cost; a UTC datetime's text depends on its value only.
    due = _ISOFORMATS.get(due_at) if due_at.tzinfo is UTC else None
    if due is None:
        due = due_at.isoformat()
        if due_at.tzinfo is UTC:
            if len(_ISOFORMATS) >= _ISOFORMATS_KEPT:
                _ISOFORMATS.clear()
            _ISOFORMATS[due_at] = due
    extra = options.get("headers") if options else None
    if extra:
        extra = {name: value for name, value in extra.items() if not is_reserved_header(name)}
    headers = {
        **(base if not extra else {**base, **extra}),
        "task": job.task,
        "id": task_id,
        "expires": expires_at.isoformat() if expires_at is not None else None,
        "root_id": task_id,
        "argsrepr": job.argsrepr,
        "kwargsrepr": job.kwargsrepr,
        KEY_HEADER: job.key,
        ATTEMPT_HEADER: job.attempt,
        DUE_HEADER: due,
    }
    if defaults is not None and defaults.has_time_limits:
        if options:
            headers["timelimit"] = [
                options.get("time_limit", defaults.time_limit),
                options.get("soft_time_limit", defaults.soft_time_limit),
            ]
        else:
            headers["timelimit"] = [defaults.time_limit, defaults.soft_time_limit]
    elif options and ("time_limit" in options or "soft_time_limit" in options):
        headers["timelimit"] = [options.get("time_limit"), options.get("soft_time_limit")]
    if options and "ignore_result" in options:
        headers["ignore_result"] = bool(options["ignore_result"])
    return headers


def is_expired(job: Job, now: dt.datetime) -> bool:
    """Whether ``job`` must not be sent at ``now`` (the store's clock).

    Only a job's own ``expires_at`` (a one-off job's) can pass before the
    send; a periodic occurrence's ``expires`` counts from the send
    (:func:`send_expires_at`).
    """
    return job.expires_at is not None and job.expires_at <= now


def send_expires_at(
    job: Job, now: dt.datetime, defaults: TaskDefaults | None
) -> dt.datetime | None:
    """The expiry of a periodic occurrence's message sent at ``now``.

    A periodic occurrence (``schedule_id`` set) carries its schedule's
    ``expires`` as seconds in its options; without one its task's
    ``expires`` applies. Seconds count from the send, as stock beat's
    ``apply_async`` counts them, so the planner cannot fix the instant in
    advance: it is resolved here, at publish time. A job with its own
    ``expires_at`` (every one-off job given an expiry) keeps it, and so
    does an occurrence stored before expiry moved to the send.
    """
    if job.expires_at is not None or job.schedule_id is None:
        return job.expires_at
    options = job.options
    expires = options.get("expires") if options else None
    if expires is None and defaults is not None:
        expires = defaults.expires
    if expires is None:
        return None
    if isinstance(expires, dt.datetime):
        return expires
    return now + dt.timedelta(seconds=float(expires))


# -- reading headers back on a worker ------------------------------------------------


def header(request: Any, name: str) -> Any:
    """A message header of a task request: a worker makes headers request
    attributes; an eager ``apply(headers=...)`` and a worker request keep
    them in a headers mapping."""
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None) or getattr(request, "request_dict", None)
        value = (headers or {}).get(name)
    return value


def request_job_id(request: Any, task_id: Any) -> uuid.UUID | None:
    """The job id of a celery_sched message (its task id), else ``None``."""
    if header(request, KEY_HEADER) is None or task_id is None:
        return None
    try:
        return uuid.UUID(str(task_id))
    except ValueError:
        return None


def request_attempt(request: Any) -> int | None:
    """The ``celery_sched_attempt`` header of a task request, ``None`` if absent or odd."""
    value = header(request, ATTEMPT_HEADER)
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def request_due(request: Any) -> dt.datetime | None:
    """The ``celery_sched_due`` header of a task request, ``None`` if absent
    (a message sent before it existed) or odd."""
    value = header(request, DUE_HEADER)
    if not isinstance(value, str):
        return None
    try:
        due = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if due.utcoffset() is None:
        return None
    return due.astimezone(dt.UTC)


def header_count(request: Any, name: str) -> int:
    """A counting header of a task request (attempt, failures); 0 if absent or odd."""
    value = header(request, name)
    try:
        return max(0, int(value)) if value is not None else 0
    except (TypeError, ValueError):
        return 0


# -- the body and its reprs ----------------------------------------------------------

#: The protocol-2 "embed" part of the body: scheduled jobs carry no canvas.
EMBED: dict[str, None] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_JSON_TAIL = "}, " + json.dumps(EMBED) + "]"

_DEFAULT_REPR_MAXLEVELS = 3


class BodyEncoder:
    """Encodes jobs' bodies and reprs as one Celery app's ``send_task`` would.

    Reads the app's serializer and repr limits once. Raises
    :class:`~celery_sched.errors.InvalidJob` when the serializer is not
    available.
    """

    def __init__(self, app: Any) -> None:
        self.serializer: str = app.conf.task_serializer
        self.content_type, self.content_encoding = codec_of(self.serializer)
        self._argsrepr_max: int | None = app.amqp.argsrepr_maxsize
        self._kwargsrepr_max: int | None = app.amqp.kwargsrepr_maxsize
        maxlevels = app.conf.get("task_repr_maxlevels", _DEFAULT_REPR_MAXLEVELS)
        self._repr_maxlevels: int = _DEFAULT_REPR_MAXLEVELS if maxlevels is None else maxlevels
        # The flat-scalar fast path reproduces kombu's JSON output exactly;
        # only take it when the app uses kombu's own JSON encoder.
        self._fast_json = self.serializer == "json" and _registered_encoder("json") is (
            kombu_json_dumps
        )
        # Flat containers sit at repr level 1, which saferepr never elides
        # unless maxlevels is negative.
        self._fast_repr = self._repr_maxlevels >= 0

    def encode(
        self, task_name: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bytes, str, str]:
        """The protocol-2 body, serialized once, with its argsrepr and kwargsrepr.

        ``kwargs`` must have string keys (the caller checks). The reprs are
        made storable as PostgreSQL text. Raises
        :class:`~celery_sched.errors.InvalidArguments` when the serializer
        refuses the arguments.
        """
        fast = _flat_scalars(args, kwargs) if self._fast_repr else None
        if fast is None:
            return (
                self._serialize(task_name, args, kwargs),
                pg_text(self._saferepr_args(args)),
                pg_text(self._saferepr_kwargs(kwargs)),
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
            argsrepr = pg_text(argsrepr)
        if not kwargsrepr.isascii() or "\x00" in kwargsrepr:
            kwargsrepr = pg_text(kwargsrepr)
        if not self._fast_json:
            return self._serialize(task_name, args, kwargs), argsrepr, kwargsrepr
        body = (
            "[[" + ", ".join(arg_jsons) + "], {" + ", ".join(kwarg_jsons) + _EMBED_JSON_TAIL
        ).encode("ascii")
        return body, argsrepr, kwargsrepr

    def _serialize(
        self, task_name: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bytes:
        try:
            _ctype, _cenc, payload = dumps((args, kwargs, EMBED), serializer=self.serializer)
        except Exception as exc:  # serializers raise anything; all mean "cannot encode"
            cause = exc.__cause__ or exc
            raise InvalidArguments(
                f"arguments of task {task_name!r} cannot be serialized with "
                f"{self.serializer!r}: {type(cause).__name__}: {cause}"
            ) from exc
        if isinstance(payload, str):
            enc = self.content_encoding
            return payload.encode("utf-8" if enc in ("binary", "") else enc)
        return payload

    def _saferepr_args(self, args: list[Any] | tuple[Any, ...]) -> str:
        return saferepr(args, self._argsrepr_max, maxlevels=self._repr_maxlevels)

    def _saferepr_kwargs(self, kwargs: dict[str, Any]) -> str:
        return saferepr(kwargs, self._kwargsrepr_max, maxlevels=self._repr_maxlevels)


def codec_of(serializer: str) -> tuple[str, str]:
    """Content type and encoding of ``serializer`` (raises InvalidJob if unknown)."""
    try:
        content_type, content_encoding, _payload = dumps([], serializer=serializer)
    except Exception as exc:
        raise InvalidJob(f"task serializer {serializer!r} is not available: {exc}") from exc
    return content_type, content_encoding


def pg_text(text: str) -> str:
    """A repr made storable as PostgreSQL text (escaping NUL and lone surrogates)."""
    text = text.replace("\x00", "\\x00")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _registered_encoder(serializer: str) -> object:
    # kombu keeps its codec table private; without it the fast path is off.
    table = getattr(getattr(kombu.serialization, "registry", None), "_encoders", {})
    codec = table.get(serializer)
    return None if codec is None else codec[2]


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


# -- the Redis envelope --------------------------------------------------------------


class Destination(Protocol):
    """Where a message goes, as far as its envelope says."""

    @property
    def routing_key(self) -> str: ...

    @property
    def delivery_mode(self) -> int | None: ...


class PreparedMessage(Protocol):
    """A message ready to publish, as far as its envelope says."""

    @property
    def task_id(self) -> str: ...

    @property
    def body(self) -> bytes: ...

    @property
    def content_type(self) -> str: ...

    @property
    def content_encoding(self) -> str: ...

    @property
    def headers(self) -> dict[str, Any]: ...

    @property
    def route(self) -> Destination: ...

    @property
    def expiration(self) -> float | None: ...


_orjson_dumps = orjson.dumps
_b64encode = binascii.b2a_base64


def _dumps(value: Any) -> bytes:
    """JSON of ``value`` for a Redis message envelope.

    orjson is about ten times faster than ``json.dumps`` here, which is a
    fifth of the per-message cost of the publish path; anything it refuses
    (integers beyond 64 bits, say) goes through the standard encoder.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(value).encode()


def envelope_json(value: Any) -> bytes:
    """JSON of one part of a Redis message envelope (see :func:`_dumps`)."""
    return _dumps(value)


def envelope_head(content_encoding: str, content_type: str) -> bytes:
    """The part of a Redis envelope after its base64 body that names the
    body's encoding and type (open: the caller closes the body's string)."""
    return b"".join(
        (
            b'","content-encoding":',
            _dumps(content_encoding),
            b',"content-type":',
            _dumps(content_type),
        )
    )


class DeliveryTags:
    """Delivery tags for Redis envelopes. Kombu tags each message with a
    fresh uuid4; any string unique across publishers works, and a random
    per-publisher prefix plus a counter costs a fraction of a uuid4."""

    def __init__(self) -> None:
        self._template = uuid.uuid4().hex.encode() + b"-%d"
        self._counter = itertools.count()

    def next(self) -> bytes:
        return self._template % next(self._counter)


class RedisEnvelopes:
    """The JSON envelopes of one publish call, as Kombu's Redis transport writes them.

    The same object as ``{"body", "content-encoding", "content-type",
    "headers", "properties"}`` with Kombu's properties, but only the
    per-message parts (body, headers, task id, tag, expiration) are encoded
    per message; what a route and priority share is encoded once and
    spliced in. About half the cost of dumping the whole dict each time.
    """

    def __init__(self, reply_to: str) -> None:
        self._reply_to = _dumps(reply_to)
        self._tags = DeliveryTags()
        #: What a message's encoding, type, route and priority share: the
        #: parts before its headers and between its headers and task id.
        self._shared: dict[tuple[str, str, int, int], tuple[bytes, bytes]] = {}

    def encode(self, message: PreparedMessage, priority: int) -> bytes:
        route = message.route
        # Routes are cached by the dispatcher and outlive this call.
        shared_key = (message.content_encoding, message.content_type, id(route), priority)
        shared = self._shared.get(shared_key)
        if shared is None:
            shared = self._shared[shared_key] = self._shared_parts(message, route, priority)
        head, properties = shared
        expiration = b""
        if message.expiration is not None:
            milliseconds = int(max(message.expiration, 0.0) * 1000)
            expiration = b',"expiration":"%d"' % milliseconds
        try:
            # _dumps, inlined, and first without OPT_NON_STR_KEYS, which
            # costs half as much again: header names are strings but for
            # what a signal receiver may add (refused: TypeError).
            headers = _orjson_dumps(message.headers)
            task_id = _orjson_dumps(message.task_id)
        except TypeError:
            headers = _dumps(message.headers)
            task_id = _dumps(message.task_id)
        return b"".join(
            (
                b'{"body":"',
                _b64encode(message.body, newline=False),
                head,
                headers,
                properties,
                task_id,
                expiration,
                b',"delivery_tag":"',
                self._tags.next(),
                b'"}}',
            )
        )

    def _shared_parts(
        self, message: PreparedMessage, route: Destination, priority: int
    ) -> tuple[bytes, bytes]:
        head = envelope_head(message.content_encoding, message.content_type) + b',"headers":'
        properties = b"".join(
            (
                b',"properties":{"reply_to":',
                self._reply_to,
                b',"delivery_mode":',
                _dumps(route.delivery_mode),
                b',"delivery_info":',
                _dumps({"exchange": "", "routing_key": route.routing_key}),
                b',"priority":',
                _dumps(priority),
                b',"body_encoding":"base64","correlation_id":',
            )
        )
        return head, properties


# -- compression ---------------------------------------------------------------------

#: The header Kombu's publish sets on a compressed body; a consumer
#: decompresses by it before deserializing.
COMPRESSION_HEADER = "compression"


def compress_body(body: bytes, method: str) -> tuple[bytes, str]:
    """``body`` compressed by ``method`` (a :mod:`kombu.compression` name such
    as ``"zlib"``), with the value of its :data:`COMPRESSION_HEADER`: what
    ``Producer.publish(compression=method)`` sends. Raises ``KeyError`` for
    a method Kombu does not know."""
    compressed, content_type = kombu.compression.compress(body, method)
    return compressed, content_type


# -- Celery's publish signals --------------------------------------------------------

before_task_publish = signals.before_task_publish
after_task_publish = signals.after_task_publish


@dataclasses.dataclass(frozen=True, slots=True)
class Announced:
    """A message ``before_task_publish`` was sent for: what
    ``after_task_publish`` is sent with once the message is out, and the
    context both run in."""

    context: contextvars.Context
    sender: str
    body: Any
    headers: dict[str, Any]
    exchange: str
    routing_key: str


class PublishSignals:
    """Celery's ``before_task_publish`` and ``after_task_publish`` for the
    messages of one publish call, with the arguments ``send_task`` gives
    them (``celery.app.amqp.AMQP.send_task_message``): the task name as
    sender, the body as ``(args, kwargs, embed)``, the exchange, routing
    key, queues to declare, headers, properties and retry policy.

    A receiver may change ``headers`` in place (OpenTelemetry injects
    ``traceparent``); the dispatchers encode the message from them after
    :meth:`before`. The body and properties are given for reading only:
    the stored body is published as it is.

    Each message's two signals run in one copy of the caller's context, so
    what a receiver attaches to the context for a message (OpenTelemetry's
    active publish span) is neither the parent of the next message's span
    nor left behind when ``after_task_publish`` never comes (a failed
    publish, or a task the receiver does not know).
    """

    def __init__(
        self,
        *,
        reply_to: str,
        retry_policy: Mapping[str, Any],
        accept: frozenset[str] | None,
    ) -> None:
        self._reply_to = reply_to
        self._retry_policy = dict(retry_policy)
        self._accept = accept

    @staticmethod
    def connected() -> bool:
        """Whether any receiver listens to either signal (checked once per
        publish call: with none, a message costs nothing more)."""
        return bool(before_task_publish.receivers or after_task_publish.receivers)

    def before(
        self,
        *,
        task: str,
        task_id: str,
        body: bytes,
        content_type: str,
        content_encoding: str,
        headers: dict[str, Any],
        exchange: str,
        routing_key: str,
        declare: list[Any] | None,
        priority: int | None,
        expiration: float | None,
    ) -> Announced:
        """Send ``before_task_publish`` for one message, in a fresh copy of
        the current context."""
        properties: dict[str, Any] = {"correlation_id": task_id, "reply_to": self._reply_to}
        if priority is not None:
            properties["priority"] = priority
        if expiration is not None:
            properties["expiration"] = max(expiration, 0.0)
        announced = Announced(
            context=contextvars.copy_context(),
            sender=task,
            body=self._decoded(body, content_type, content_encoding, headers),
            headers=headers,
            exchange=exchange,
            routing_key=routing_key,
        )
        announced.context.run(
            before_task_publish.send,
            sender=task,
            body=announced.body,
            exchange=exchange,
            routing_key=routing_key,
            declare=declare,
            headers=headers,
            properties=properties,
            retry_policy=dict(self._retry_policy),
        )
        return announced

    @staticmethod
    def after(announced: Announced) -> None:
        """Send ``after_task_publish`` for a message once it is out, in the
        context its ``before_task_publish`` ran in."""
        announced.context.run(
            after_task_publish.send,
            sender=announced.sender,
            body=announced.body,
            headers=announced.headers,
            exchange=announced.exchange,
            routing_key=announced.routing_key,
        )

    def _decoded(
        self, body: bytes, content_type: str, content_encoding: str, headers: dict[str, Any]
    ) -> Any:
        """The body as ``send_task`` passes it, ``(args, kwargs, embed)``;
        the stored bytes when it cannot be decoded (a content type outside
        ``accept_content``)."""
        if self._accept is None:
            return body
        try:
            method = headers.get(COMPRESSION_HEADER)
            if method:
                body = kombu.compression.decompress(body, method)
            args, kwargs = decode_body(body, content_type, content_encoding, self._accept, "")
        except Exception:  # a codec raises anything; receivers then get the bytes
            return body
        return args, kwargs, dict(EMBED)
