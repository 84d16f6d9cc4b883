"""Publishing claimed jobs as Celery protocol-2 messages through Kombu.

The per-message path is kept short on purpose (the README's "Benchmarks" give
the figures): the body is published as the stored bytes, the constant part of
the headers is built once per batch, routes are resolved once per task name and
per-job destination (per job only when ``task_routes`` has a router that may
route by the arguments, which are then decoded), queues are declared once per
connection, and on transports that support it (Redis) the whole batch goes
through one ``Producer.batch()`` pipeline.

Why this module is over 700 lines: it is one class whose three publish paths
(Kombu's producer; py-amqp's ``basic_publish`` with properties from
:mod:`~celery_sched.dispatch.amqp_wire`; pipelined ``LPUSH`` of
:class:`~celery_sched.protocol.RedisEnvelopes` on Redis) share one
connection, one cache of declared queues and one chunk accounting of which
jobs count as sent, and the error classification at the top decides for all
three what is retried and what fails one destination. Which path a
connection uses is decided once per connection by
:func:`celery_sched.dispatch.fast_path.choose`. The message itself
(headers, body, envelope, expiry) is :mod:`celery_sched.protocol`'s.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import amqp
import amqp.exceptions
import redis.exceptions
from celery.app.defaults import DEFAULTS
from celery.app.routes import MapRoute
from celery.events.event import Event
from celery.utils.time import utcoffset
from kombu import Exchange, Queue
from kombu.common import Broadcast
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import (  # type: ignore[attr-defined]  # missing from kombu-stubs
    BatchPublishError,
    OperationalError,
)

from celery_sched.dispatch import fast_path
from celery_sched.dispatch.amqp_wire import EncodedMessage, PropertiesEncoder
from celery_sched.dispatch.fast_path import PublishPath, Sample
from celery_sched.dispatch.sent_events import SentEvents, sent_fields
from celery_sched.errors import CelerySchedError, PublishError
from celery_sched.interfaces import Dispatcher, PublishResult
from celery_sched.models import Job, accepted_content_types, decode_body
from celery_sched.protocol import (
    COMPRESSION_HEADER,
    KEY_HEADER,
    Announced,
    PublishSignals,
    RedisEnvelopes,
    TaskDefaults,
    base_headers,
    compress_body,
    is_expired,
    message_headers,
    send_expires_at,
    task_defaults,
)
from celery_sched.retry import call_with_retry
from celery_sched.settings import Settings, sanitize_url

logger = logging.getLogger(__name__)


class _ServerBusy(Exception):
    """A Redis error reply that speaks for the whole server (not one list)."""


#: Failures after which a fresh connection may succeed. Anything else raised
#: while publishing one message (an unroutable task, an unencodable header) is
#: that job's own failure and is not retried; an error reply for one Redis
#: list (WRONGTYPE) or a channel error declaring one queue or exchange fails
#: the jobs of that destination only.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    BatchPublishError,
    OSError,  # socket errors, ConnectionError, TimeoutError
    amqp.exceptions.ConnectionError,
    amqp.exceptions.ChannelError,
    redis.exceptions.ConnectionError,  # BusyLoadingError (LOADING) included
    redis.exceptions.TimeoutError,
    # Error replies about the server, not the key: a replica after a
    # failover, memory full, a cluster in transition.
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    _ServerBusy,
)

#: Error replies redis-py leaves unmapped that still concern the whole server.
_SERVER_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM", "BUSY")


def _server_wide(exc: redis.exceptions.ResponseError) -> bool:
    return isinstance(exc, TRANSIENT_ERRORS) or str(exc).startswith(_SERVER_REPLIES)


class _DestinationFailed(Exception):
    """Internal: one destination (queue, exchange, Redis list) refused its
    messages; ``ids`` are the jobs that were headed there."""

    def __init__(self, ids: list[uuid.UUID], reason: str) -> None:
        super().__init__(reason)
        self.ids = ids
        self.reason = reason


#: Messages flushed to Redis per pipeline round trip. After each flush those
#: jobs are known to be sent; a failure can only leave one chunk uncertain.
DEFAULT_CHUNK = 500

# ``Producer.batch`` flushes by itself when it holds ``max_size`` commands;
# we flush explicitly per chunk to know which jobs are sent, so this only
# has to exceed what one chunk can buffer.
_NO_AUTO_FLUSH = 1 << 30


def _always() -> bool:
    return True


def _push_lists(
    client: Any,
    lists: dict[str, list[bytes]],
    published: Sequence[tuple[str, bytes]] = (),
) -> dict[str, str]:
    """``LPUSH key *payloads`` for each list, then ``PUBLISH channel payload``
    for each of ``published`` (task-sent events): one write, one round trip.

    The commands are packed here: for hundreds of kilobyte-sized values a
    plain join is about ten times faster than redis-py's hiredis packer,
    which took an eighth of the dispatch loop's time. Kombu's
    ``global_keyprefix`` is applied as its own client applies it.

    Each list's reply is read on its own: an error reply about that key
    (WRONGTYPE: the queue name is a key of another type) is returned as
    ``{list: why}`` and the other lists count as written. An error about
    the server (READONLY, LOADING, ...) or any other failure is raised, the
    connection dropped so no unread reply is left on it. An error reply to
    a ``PUBLISH`` that is not about the server loses that event only: it is
    logged, and the messages count as written.
    """
    prefix = getattr(client, "global_keyprefix", None) or ""
    parts: list[bytes] = []
    append = parts.append
    for key, payloads in lists.items():
        name = (prefix + key).encode()
        append(b"*%d\r\n$5\r\nLPUSH\r\n$%d\r\n%s\r\n" % (len(payloads) + 2, len(name), name))
        for payload in payloads:
            append(b"$%d\r\n" % len(payload))
            append(payload)
            append(b"\r\n")
    for topic, payload in published:
        # Kombu's prefixed client prefixes PUBLISH channels too.
        name = (prefix + topic).encode()
        append(b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(payload)))
        append(payload)
        append(b"\r\n")
    pool = client.connection_pool
    conn = pool.get_connection()
    refused: dict[str, str] = {}
    try:
        conn.send_packed_command([b"".join(parts)])
        for key in lists:
            try:
                conn.read_response()
            except redis.exceptions.ResponseError as exc:
                if _server_wide(exc):
                    if isinstance(exc, TRANSIENT_ERRORS):
                        raise
                    raise _ServerBusy(str(exc)) from exc
                # The whole reply was read: the connection stays in step.
                refused[key] = f"Redis refused list {key!r}: {exc}"
        for topic, _ in published:
            try:
                conn.read_response()
            except redis.exceptions.ResponseError as exc:
                if _server_wide(exc):
                    if isinstance(exc, TRANSIENT_ERRORS):
                        raise
                    raise _ServerBusy(str(exc)) from exc
                logger.warning("Redis refused a task-sent event on %r: %s", topic, exc)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return refused


#: Job options ``send_task`` takes out of the options before it asks the
#: routers: they become headers, not routing.
_NOT_ROUTING = frozenset({"time_limit", "soft_time_limit", "ignore_result", "expires"})


def _routes_by_arguments(router: Any, task: str) -> bool:
    """Whether ``task_routes`` may route ``task`` by its arguments: a router
    other than a dict or glob map (a function, an import path, a router
    class) comes before any map entry matching the task name. Otherwise the
    route depends on the name and the job's destination options only."""
    for entry in router.routes:
        if not isinstance(entry, MapRoute):
            return True
        if entry(task) is not None:
            return False
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where messages of one (task, per-job destination) go, and what the
    task declares for them (time limits, ``expires``)."""

    exchange: str
    routing_key: str
    queue: str | None
    delivery_mode: int | None
    priority: int | None
    declare: Queue | Exchange | None
    defaults: TaskDefaults | None = None
    #: The body's compression (the task's, ``task_routes``' or the app's
    #: ``task_compression``); None: sent as stored.
    compression: str | None = None


@dataclasses.dataclass(slots=True)
class _Message:
    job_id: uuid.UUID
    task_id: str
    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    route: Route
    priority: int | None
    expiration: float | None
    #: Set once ``before_task_publish`` was sent for it (see _announce).
    announced: Announced | None = None


def _announce(signals: PublishSignals, message: _Message) -> None:
    """``before_task_publish`` for ``message``, once however often it is
    retried; a receiver's changes to the headers are in ``message.headers``
    before any path encodes them."""
    route = message.route
    headers = message.headers
    declare = route.declare
    message.announced = signals.before(
        task=headers["task"],
        task_id=message.task_id,
        body=message.body,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers=headers,
        exchange=route.exchange,
        routing_key=route.routing_key,
        declare=[declare] if isinstance(declare, Queue) else None,
        priority=message.priority,
        expiration=message.expiration,
    )


def _announce_sent(chunk: list[_Message], rejected: dict[uuid.UUID, str]) -> None:
    """``after_task_publish`` for each message of a chunk the broker took."""
    after = PublishSignals.after
    for message in chunk:
        announced = message.announced
        if announced is not None and message.job_id not in rejected:
            after(announced)


def _retry_schedule(conf: Any, settings: Settings) -> tuple[int, float, float]:
    """``(attempts, first delay, longest delay)`` of a publish.

    The settings' ``connect_retries`` and ``retry_backoff`` (delays
    doubling up to 5 s), unless the app's ``task_publish_retry_policy``
    differs from Celery's default: then ``max_retries + 1`` attempts (the
    settings' when ``max_retries`` is None, which Celery reads as forever),
    the first delay ``interval_start`` (``interval_step`` when that is 0),
    doubling up to ``interval_max``; missing keys take Celery's defaults.
    ``task_publish_retry = False`` makes one attempt.
    """
    if not conf.task_publish_retry:
        return 1, 0.0, 0.0
    policy = conf.task_publish_retry_policy
    default = DEFAULTS["task_publish_retry_policy"]
    if not policy or policy == default:
        return settings.connect_retries, settings.retry_backoff, 5.0
    merged = {**default, **policy}
    max_retries = merged["max_retries"]
    attempts = settings.connect_retries if max_retries is None else int(max_retries) + 1
    longest = max(float(merged["interval_max"]), 0.0)
    first = float(merged["interval_start"]) or float(merged["interval_step"])
    return max(attempts, 1), min(max(first, 0.0), longest), longest


def _amqp_wire(
    encode: Callable[..., bytes], message: _Message, default_mode: Any, reply_to: str
) -> bytes:
    """The encoded properties the py-amqp path sends for ``message``: what
    Kombu's publish gives py-amqp to encode (``fast_path`` checks it)."""
    expiration = message.expiration
    return encode(
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers=message.headers,
        delivery_mode=maybe_delivery_mode(message.route.delivery_mode or default_mode),
        priority=message.priority,
        correlation_id=message.task_id,
        reply_to=reply_to,
        expiration=None if expiration is None else str(int(max(expiration, 0.0) * 1000)),
    )


