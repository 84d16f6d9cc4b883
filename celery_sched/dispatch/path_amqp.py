"""The py-amqp path: each message through ``Channel.basic_publish`` directly.

On RabbitMQ (py-amqp) Kombu's publish spends most of its time building and
encoding the message properties, the Celery headers table above all. This
path encodes them with :mod:`~celery_sched.dispatch.amqp_wire` into what
Kombu's publish would give py-amqp to encode, byte for byte
(:func:`celery_sched.dispatch.fast_path.choose` compares samples per
connection), and hands py-amqp an already encoded message.

With publisher confirms (the default, ``celery_sched_publish_confirms``) a
chunk of messages is published, then its confirms are awaited
(:class:`~celery_sched.dispatch.connection.Confirms`): only then do its
jobs count as sent; a nacked message's job is released, and a chunk left
unconfirmed (timeout, lost connection) is published again on a fresh
connection, so a broker restart loses nothing and resends at most that
chunk. Measured on the 2-core machine (``benchmarks/publish.py --broker
amqp://...``, 500 a chunk): about as fast as raw py-amqp publishing with
confirms awaited the same way, several times py-amqp's own confirm mode
that waits for each message. Without confirms a message counts as sent once
``basic_publish`` wrote it to the socket.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery.utils.time import utcoffset
from kombu.entity import maybe_delivery_mode

from celery_sched.dispatch.amqp_wire import EncodedMessage
from celery_sched.dispatch.connection import PublishConnection
from celery_sched.dispatch.failures import TRANSIENT_ERRORS
from celery_sched.dispatch.outgoing import (
    OutgoingMessage,
    announce,
    announce_sent,
    record_sent,
)
from celery_sched.dispatch.path_kombu import send_sent_event
from celery_sched.dispatch.sent_events import ROUTING_KEY, AmqpSentEvents
from celery_sched.protocol import KEY_HEADER, PublishSignals

logger = logging.getLogger(__name__)


def properties(
    encode: Callable[..., bytes], message: OutgoingMessage, default_mode: Any, reply_to: str
) -> bytes:
    """The encoded properties this path sends for ``message``: what
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


def send(
    conn: PublishConnection,
    todo: list[OutgoingMessage],
    sent: list[uuid.UUID],
    rejected: dict[uuid.UUID, str],
    allowed: Callable[[], bool],
    signals: PublishSignals | None,
    *,
    chunk: int,
    encode: Callable[..., bytes],
    reply_to: str,
    sent_events: AmqpSentEvents | None,
    released: list[uuid.UUID],
) -> None:
    """Publish ``todo`` one message at a time (py-amqp does not batch),
    removing each job from it once it is known to be sent (see
    :meth:`KombuDispatcher._send <celery_sched.dispatch.kombu.KombuDispatcher._send>`).

    With publisher confirms (``conn.confirms``) the messages go out in
    chunks of ``chunk``: a chunk's jobs count as sent once the broker
    confirmed the whole chunk; a nacked message's job goes to ``released``;
    a missing confirm (timeout, lost channel or connection) raises, leaving
    the chunk in ``todo`` to be sent again. Without confirms a job counts
    as sent once ``basic_publish`` wrote it to the socket.

    Every exchange is checked to exist before the first message to it (for
    a chunk: before its first message is published): a publish to a missing
    exchange closes the channel, and RabbitMQ drops what follows on it unread.

    With task-sent events on, each message's event follows it: written by
    ``sent_events`` (its shared parts once per ``chunk`` messages) when
    the start-up comparison allowed it, else by Celery's event dispatcher.
    """
    producer = conn.producer
    basic_publish = conn.channel.basic_publish
    default_mode = producer.exchange.delivery_mode
    events = conn.events
    declared = conn.declared
    seen = conn.exchanges_seen
    confirms = conn.confirms
    step = 1 if confirms is None else chunk
    if sent_events is not None:
        sent_events.declare(producer)
        event_message = sent_events.message
        event_exchange = sent_events.exchange
        forward = sent_events.clock.forward
        begun = -chunk
    done = 0
    total = len(todo)
    tagged: list[tuple[int, OutgoingMessage]] = []
    try:
        while done < total:
            if not allowed():
                return
            end = min(done + step, total)
            # Declarations first: a refused destination raises before any
            # message of the chunk is out.
            for index in range(done, end):
                route = todo[index].route
                entity = route.declare
                if (
                    (entity is not None and entity not in declared)
                    or (route.exchange and route.exchange not in seen)
                ) and not (rejected and todo[index].job_id in rejected):
                    conn.declare(route, todo, index, True)
            for index in range(done, end):
                if sent_events is not None and index - begun >= chunk:
                    sent_events.begin(utcoffset())
                    begun = index
                message = todo[index]
                if rejected and message.job_id in rejected:
                    continue
                route = message.route
                try:
                    if signals is not None and message.announced is None:
                        announce(signals, message)
                    wire = properties(encode, message, default_mode, reply_to)
                    basic_publish(
                        EncodedMessage(message.body, wire),
                        exchange=route.exchange,
                        routing_key=route.routing_key,
                    )
                    if confirms is not None:
                        tag = confirms.published
                    if sent_events is not None:
                        basic_publish(
                            event_message(message, forward(), time.time()),
                            exchange=event_exchange,
                            routing_key=ROUTING_KEY,
                        )
                    elif events is not None:
                        send_sent_event(events, producer, message)
                except TRANSIENT_ERRORS:
                    raise
                except Exception as exc:
                    logger.exception(
                        "cannot publish job %s (task %s)",
                        message.headers.get(KEY_HEADER),
                        message.headers.get("task"),
                    )
                    rejected[message.job_id] = repr(exc)
                else:
                    if confirms is not None:
                        tagged.append((tag, message))
            taken = todo[done:end]
            if confirms is not None:
                taken = confirms.settle(taken, tagged, released)
                tagged.clear()
            record_sent(taken, rejected, sent)
            if signals is not None:
                announce_sent(taken, rejected)
            done = end
    finally:
        del todo[:done]
