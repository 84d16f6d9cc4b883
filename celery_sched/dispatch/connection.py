"""A dispatcher's broker connection and what is known on it.

All three publish paths publish on one :class:`PublishConnection`: Kombu's
connection, one channel with the app's producer on it, the queues and
exchanges declared on it so far, and, with ``task_send_sent_event``, a
Celery event dispatcher bound to it. The dispatcher opens one on its first
publish and drops it whole after a connection failure, so nothing learned on
a lost connection (a declared queue) is trusted on the next.

On py-amqp (RabbitMQ) the channel is in publisher-confirm mode unless
``celery_sched_publish_confirms`` is off (:class:`Confirms`): the paths
publish a chunk, then wait for the broker to confirm all of it before any
of its jobs counts as sent.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import amqp
import amqp.exceptions
import redis.exceptions
from kombu import Exchange, Queue

from celery_sched.dispatch.failures import ConfirmTimeout, DestinationFailed, server_wide
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.dispatch.routing import Route

logger = logging.getLogger(__name__)


class Confirms:
    """Publisher confirms on one py-amqp channel, awaited per chunk.

    In confirm mode RabbitMQ numbers every ``basic.publish`` on the channel
    1, 2, ... (the delivery tag) and later acks or nacks each number, one
    at a time or all up to one (``multiple``), in no promised order. This
    counts every publish on the channel (our messages, task-sent events,
    Kombu's ``Producer.publish``: it wraps the channel's ``basic_publish``)
    so a path can note each message's tag, and :meth:`settle` waits for a
    chunk's confirms and tells which of its messages were nacked.

    Why per chunk: py-amqp's own confirm mode (``confirm_publish``) waits
    for each message's ack before the next publish, one round trip per
    message (about 1.5k messages/s here); waiting once per chunk pays one
    round trip, and RabbitMQ's fsync of persistent messages, per chunk, and
    a lost connection leaves at most one chunk uncertain.
    """

    def __init__(self, channel: Any, *, timeout: float) -> None:
        channel.confirm_select()
        self.timeout = timeout
        #: The tag of the latest publish on the channel.
        self.published = 0
        # Every tag up to ``_floor`` is settled; ``_above`` holds settled tags above it.
        self._floor = 0
        self._above: set[int] = set()
        self._nacked: set[int] = set()
        self._drain: Callable[..., Any] = channel.connection.drain_events
        channel.events["basic_ack"].add(self._ack)
        channel.events["basic_nack"].add(self._nack)
        # py-amqp's unconfirmed publish, also where ``confirm_publish`` made
        # ``basic_publish`` wait for every single ack.
        raw = channel._basic_publish

        def basic_publish(*args: Any, **kwargs: Any) -> Any:
            result = raw(*args, **kwargs)
            self.published += 1
            return result

        channel.basic_publish = basic_publish
        channel._confirm_selected = True

    def _ack(self, tag: int, multiple: bool) -> None:
        self._settled(tag, multiple, nack=False)

    def _nack(self, tag: int, multiple: bool) -> None:
        self._settled(tag, multiple, nack=True)

    def _settled(self, tag: int, multiple: bool, *, nack: bool) -> None:
        floor = self._floor
        above = self._above
        if multiple:
            if tag <= floor:
                return
            if nack:
                self._nacked.update(t for t in range(floor + 1, tag + 1) if t not in above)
            if above:
                above.difference_update([t for t in above if t <= tag])
            floor = tag
        elif tag > floor:
            if nack:
                self._nacked.add(tag)
            above.add(tag)
        while above and floor + 1 in above:
            floor += 1
            above.remove(floor)
        self._floor = floor

    def wait(self, upto: int) -> set[int]:
        """Wait until every tag up to ``upto`` is acked or nacked; return the
        nacked ones. :class:`ConfirmTimeout` after ``timeout`` seconds; a
        lost connection or channel raises py-amqp's (transient) error."""
        if self._floor < upto:
            deadline = time.monotonic() + self.timeout
            drain = self._drain
            while self._floor < upto:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConfirmTimeout(
                        f"RabbitMQ confirmed publishes up to {self._floor} of {upto} "
                        f"within {self.timeout} s"
                    )
                try:
                    drain(timeout=remaining)
                except TimeoutError as exc:  # socket.timeout
                    raise ConfirmTimeout(
                        f"RabbitMQ confirmed publishes up to {self._floor} of {upto} "
                        f"within {self.timeout} s"
                    ) from exc
        nacked = self._nacked
        if not nacked:
            return nacked
        mine = {tag for tag in nacked if tag <= upto}
        nacked -= mine
        return mine

    def settle(
        self,
        chunk: list[OutgoingMessage],
        tagged: list[tuple[int, OutgoingMessage]],
        released: list[uuid.UUID],
    ) -> list[OutgoingMessage]:
        """Wait for the confirms of the chunk's publishes; return the
        messages of ``chunk`` the broker took. The jobs of nacked messages
        (``tagged``: each published message with its tag) go to
        ``released``: not sent, and not the job's fault."""
        if not tagged:
            return chunk
        nacked = self.wait(self.published)
        if not nacked:
            return chunk
        ids = {message.job_id for tag, message in tagged if tag in nacked}
        if not ids:
            return chunk  # only task-sent events were nacked
        logger.warning("RabbitMQ nacked %d messages; releasing their jobs", len(ids))
        released.extend(m.job_id for m in chunk if m.job_id in ids)
        return [m for m in chunk if m.job_id not in ids]