def _record_sent(
    chunk: list[_Message], rejected: dict[uuid.UUID, str], sent: list[uuid.UUID]
) -> None:
    """Count the jobs of a chunk the broker took as sent, except the rejected ones."""
    if rejected:
        sent.extend(m.job_id for m in chunk if m.job_id not in rejected)
    else:
        sent.extend(m.job_id for m in chunk)


def _sent_fields(message: _Message) -> dict[str, Any]:
    """The fields of Celery's own task-sent event for ``message``."""
    route = message.route
    return sent_fields(
        message.task_id, message.headers, route.queue, route.exchange, route.routing_key
    )


class KombuDispatcher(Dispatcher):
    """Publishes jobs to the app's broker as messages a stock worker runs.

    One long-lived connection and producer, created on the first publish and
    re-created after a connection failure. Not thread-safe: one dispatcher
    per engine thread.
    """

    def __init__(
        self,
        app: Any,
        settings: Settings,
        *,
        chunk: int = DEFAULT_CHUNK,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if chunk < 1:
            raise ValueError("chunk must be at least 1")
        self._app = app
        self._settings = settings
        self._chunk = chunk
        self._sleep = sleep
        conf = app.conf
        self._send_sent_event = bool(conf.task_send_sent_event)
        self._compression: str | None = conf.task_compression or None
        self._retry_policy: dict[str, Any] = dict(conf.task_publish_retry_policy or {})
        self._attempts, self._backoff, self._max_delay = _retry_schedule(conf, settings)
        self._default_delivery_mode = conf.task_default_delivery_mode
        self._default_priority: int | None = conf.task_default_priority
        # Like ``send_task``: results of a scheduled job, if any consumer
        # wants them over RPC, are addressed to this process.
        self._reply_to: str = app.thread_oid
        self._url = sanitize_url(app.connection_for_write().as_uri())
        self._routes: dict[tuple[str, Any, Any, Any], Route] = {}
        # Per task name: whether its route is computed per job (see
        # _routes_by_arguments); those routes are interned, since the Redis
        # envelopes cache per route object.
        self._by_arguments: dict[str, bool] = {}
        self._interned: dict[Route, Route] = {}
        self._accept: frozenset[str] | None = None
        self._connection: Any = None
        self._producer: Any = None
        self._events: Any = None
        # Task-sent events as the Redis fast path publishes them (events on, Redis).
        self._sent_events: SentEvents | None = None
        self._declared: set[Queue | Exchange] = set()
        # Exchanges of routes without a queue to declare, checked to exist
        # once per connection (RabbitMQ).
        self._exchanges_seen: set[str] = set()
        self._batching = False
        self._amqp = PropertiesEncoder()
        # The connection's publish path, chosen once per connection by
        # fast_path.choose (Kombu's publish until then).
        self._path = PublishPath.KOMBU
        #: The path chosen for the latest connection (None before the first).
        self.publish_path: PublishPath | None = None
        #: Messages sent so far by each path.
        self.sent_by_path: collections.Counter[PublishPath] = collections.Counter()
        # Reasons already logged at WARNING: one warning each, not one per reconnect.
        self._warned: set[str] = set()

    # -- public API ---------------------------------------------------------

    def publish(
        self,
        jobs: Sequence[Job],
        *,
        epoch: int,
        now: dt.datetime,
        may_publish: Callable[[], bool] | None = None,
    ) -> PublishResult:
        sent: list[uuid.UUID] = []
        failed: list[uuid.UUID] = []
        expired: list[uuid.UUID] = []
        rejected: dict[uuid.UUID, str] = {}
        todo = self._prepare(jobs, epoch=epoch, now=now, rejected=rejected, expired=expired)
        allowed = may_publish or _always
        # Once per call: with no receiver, no message pays for the signals.
        signals = self._signals() if todo and PublishSignals.connected() else None
        while todo:
            try:
                call_with_retry(
                    lambda: self._send(todo, sent, rejected, allowed, signals),
                    transient=TRANSIENT_ERRORS,
                    translate=lambda exc: PublishError(
                        f"publishing to {self._url} failed: {type(exc).__name__}: {exc}"
                    ),
                    what="publish",
                    url=self._url,
                    attempts=self._attempts,
                    backoff=self._backoff,
                    max_delay=self._max_delay,
                    sleep=self._sleep,
                )
            except _DestinationFailed as exc:
                # One queue or exchange refused: its jobs fail, the channel
                # it closed is reopened, the rest of the batch goes on.
                logger.error("cannot publish %d jobs: %s", len(exc.ids), exc.reason)
                for job_id in exc.ids:
                    rejected[job_id] = exc.reason
                self._reset()
                todo[:] = [m for m in todo if m.job_id not in rejected]
                continue
            except CelerySchedError as exc:
                # ``todo`` holds exactly the jobs not known to be sent.
                logger.error(
                    "could not publish %d of %d jobs to %s: %s",
                    len(todo),
                    len(jobs),
                    self._url,
                    exc,
                )
                failed.extend(m.job_id for m in todo if m.job_id not in rejected)
                todo.clear()
            break
        # Left unsent without an error: the lease ran out (may_publish).
        withheld = [m.job_id for m in todo if m.job_id not in rejected]
        return PublishResult(
            sent=sent, failed=failed, expired=expired, rejected=rejected, withheld=withheld
        )

    def close(self) -> None:
        self._reset()

    def _signals(self) -> PublishSignals:
        accept = self._accept
        if accept is None:
            try:
                accept = self._accept = accepted_content_types(self._app.conf.accept_content)
            except CelerySchedError:
                accept = None  # the receivers get the stored bytes
        return PublishSignals(
            reply_to=self._reply_to, retry_policy=self._retry_policy, accept=accept
        )

    # -- preparing messages (no I/O) ------------------------------------------

    def _prepare(
        self,
        jobs: Sequence[Job],
        *,
        epoch: int,
        now: dt.datetime,
        rejected: dict[uuid.UUID, str],
        expired: list[uuid.UUID],
    ) -> list[_Message]:
        base = base_headers(origin=self._settings.hostname, epoch=epoch)
        todo: list[_Message] = []
        append = todo.append
        prepare = self._message
        for job in jobs:
            if is_expired(job, now):
                expired.append(job.id)
                continue
            try:
                append(prepare(job, base, now))
            except Exception as exc:
                # Unroutable (a queue missing from task_queues) or a header
                # that cannot be built: the same on every attempt.
                logger.exception("cannot publish job %s (task %s)", job.key, job.task)
                reason = exc if isinstance(exc, PublishError) else repr(exc)
                rejected[job.id] = str(reason)
        return todo

    def _message(self, job: Job, base: dict[str, Any], now: dt.datetime) -> _Message:
        routes = self._routes
        options = job.options
        if options:
            route_key = (
                job.task,
                options.get("queue"),
                options.get("exchange"),
                options.get("routing_key"),
            )
        else:
            route_key = (job.task, None, None, None)
        route = routes.get(route_key)
        if route is None:
            try:
                route = self._route(job, route_key)
            except Exception as exc:
                raise PublishError(f"cannot route task {job.task!r}: {exc!r}") from exc
        priority = route.priority
        compression = route.compression
        if options:
            if "priority" in options:
                priority = options["priority"]
            if "compression" in options:
                compression = options["compression"]
        expires_at = job.expires_at
        if expires_at is None and job.schedule_id is not None:
            expires_at = send_expires_at(job, now, route.defaults)
        expiration = None
        if expires_at is not None:
            # Celery sets the AMQP TTL from ``expires`` too, so RabbitMQ
            # drops the message rather than delivering it late.
            expiration = (expires_at - now).total_seconds()
        task_id = str(job.id)
        headers = message_headers(
            base, job, task_id, expires_at=expires_at, defaults=route.defaults
        )
        body = job.body
        if compression:
            # As Kombu's publish does it, so every path sends the same bytes.
            body, headers[COMPRESSION_HEADER] = compress_body(body, compression)
        return _Message(
            job.id,
            task_id,
            body,
            job.content_type,
            job.content_encoding,
            headers,
            route,
            priority,
            expiration,
        )

    def _route(self, job: Job, route_key: tuple[str, Any, Any, Any]) -> Route:
        """The route of ``job``, not found in the cache of ``route_key``s:
        resolved once and cached, or, when ``task_routes`` may route the
        task by its arguments, resolved for this job alone."""
        task = job.task
        by_arguments = self._by_arguments.get(task)
        if by_arguments is None:
            by_arguments = self._by_arguments[task] = _routes_by_arguments(
                self._app.amqp.router, task
            )
        if not by_arguments:
            route = self._routes[route_key] = self._resolve_route(*route_key)
            return route
        accept = self._accept
        if accept is None:
            accept = self._accept = accepted_content_types(self._app.conf.accept_content)
        args, kwargs = decode_body(
            job.body,
            job.content_type,
            job.content_encoding,
            accept,
            f"the body of job {job.key!r}",
        )
        route = self._resolve_route(
            task,
            None,
            None,
            None,
            args=args,
            kwargs=kwargs,
            job_options=job.options,
        )
        return self._interned.setdefault(route, route)

    def _resolve_route(
        self,
        task: str,
        queue: Any,
        exchange: Any,
        routing_key: Any,
        *,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        job_options: Any = None,
    ) -> Route:
        """Route like ``send_task``: task options < task_routes < the job's own.

        The routers get what ``send_task`` gives them: the task name, the
        job's ``args`` and ``kwargs`` (empty when the route is cached per
        task name: only maps are configured for it) and the options, the
        task's own under the job's.
        """
        app = self._app
        amqp_ = app.amqp
        options: dict[str, Any] = {}
        task_type = app.tasks.get(task)
        if task_type is not None:
            for name in ("queue", "exchange", "routing_key", "priority", "compression"):
                value = getattr(task_type, name, None)
                if value is not None:
                    options[name] = value
        for name, value in (("queue", queue), ("exchange", exchange), ("routing_key", routing_key)):
            if value is not None:
                options[name] = value
        if job_options:
            for name, value in job_options.items():
                if name not in _NOT_ROUTING:
                    options[name] = value
        route = amqp_.router.route(options, task, args, kwargs or {}, task_type)

        dest = route.get("queue")
        exch = route.get("exchange")
        rkey = route.get("routing_key")
        if dest is None and exch is None:
            dest = amqp_.default_queue
        if isinstance(dest, str):
            dest = amqp_.queues[dest]
        qname = dest.name if dest is not None else None

        delivery_mode = route.get("delivery_mode")
        if delivery_mode is None and dest is not None:
            delivery_mode = dest.exchange.delivery_mode
        delivery_mode = maybe_delivery_mode(delivery_mode or self._default_delivery_mode)

        exchange_type = route.get("exchange_type")
        if exchange_type is None:
            exchange_type = dest.exchange.type if dest is not None else "direct"
        declare: Queue | Exchange | None = None
        if (not exch or not rkey) and exchange_type == "direct":
            # The default exchange delivers straight to the queue named by
            # the routing key: no exchange lookup on the broker.
            exch, rkey = "", qname
        elif exch is None:
            exch = dest.exchange.name or amqp_.default_exchange.name
            rkey = rkey or dest.routing_key or app.conf.task_default_routing_key
        if dest is not None and not isinstance(dest, Broadcast):
            declare = dest
        elif isinstance(exch, Exchange):
            declare = exch
        if isinstance(exch, Exchange):
            exch = exch.name
        priority = route.get("priority", self._default_priority)
        return Route(
            exchange=exch or "",
            routing_key=rkey or "",
            queue=qname,
            delivery_mode=delivery_mode,
            priority=priority,
            declare=declare,
            defaults=task_defaults(task_type),
            compression=route.get("compression") or self._compression,
        )

    # -- I/O ------------------------------------------------------------------

    def _connect(self) -> Any:
        if self._producer is None:
            connection = self._app.connection_for_write()
            try:
                # Bounded: one connection attempt; call_with_retry owns the backoff.
                connection.connect()
                channel = connection.channel()
                self._producer = self._app.amqp.Producer(channel, auto_declare=False)
            except BaseException:
                with contextlib.suppress(Exception):
                    connection.release()
                raise
            self._connection = connection
            self._declared = set()
            self._exchanges_seen = set()
            self._batching = bool(self._producer.supports_batch_publish)
            if self._send_sent_event:
                self._events = self._app.events.Dispatcher(
                    connection,
                    hostname=self._settings.hostname,
                    # We pass our producer to publish(); the dispatcher's own
                    # producer would be an idle second channel.
                    enabled=False,
                    # A failed event must fail the batch, not sit in a buffer.
                    buffer_while_offline=False,
                )
                if hasattr(channel, "_get_publish_topics"):  # Kombu's Redis channel
                    self._sent_events = SentEvents(self._events, channel)
            self._choose_path(self._producer)
            logger.debug("connected to broker %s", self._url)
        return self._producer

    def _choose_path(self, producer: Any) -> None:
        """Decide this connection's publish path (see :mod:`fast_path`)."""
        encode = self._amqp.properties
        default_mode = producer.exchange.delivery_mode

        def redis_fast(sample: Sample) -> tuple[str, bytes]:
            written: list[tuple[str, bytes]] = []

            def push(
                client: Any,
                lists: dict[str, list[bytes]],
                published: Sequence[tuple[str, bytes]] = (),
            ) -> dict[str, str]:
                written.extend(
                    (key, payload) for key, payloads in lists.items() for payload in payloads
                )
                return {}

            self._send_redis(producer, [self._sample_message(sample)], [], {}, _always, push)
            if len(written) != 1:
                raise RuntimeError(f"the Redis path wrote {len(written)} values for one message")
            return written[0]

        def amqp_fast(sample: Sample) -> bytes:
            return _amqp_wire(encode, self._sample_message(sample), default_mode, self._reply_to)

        events, sent_events = self._events, self._sent_events

        def sent_event_kombu(sample: Sample, factory: Callable[..., dict[str, Any]]) -> None:
            self._send_event(events, producer, self._sample_message(sample), factory)

        def sent_event_fast(sample: Sample, event: dict[str, Any]) -> list[tuple[str, bytes]]:
            assert sent_events is not None
            payload = sent_events.encode(
                self._sample_message(sample),
                clock=event["clock"],
                timestamp=event["timestamp"],
                utcoffset=utcoffset(),
            )
            return [(topic, payload) for topic in sent_events.topics]

        with_events = self._send_sent_event

        choice = fast_path.choose(
            producer,
            mode=self._settings.fast_publish,
            # Task-sent events on the Redis path need our own encoder of them.
            redis_eligible=self._batching and (not with_events or sent_events is not None),
            samples=self._samples(),
            reply_to=self._reply_to,
            redis_fast=redis_fast,
            amqp_fast=amqp_fast,
            sent_event_kombu=sent_event_kombu if with_events else None,
            sent_event_fast=sent_event_fast if with_events else None,
        )
        self._path = self.publish_path = choice.path
        if choice.warn and choice.reason not in self._warned:
            self._warned.add(choice.reason)
            logger.warning(
                "publishing to %s through Kombu's producer, not the fast path: %s",
                self._url,
                choice.reason,
            )
        elif choice.reason:
            logger.debug("publishing to %s through Kombu's producer: %s", self._url, choice.reason)
        else:
            logger.debug("publishing to %s by the %s fast path", self._url, choice.path)

    def _samples(self) -> list[Sample]:
        """Messages shaped like the ones this dispatcher sends (protocol-2
        headers with nested, non-ASCII and null values), with and without
        priority and expiry, for comparing a fast path with Kombu."""
        task_id = "00000000-0000-4000-8000-000000000000"
        headers = base_headers(origin=self._settings.hostname, epoch=7)
        headers.update(
            task="celery_sched.probe",
            id=task_id,
            root_id=task_id,
            argsrepr="(1, 'é')",
            kwargsrepr="{'n': [1, None, 2.5]}",
            expires="2030-01-01T00:00:00+00:00",
            celery_sched_key="probe-ключ",
            celery_sched_attempt=2,
            x_custom={"nested": [True, None, "\u2603", 2**40]},
        )
        body = b'[[1, "\\u00e9"], {"n": [1, null, 2.5]}, {"callbacks": null}]'
        common: dict[str, Any] = {
            "body": body,
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "headers": headers,
            "routing_key": "celery_sched.fast_path_probe",
            "task_id": task_id,
        }
        return [
            Sample(**common, delivery_mode=2, priority=None, expiration=None),
            Sample(**common, delivery_mode=1, priority=5, expiration=12.5),
        ]

    @staticmethod
    def _sample_message(sample: Sample) -> _Message:
        route = Route(
            exchange="",
            routing_key=sample.routing_key,
            queue=sample.routing_key,
            delivery_mode=sample.delivery_mode,
            priority=sample.priority,
            declare=None,
        )
        return _Message(
            uuid.UUID(sample.task_id),
            sample.task_id,
            sample.body,
            sample.content_type,
            sample.content_encoding,
            sample.headers,
            route,
            sample.priority,
            sample.expiration,
        )

    def _reset(self) -> None:
        producer, connection, events = self._producer, self._connection, self._events
        self._producer = self._connection = self._events = None
        self._sent_events = None
        self._declared = set()
        self._exchanges_seen = set()
        if events is not None:
            with contextlib.suppress(Exception):
                events.close()
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.channel.close()
        if connection is not None:
            # A broken socket can fail on close; the connection is dropped anyway.
            with contextlib.suppress(Exception):
                connection.release()

    def _send(
        self,
        todo: list[_Message],
        sent: list[uuid.UUID],
        rejected: dict[uuid.UUID, str],
        allowed: Callable[[], bool],
        signals: PublishSignals | None = None,
    ) -> None:
        """Publish ``todo``, removing each job from it once it is known to be sent.

        What "known to be sent" means: on a batching transport (Redis), every
        job of a chunk whose pipeline executed; when a flush fails, the
        broker may or may not have applied that chunk, so its jobs stay in
        ``todo`` and are published again (a duplicate is acceptable, a loss
        is not). On other transports (RabbitMQ) a job is sent once
        ``basic_publish`` wrote it to the socket; a message lost after that
        (connection dropped before the broker read it) is recovered by the
        reconciler after the visibility timeout. Set ``confirm_publish`` in
        ``broker_transport_options`` to have every publish wait for the
        broker's acknowledgement instead.

        A job whose own message cannot be published (not a broker failure)
        goes to ``rejected`` and is skipped by later attempts. A queue or
        exchange the broker refuses raises :class:`_DestinationFailed` for
        the jobs headed there. Before each chunk ``allowed()`` is asked; on
        ``False`` this returns with the rest left in ``todo``.

        With ``signals``, each message gets ``before_task_publish`` before it
        is encoded (once, however often it is retried) and
        ``after_task_publish`` once it counts as sent.
        """
        done = 0
        already_sent = len(sent)
        path = PublishPath.KOMBU
        try:
            producer = self._connect()
            if self._redis_direct(producer, todo):
                path = PublishPath.REDIS
                self._send_redis(producer, todo, sent, rejected, allowed, signals=signals)
                return
            chunk = self._chunk if self._batching else 1
            events = self._events if self._send_sent_event else None
            publish = producer.publish
            channel = producer.channel
            direct = self._path is PublishPath.AMQP
            if direct:
                path = PublishPath.AMQP
                basic_publish = channel.basic_publish
                encode = self._amqp.properties
                default_mode = producer.exchange.delivery_mode
            reply_to = self._reply_to
            declared = self._declared
            seen = self._exchanges_seen
            # Publishing to a missing exchange closes the channel, and RabbitMQ
            # drops what follows on it unread: check such exchanges first.
            check_exchanges = isinstance(channel, amqp.Channel)
            total = len(todo)
            with producer.batch(max_size=_NO_AUTO_FLUSH) as batch:
                while done < total:
                    if not allowed():
                        return
                    end = min(done + chunk, total)
                    for index in range(done, end):
                        message = todo[index]
                        if rejected and message.job_id in rejected:
                            continue
                        route = message.route
                        entity = route.declare
                        if (entity is not None and entity not in declared) or (
                            check_exchanges and route.exchange and route.exchange not in seen
                        ):
                            self._declare(channel, route, todo, index, check_exchanges)
                        try:
                            if signals is not None and message.announced is None:
                                _announce(signals, message)
                            if direct:
                                # What Kombu's publish sends on py-amqp, byte
                                # for byte (fast_path checks it per connection).
                                wire = _amqp_wire(encode, message, default_mode, reply_to)
                                basic_publish(
                                    EncodedMessage(message.body, wire),
                                    exchange=route.exchange,
                                    routing_key=route.routing_key,
                                )
                            else:
                                properties: dict[str, Any] = {}
                                if message.expiration is not None:
                                    properties["expiration"] = max(message.expiration, 0.0)
                                publish(
                                    message.body,
                                    exchange=route.exchange,
                                    routing_key=route.routing_key,
                                    content_type=message.content_type,
                                    content_encoding=message.content_encoding,
                                    headers=message.headers,
                                    delivery_mode=route.delivery_mode,
                                    priority=message.priority,
                                    correlation_id=message.task_id,
                                    reply_to=reply_to,
                                    **properties,
                                )
                            if events is not None:
                                self._send_event(events, producer, message)
                        except TRANSIENT_ERRORS:
                            raise
                        except Exception as exc:
                            logger.exception(
                                "cannot publish job %s (task %s)",
                                message.headers.get(KEY_HEADER),
                                message.headers.get("task"),
                            )
                            rejected[message.job_id] = repr(exc)
                    try:
                        batch.flush()
                    except BatchPublishError as exc:
                        cause = exc.__cause__
                        if not isinstance(cause, redis.exceptions.ResponseError) or _server_wide(
                            cause
                        ):
                            raise
                        # An error reply for one list inside Kombu's pipeline
                        # cannot be told apart from the rest of the chunk.
                        raise _DestinationFailed(
                            [m.job_id for m in todo[done:end] if m.job_id not in rejected],
                            f"Redis refused a publish batch: {cause}",
                        ) from exc
                    _record_sent(todo[done:end], rejected, sent)
                    if signals is not None:
                        _announce_sent(todo[done:end], rejected)
                    done = end
        except TRANSIENT_ERRORS:
            self._reset()
            raise
        finally:
            del todo[:done]
            self.sent_by_path[path] += len(sent) - already_sent

    def _declare(
        self,
        channel: Any,
        route: Route,
        todo: list[_Message],
        index: int,
        check_exchange: bool = False,
    ) -> None:
        """Declare ``route``'s queue or exchange once per connection, so a
        message to a new queue is not dropped; with ``check_exchange``
        (RabbitMQ) also check that its exchange exists, since a publish to a
        missing one closes the channel and what follows on it is dropped.

        An error about this destination (RabbitMQ: NOT_FOUND, ACCESS_REFUSED,
        PRECONDITION_FAILED for a queue declared with other arguments; Redis:
        WRONGTYPE, the queue's name holds another type) fails the jobs of
        ``todo[index:]`` going there, and only those.
        """
        entity = route.declare
        where = f"queue {route.queue!r}" if route.queue else f"exchange {route.exchange!r}"
        try:
            if entity is not None and entity not in self._declared:
                entity.bind(channel).declare()
                self._declared.add(entity)
            if check_exchange and route.exchange and route.exchange not in self._exchanges_seen:
                where = f"exchange {route.exchange!r}"
                channel.exchange_declare(route.exchange, "direct", passive=True)
                self._exchanges_seen.add(route.exchange)
        except (amqp.exceptions.ChannelError, redis.exceptions.ResponseError) as exc:
            if isinstance(exc, redis.exceptions.ResponseError) and _server_wide(exc):
                raise
            if isinstance(exc, amqp.exceptions.RecoverableChannelError):
                raise  # e.g. a resource locked for now: retried whole
            raise _DestinationFailed(
                [m.job_id for m in todo[index:] if m.route == route],
                f"the broker refused {where}: {type(exc).__name__}: {exc}",
            ) from exc

    def _redis_direct(self, producer: Any, todo: list[_Message]) -> bool:
        """Whether ``todo`` can skip Kombu's per-message publish machinery.

        Only where :func:`fast_path.choose` allowed it for the connection
        (Redis, batch publishing, task-sent events as Kombu would publish
        them), for messages to the default exchange (the queue
        is the Redis list), without queue expiry.
        """
        if self._path is not PublishPath.REDIS:
            return False
        expiring = producer.channel._expires
        return all(m.route.exchange == "" and m.route.routing_key not in expiring for m in todo)

    def _send_redis(
        self,
        producer: Any,
        todo: list[_Message],
        sent: list[uuid.UUID],
        rejected: dict[uuid.UUID, str],
        allowed: Callable[[], bool],
        push: Callable[..., dict[str, str]] | None = None,
        *,
        signals: PublishSignals | None = None,
    ) -> None:
        """Write each chunk as one pipelined ``LPUSH`` per destination list.

        The envelope is exactly what Kombu's Redis transport writes for a
        ``basic_publish`` to the default exchange (``virtual.Channel.
        prepare_message`` + ``_inplace_augment_message`` + ``_put``), so a
        stock worker consumes it; building it here saves most of the
        per-message Python work (the publish benchmark measures the gain).
        Multi-value ``LPUSH`` keeps FIFO order: the worker pops from the
        right. Chunk accounting is the same as in :meth:`_send`; a list
        Redis refuses (WRONGTYPE) fails only the jobs written to it.
        ``push`` writes the lists (the start-up comparison records them;
        default :func:`_push_lists`).

        With task-sent events on, each message's event (:class:`SentEvents`)
        is ``PUBLISH``ed in the same round trip, after the chunk's
        ``LPUSH``es: an event never announces a message not yet written.
        """
        if push is None:
            push = _push_lists  # looked up per call, so a test can replace it
        channel = producer.channel
        envelope = RedisEnvelopes(self._reply_to).encode
        declared = self._declared
        min_priority, max_priority = channel.min_priority, channel.max_priority
        q_for_pri = channel._q_for_pri
        keys: dict[tuple[str, int], str] = {}
        sent_events = self._sent_events if self._send_sent_event else None
        if sent_events is not None:
            encode_event = sent_events.encode
            topics = sent_events.topics
            forward = sent_events.clock.forward
        published: list[tuple[str, bytes]] = []
        offset = 0.0
        done = 0
        total = len(todo)
        try:
            with channel.conn_or_acquire() as client:
                while done < total:
                    if not allowed():
                        return
                    end = min(done + self._chunk, total)
                    lists: dict[str, list[bytes]] = {}
                    if sent_events is not None:
                        published = []
                        offset = utcoffset()
                    for index in range(done, end):
                        message = todo[index]
                        if rejected and message.job_id in rejected:
                            continue
                        route = message.route
                        entity = route.declare
                        if entity is not None and entity not in declared:
                            self._declare(channel, route, todo, index)
                        try:
                            if signals is not None and message.announced is None:
                                _announce(signals, message)
                            priority = message.priority or 0
                            priority = max(min(int(priority), max_priority), min_priority)
                            payload = envelope(message, priority)
                            if sent_events is not None:
                                event = encode_event(
                                    message,
                                    clock=forward(),
                                    timestamp=time.time(),
                                    utcoffset=offset,
                                )
                                published.extend((topic, event) for topic in topics)
                        except (TypeError, ValueError) as exc:
                            logger.exception(
                                "cannot encode job %s (task %s)",
                                message.headers.get(KEY_HEADER),
                                message.headers.get("task"),
                            )
                            rejected[message.job_id] = f"cannot encode the message: {exc!r}"
                            continue
                        list_key = (route.routing_key, priority)
                        key = keys.get(list_key)
                        if key is None:
                            key = keys[list_key] = q_for_pri(route.routing_key, priority)
                        payloads = lists.get(key)
                        if payloads is None:
                            lists[key] = [payload]
                        else:
                            payloads.append(payload)
                    if published:
                        refused = push(client, lists, published)
                    else:
                        refused = push(client, lists) if lists else {}
                    if refused:
                        # Rare: attribute each job of the chunk to its list.
                        for index in range(done, end):
                            message = todo[index]
                            if message.job_id in rejected:
                                continue
                            priority = message.priority or 0
                            priority = max(min(int(priority), max_priority), min_priority)
                            why = refused.get(keys[(message.route.routing_key, priority)])
                            if why is not None:
                                rejected[message.job_id] = why
                    _record_sent(todo[done:end], rejected, sent)
                    if signals is not None:
                        _announce_sent(todo[done:end], rejected)
                    done = end
        finally:
            del todo[:done]

    def _send_event(
        self, events: Any, producer: Any, message: _Message, event: Callable[..., Any] = Event
    ) -> None:
        events.publish("task-sent", _sent_fields(message), producer, Event=event)
