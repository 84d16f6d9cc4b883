"""A dispatcher's broker connection and what is known on it.

All three publish paths publish on one :class:`PublishConnection`: Kombu's
connection, one channel with the app's producer on it, the queues and
exchanges declared on it so far, and, with ``task_send_sent_event``, a
Celery event dispatcher bound to it. The dispatcher opens one on its first
publish and drops it whole after a connection failure, so nothing learned on
a lost connection (a declared queue) is trusted on the next.
"""

from __future__ import annotations

import contextlib
from typing import Any

import amqp.exceptions
import redis.exceptions
from kombu import Exchange, Queue

from celery_sched.dispatch.failures import DestinationFailed, server_wide
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.dispatch.routing import Route


class PublishConnection:
    """One broker connection: ``producer`` (the app's, ``auto_declare``
    off) on its ``channel``, and ``events`` (a Celery event dispatcher that
    publishes through our producer, or None with task-sent events off)."""

    def __init__(self, app: Any, *, hostname: str, send_sent_event: bool) -> None:
        connection = app.connection_for_write()
        try:
            # Bounded: one connection attempt; call_with_retry owns the backoff.
            connection.connect()
            channel = connection.channel()
            producer = app.amqp.Producer(channel, auto_declare=False)
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
