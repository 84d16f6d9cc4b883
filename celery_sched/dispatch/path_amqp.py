"""The py-amqp path: each message through ``Channel.basic_publish`` directly.

On RabbitMQ (py-amqp) Kombu's publish spends most of its time building and
encoding the message properties, the Celery headers table above all. This
path encodes them with :mod:`~celery_sched.dispatch.amqp_wire` into what
Kombu's publish would give py-amqp to encode, byte for byte
(:func:`celery_sched.dispatch.fast_path.choose` compares samples per
connection), and hands py-amqp an already encoded message. A message counts
as sent once ``basic_publish`` wrote it to the socket.
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
) -> None:
    """Publish ``todo`` one message at a time (py-amqp does not batch),
    removing each job from it once ``basic_publish`` wrote it (see
    :meth:`KombuDispatcher._send <celery_sched.dispatch.kombu.KombuDispatcher._send>`).

    Every exchange is checked to exist before the first message to it: a
    publish to a missing exchange closes the channel, and RabbitMQ drops
    what follows on it unread.

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
    if sent_events is not None:
        sent_events.declare(producer)
        event_message = sent_events.message
        event_exchange = sent_events.exchange
        forward = sent_events.clock.forward
        begun = -chunk
    done = 0
    total = len(todo)
    try:
        while done < total:
            if not allowed():
                return
            if sent_events is not None and done - begun >= chunk:
                sent_events.begin(utcoffset())
                begun = done
            message = todo[done]
            end = done + 1
            if not (rejected and message.job_id in rejected):
                route = message.route
                entity = route.declare
                if (entity is not None and entity not in declared) or (
                    route.exchange and route.exchange not in seen
                ):
                    conn.declare(route, todo, done, True)
                try:
                    if signals is not None and message.announced is None:
                        announce(signals, message)
                    wire = properties(encode, message, default_mode, reply_to)
                    basic_publish(
                        EncodedMessage(message.body, wire),
                        exchange=route.exchange,
                        routing_key=route.routing_key,
                    )
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
            record_sent(todo[done:end], rejected, sent)
            if signals is not None:
                announce_sent(todo[done:end], rejected)
            done = end
    finally:
        del todo[:done]