class PublishConnection:
    """One broker connection: ``producer`` (the app's, ``auto_declare``
    off) on its ``channel``, and ``events`` (a Celery event dispatcher that
    publishes through our producer, or None with task-sent events off)."""

    def __init__(
        self,
        app: Any,
        *,
        hostname: str,
        send_sent_event: bool,
        confirms: bool = True,
        confirm_timeout: float = 10.0,
    ) -> None:
        connection = app.connection_for_write()
        try:
            # Bounded: one connection attempt; call_with_retry owns the backoff.
            connection.connect()
            channel = connection.channel()
            producer = app.amqp.Producer(channel, auto_declare=False)
            confirming = None
            if confirms and isinstance(channel, amqp.Channel):
                confirming = Confirms(channel, timeout=confirm_timeout)
            events = None
            if send_sent_event:
                events = app.events.Dispatcher(
                    connection,
                    hostname=hostname,
                    # We pass our producer to publish(); the dispatcher's own
                    # producer would be an idle second channel.
                    enabled=False,
                    # A failed event must fail the batch, not sit in a buffer.
                    buffer_while_offline=False,
                )
        except BaseException:
            with contextlib.suppress(Exception):
                connection.release()
            raise
        self.connection: Any = connection
        self.producer: Any = producer
        self.channel: Any = channel
        self.events: Any = events
        #: Publisher confirms on the channel (py-amqp with confirms on), else None.
        self.confirms: Confirms | None = confirming
        #: Whether the transport pipelines a ``Producer.batch()`` (Redis).
        self.batching = bool(producer.supports_batch_publish)
        self.declared: set[Queue | Exchange] = set()
        #: Exchanges of routes without a queue to declare, checked to exist
        #: once per connection (RabbitMQ).
        self.exchanges_seen: set[str] = set()

    def declare(
        self,
        route: Route,
        todo: list[OutgoingMessage],
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
        channel = self.channel
        where = f"queue {route.queue!r}" if route.queue else f"exchange {route.exchange!r}"
        try:
            if entity is not None and entity not in self.declared:
                entity.bind(channel).declare()
                self.declared.add(entity)
            if check_exchange and route.exchange and route.exchange not in self.exchanges_seen:
                where = f"exchange {route.exchange!r}"
                channel.exchange_declare(route.exchange, "direct", passive=True)
                self.exchanges_seen.add(route.exchange)
        except (amqp.exceptions.ChannelError, redis.exceptions.ResponseError) as exc:
            if isinstance(exc, redis.exceptions.ResponseError) and server_wide(exc):
                raise
            if isinstance(exc, amqp.exceptions.RecoverableChannelError):
                raise  # e.g. a resource locked for now: retried whole
            raise DestinationFailed(
                [m.job_id for m in todo[index:] if m.route == route],
                f"the broker refused {where}: {type(exc).__name__}: {exc}",
            ) from exc

    def close(self) -> None:
        """Close the event dispatcher, the channel and the connection; a
        broken socket may fail on close, and the connection is dropped anyway."""
        if self.events is not None:
            with contextlib.suppress(Exception):
                self.events.close()
        with contextlib.suppress(Exception):
            self.channel.close()
        with contextlib.suppress(Exception):
            self.connection.release()
