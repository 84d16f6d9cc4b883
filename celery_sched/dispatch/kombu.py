"""KombuDispatcher: claimed jobs published as Celery protocol-2 messages.

The dispatcher prepares each job's message once (headers from
:mod:`celery_sched.protocol`, the route from :mod:`.routing`), then
publishes the batch on one broker connection (:mod:`.connection`) by one of
three paths, chosen once per connection by
:func:`celery_sched.dispatch.fast_path.choose`:

- :mod:`.path_redis`: on Redis, each chunk as one pipelined ``LPUSH`` per
  list of envelopes written by :class:`~celery_sched.protocol.RedisEnvelopes`,
  task-sent events sent by ``PUBLISH`` in the same round trip;
- :mod:`.path_amqp`: on RabbitMQ (py-amqp), the ``basic.publish`` frames
  written by :mod:`.amqp_wire` (properties and frames byte for byte as
  py-amqp writes them), a chunk per socket write with publisher confirms,
  each task-sent event right after its message;
- :mod:`.path_kombu`: Kombu's ``Producer.publish``, on any transport, and
  wherever a fast path is refused.

The per-message work is kept short on purpose (the README's "Benchmarks"
give the figures): the body is published as the stored bytes, the constant
part of the headers is built once per batch, routes are resolved once per
task name and per-job destination, queues are declared once per
connection, and the fast paths write task-sent events themselves
(:mod:`.sent_events`).

All three keep the same books (:mod:`.outgoing`: a job counts as sent once
its chunk is written, on RabbitMQ once the broker confirmed it, never
before) and classify failures alike (:mod:`.failures`). What stays here:
preparing messages, the retry of a whole publish, what a failure does to
the batch, and the per-connection choice of path with the samples it
compares.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import amqp
from celery.app.defaults import DEFAULTS
from kombu.utils.functional import fxrange

from celery_sched.dispatch import fast_path, path_amqp, path_kombu, path_redis
from celery_sched.dispatch.amqp_wire import PropertiesEncoder
from celery_sched.dispatch.connection import PublishConnection
from celery_sched.dispatch.failures import TRANSIENT_ERRORS, DestinationFailed
from celery_sched.dispatch.fast_path import AmqpEvent, PublishPath, Sample
from celery_sched.dispatch.outgoing import DEFAULT_CHUNK, OutgoingMessage, always
from celery_sched.dispatch.routing import Route, TaskRoutes
from celery_sched.dispatch.sent_events import ROUTING_KEY, AmqpSentEvents, SentEvents
from celery_sched.errors import CelerySchedError, PublishError
from celery_sched.interfaces import Dispatcher, PublishResult
from celery_sched.models import Job, accepted_content_types
from celery_sched.protocol import (
    COMPRESSION_HEADER,
    PublishSignals,
    base_headers,
    compress_body,
    is_expired,
    message_headers,
    send_expires_at,
)
from celery_sched.retry import call_with_retry
from celery_sched.settings import Settings, sanitize_url

logger = logging.getLogger(__name__)


def _retry_schedule(conf: Any, settings: Settings) -> tuple[int, tuple[float, float, float] | None]:
    """``(attempts, policy)`` of a publish; ``policy`` is ``None`` or the
    ``(interval_start, interval_step, interval_max)`` the delays follow.

    The settings' ``connect_retries`` and ``retry_backoff`` (delays doubling
    up to 5 s, ``policy`` None) unless the app's ``task_publish_retry_policy``
    differs from Celery's default: then ``max_retries + 1`` attempts (the
    settings' when ``max_retries`` is None, which Celery reads as forever)
    and the delays Kombu sleeps between them (:func:`_policy_delays`);
    missing keys take Celery's defaults. ``task_publish_retry = False``
    makes one attempt.
    """
    if not conf.task_publish_retry:
        return 1, None
    policy = conf.task_publish_retry_policy
    default = DEFAULTS["task_publish_retry_policy"]
    if not policy or policy == default:
        return settings.connect_retries, None
    merged = {**default, **policy}
    max_retries = merged["max_retries"]
    attempts = settings.connect_retries if max_retries is None else int(max_retries) + 1
    intervals = (
        max(float(merged["interval_start"]), 0.0),
        max(float(merged["interval_step"]), 0.0),
        max(float(merged["interval_max"]), 0.0),
    )
    return max(attempts, 1), intervals


def _policy_delays(start: float, step: float, longest: float) -> Iterator[float]:
    """The seconds Kombu waits before each retry of a publish under a retry
    policy (``Connection.ensure`` reconnecting through ``retry_over_time``):
    ``interval_start``, then ``interval_step`` more each time, within
    ``interval_max``."""
    for value in fxrange(start, longest + start, step, repeatlast=True):
        yield min(value, longest)


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
        self._retry_policy: dict[str, Any] = dict(conf.task_publish_retry_policy or {})
        self._attempts, self._intervals = _retry_schedule(conf, settings)
        self._backoff = settings.retry_backoff
        # Like ``send_task``: results of a scheduled job, if any consumer
        # wants them over RPC, are addressed to this process.
        self._reply_to: str = app.thread_oid
        self._url = sanitize_url(app.connection_for_write().as_uri())
        self._accept: frozenset[str] | None = None
        self._router = TaskRoutes(app, accept=self._accepted)
        self._routes = self._router.cache
        self._conn: PublishConnection | None = None
        # Task-sent events as the fast paths write them (events on): on
        # Redis, and on py-amqp (None when the sample check sends them
        # through Kombu).
        self._sent_events: SentEvents | None = None
        self._amqp_events: AmqpSentEvents | None = None
        self._amqp = PropertiesEncoder()
        # The connection's publish path, chosen once per connection by
        # fast_path.choose (Kombu's publish until then).
        self._path = PublishPath.KOMBU
        #: The path chosen for the latest connection (None before the first).
        self.publish_path: PublishPath | None = None
        #: The path the latest connection's task-sent events take: the fast
        #: path's, or Kombu's (None with events off or before the first).
        self.sent_events_path: PublishPath | None = None
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
        # Nacked by the broker (publisher confirms): released like ``failed``.
        released: list[uuid.UUID] = []
        expired: list[uuid.UUID] = []
        rejected: dict[uuid.UUID, str] = {}
        todo = self._prepare(jobs, epoch=epoch, now=now, rejected=rejected, expired=expired)
        allowed = may_publish or always
        # Once per call: with no receiver, no message pays for the signals.
        signals = self._signals() if todo and PublishSignals.connected() else None
        while todo:
            try:
                call_with_retry(
                    lambda: self._send(todo, sent, rejected, allowed, signals, released),
                    transient=TRANSIENT_ERRORS,
                    translate=lambda exc: PublishError(
                        f"publishing to {self._url} failed: {type(exc).__name__}: {exc}"
                    ),
                    what="publish",
                    url=self._url,
                    attempts=self._attempts,
                    backoff=self._backoff,
                    delays=None if self._intervals is None else _policy_delays(*self._intervals),
                    sleep=self._sleep,
                )
            except DestinationFailed as exc:
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
        failed.extend(released)
        # Left unsent without an error: the lease ran out (may_publish).
        withheld = [m.job_id for m in todo if m.job_id not in rejected]
        return PublishResult(
            sent=sent, failed=failed, expired=expired, rejected=rejected, withheld=withheld
        )

    def close(self) -> None:
        self._reset()

    def _accepted(self) -> frozenset[str]:
        """The app's ``accept_content`` as content types (raises when invalid)."""
        accept = self._accept
        if accept is None:
            accept = self._accept = accepted_content_types(self._app.conf.accept_content)
        return accept

    def _signals(self) -> PublishSignals:
        try:
            accept: frozenset[str] | None = self._accepted()
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
    ) -> list[OutgoingMessage]:
        base = base_headers(origin=self._settings.hostname, epoch=epoch)
        todo: list[OutgoingMessage] = []
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

    def _message(self, job: Job, base: dict[str, Any], now: dt.datetime) -> OutgoingMessage:
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
        route = self._routes.get(route_key)
        if route is None:
            try:
                route = self._router.resolve(job, route_key)
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
        return OutgoingMessage(
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

    # -- I/O ------------------------------------------------------------------

    def _connect(self) -> PublishConnection:
        conn = self._conn
        if conn is None:
            conn = self._conn = PublishConnection(
                self._app,
                hostname=self._settings.hostname,
                send_sent_event=self._send_sent_event,
                confirms=self._settings.publish_confirms,
                confirm_timeout=self._settings.publish_confirm_timeout,
            )
            if conn.events is not None:
                if isinstance(conn.channel, amqp.Channel):
                    self._amqp_events = AmqpSentEvents(conn.events, conn.producer, self._amqp)
                elif hasattr(conn.channel, "_get_publish_topics"):  # Kombu's Redis channel
                    self._sent_events = SentEvents(conn.events, conn.channel)
            self._choose_path(conn)
            logger.debug("connected to broker %s", self._url)
        return conn

    def _choose_path(self, conn: PublishConnection) -> None:
        """Decide this connection's publish path (see :mod:`fast_path`)."""
        producer = conn.producer
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

            path_redis.send(
                conn,
                [self._sample_message(sample)],
                [],
                {},
                always,
                None,
                chunk=self._chunk,
                reply_to=self._reply_to,
                sent_events=self._sent_events if self._send_sent_event else None,
                push=push,
            )
            if len(written) != 1:
                raise RuntimeError(f"the Redis path wrote {len(written)} values for one message")
            return written[0]

        def amqp_fast(sample: Sample) -> bytes:
            message = self._sample_message(sample)
            return path_amqp.properties(encode, message, default_mode, self._reply_to)

        events, sent_events = conn.events, self._sent_events

        def sent_event_kombu(sample: Sample, factory: Callable[..., dict[str, Any]]) -> None:
            path_kombu.send_sent_event(events, producer, self._sample_message(sample), factory)

        def sent_event_fast(sample: Sample, event: dict[str, Any]) -> list[tuple[str, bytes]]:
            assert sent_events is not None
            sent_events.begin(event["utcoffset"])
            message = self._sample_message(sample)
            payload = sent_events.encode(message, event["clock"], event["timestamp"])
            return [(topic, payload) for topic in sent_events.topics]

        amqp_events = self._amqp_events

        def amqp_event_fast(sample: Sample, event: dict[str, Any]) -> AmqpEvent:
            assert amqp_events is not None
            amqp_events.begin(event["utcoffset"])
            message = self._sample_message(sample)
            encoded = amqp_events.message(message, event["clock"], event["timestamp"])
            body = encoded.body
            assert isinstance(body, bytes)
            return AmqpEvent(
                exchange=amqp_events.exchange,
                routing_key=ROUTING_KEY,
                properties=encoded._serialize_properties(),
                body=body,
            )

        with_events = self._send_sent_event

        choice = fast_path.choose(
            producer,
            mode=self._settings.fast_publish,
            # Task-sent events on the Redis path need our own encoder of them.
            redis_eligible=conn.batching and (not with_events or sent_events is not None),
            samples=self._samples(),
            reply_to=self._reply_to,
            redis_fast=redis_fast,
            amqp_fast=amqp_fast,
            sent_event_kombu=sent_event_kombu if with_events else None,
            sent_event_fast=sent_event_fast if with_events else None,
            amqp_event_fast=amqp_event_fast if amqp_events is not None else None,
        )
        self._path = self.publish_path = choice.path
        if not choice.sent_events:
            self._amqp_events = None
        if with_events:
            self.sent_events_path = choice.path if choice.sent_events else PublishPath.KOMBU
        # What goes through Kombu: everything, or the task-sent events only.
        what = "" if choice.path is PublishPath.KOMBU else "task-sent events "
        if choice.warn and choice.reason not in self._warned:
            self._warned.add(choice.reason)
            logger.warning(
                "publishing %sto %s through Kombu's producer, not the fast path: %s",
                what,
                self._url,
                choice.reason,
            )
        elif choice.reason:
            logger.debug(
                "publishing %sto %s through Kombu's producer: %s", what, self._url, choice.reason
            )
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
    def _sample_message(sample: Sample) -> OutgoingMessage:
        route = Route(
            exchange="",
            routing_key=sample.routing_key,
            queue=sample.routing_key,
            delivery_mode=sample.delivery_mode,
            priority=sample.priority,
            declare=None,
        )
        return OutgoingMessage(
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
        conn = self._conn
        self._conn = None
        self._sent_events = None
        self._amqp_events = None
        if conn is not None:
            conn.close()

    def _send(
        self,
        todo: list[OutgoingMessage],
        sent: list[uuid.UUID],
        rejected: dict[uuid.UUID, str],
        allowed: Callable[[], bool],
        signals: PublishSignals | None = None,
        released: list[uuid.UUID] | None = None,
    ) -> None:
        """Publish ``todo``, removing each job from it once it is known to be sent.

        What "known to be sent" means: on a batching transport (Redis), every
        job of a chunk whose pipeline executed; when a flush fails, the
        broker may or may not have applied that chunk, so its jobs stay in
        ``todo`` and are published again (a duplicate is acceptable, a loss
        is not). On RabbitMQ (py-amqp), with publisher confirms (the default
        ``celery_sched_publish_confirms``), every job of a chunk the broker
        confirmed; a chunk whose confirms are missing (timeout, connection
        lost) stays in ``todo`` and is published again, and a nacked
        message's job goes to ``released`` (not sent, not the job's fault).
        With confirms off, or on another transport, a job is sent once
        ``basic_publish`` wrote it to the socket; a message lost after that
        (connection dropped before the broker read it) is recovered by the
        reconciler after the visibility timeout.

        A job whose own message cannot be published (not a broker failure)
        goes to ``rejected`` and is skipped by later attempts. A queue or
        exchange the broker refuses raises :class:`DestinationFailed` for
        the jobs headed there. Before each chunk ``allowed()`` is asked; on
        ``False`` this returns with the rest left in ``todo``.

        With ``signals``, each message gets ``before_task_publish`` before it
        is encoded (once, however often it is retried) and
        ``after_task_publish`` once it counts as sent.
        """
        already_sent = len(sent)
        if released is None:
            released = []
        path = PublishPath.KOMBU
        try:
            conn = self._connect()
            if self._path is PublishPath.REDIS and path_redis.eligible(conn, todo):
                path = PublishPath.REDIS
                path_redis.send(
                    conn,
                    todo,
                    sent,
                    rejected,
                    allowed,
                    signals,
                    chunk=self._chunk,
                    reply_to=self._reply_to,
                    sent_events=self._sent_events if self._send_sent_event else None,
                )
            elif self._path is PublishPath.AMQP:
                path = PublishPath.AMQP
                path_amqp.send(
                    conn,
                    todo,
                    sent,
                    rejected,
                    allowed,
                    signals,
                    chunk=self._chunk,
                    encode=self._amqp.properties,
                    reply_to=self._reply_to,
                    sent_events=self._amqp_events,
                    released=released,
                )
            else:
                path_kombu.send(
                    conn,
                    todo,
                    sent,
                    rejected,
                    allowed,
                    signals,
                    # Publisher confirms are awaited per chunk.
                    chunk=self._chunk if conn.batching or conn.confirms is not None else 1,
                    reply_to=self._reply_to,
                    released=released,
                )
        except TRANSIENT_ERRORS:
            self._reset()
            raise
        finally:
            self.sent_by_path[path] += len(sent) - already_sent
