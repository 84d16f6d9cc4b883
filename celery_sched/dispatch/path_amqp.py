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

from amqp.exceptions import RecoverableConnectionError
from celery.utils.time import utcoffset
from kombu.entity import maybe_delivery_mode

from celery_sched.dispatch.amqp_wire import PublishFrames
from celery_sched.dispatch.connection import PublishConnection
from celery_sched.dispatch.failures import TRANSIENT_ERRORS
from celery_sched.dispatch.outgoing import (
    OutgoingMessage,
    announce,
    announce_sent,
    record_sent,
)
from celery_sched.dispatch.path_kombu import reject, send_sent_event
from celery_sched.dispatch.sent_events import ROUTING_KEY, AmqpSentEvents
from celery_sched.protocol import PublishSignals

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


#: A chunk's frames, and each of its messages with the number of its
#: publish in the chunk (1-based; with Celery's event dispatcher writing the
#: events, the channel's own publish count instead).
_Encoded = tuple[list[bytes], list[tuple[int, OutgoingMessage]], int]


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
    """Publish ``todo``, removing each job from it once it is known to be
    sent (see :meth:`KombuDispatcher._send
    <celery_sched.dispatch.kombu.KombuDispatcher._send>`).

    With publisher confirms (``conn.confirms``) the messages go out in
    chunks of ``chunk``, each chunk's frames in one socket write: a chunk's
    jobs count as sent once the broker confirmed the whole chunk; a nacked
    message's job goes to ``released``; a missing confirm (timeout, lost
    channel or connection) raises, leaving the chunk in ``todo`` to be sent
    again. While the broker works on a chunk, the next one is encoded (not
    written: nothing goes out before the chunk ahead of it is confirmed).
    Without confirms each message is written on its own and its job counts
    as sent once it is written to the socket.

    Every exchange is checked to exist before a chunk is written: a publish
    to a missing exchange closes the channel, and RabbitMQ drops what
    follows on it unread.

    With task-sent events on, each message's event follows it: written by
    ``sent_events`` (its shared parts once per ``chunk`` messages) when
    the start-up comparison allowed it, else by Celery's event dispatcher
    (each message then written on its own, before its event).
    """
    producer = conn.producer
    channel = conn.channel
    connection = channel.connection
    if connection is None:
        raise RecoverableConnectionError("basic_publish: connection closed")
    write = connection.transport.write
    frames = PublishFrames(channel.channel_id, connection.frame_max).frames
    default_mode = producer.exchange.delivery_mode
    events = conn.events
    declared = conn.declared
    seen = conn.exchanges_seen
    confirms = conn.confirms
    step = 1 if confirms is None else chunk
    # Celery's event dispatcher writes each event itself, so each message is
    # written before its event, never buffered.
    kombu_events = sent_events is None and events is not None
    if sent_events is not None:
        sent_events.declare(producer)
        event_body = sent_events.body
        event_properties = sent_events.properties
        event_exchange = sent_events.exchange
        forward = sent_events.clock.forward
    begun = -chunk

    def encode_chunk(start: int, end: int) -> _Encoded:
        nonlocal begun
        out: list[bytes] = []
        tagged: list[tuple[int, OutgoingMessage]] = []
        count = 0
        for index in range(start, end):
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
                data = frames(route.exchange, route.routing_key, wire, message.body)
                if sent_events is not None:
                    event = frames(
                        event_exchange,
                        ROUTING_KEY,
                        event_properties,
                        event_body(message, forward(), time.time()),
                    )
                    out.append(data)
                    out.append(event)
                    count += 2
                    tag = count - 1
                elif kombu_events:
                    write(data)
                    connection.bytes_sent += 1
                    tag = 0
                    if confirms is not None:
                        confirms.published += 1
                        tag = confirms.published
                    # Through the channel's basic_publish, counted by confirms.
                    send_sent_event(events, producer, message)
                else:
                    out.append(data)
                    count += 1
                    tag = count
            except TRANSIENT_ERRORS:
                raise
            except Exception as exc:
                reject(rejected, message, exc, logger)
            else:
                tagged.append((tag, message))
        return out, tagged, count

    done = 0
    total = len(todo)
    ahead: _Encoded | None = None
    try:
        while done < total:
            end = min(done + step, total)
            if not allowed():
                return
            # A refused destination raises before any message of the chunk is out.
            for index in range(done, end):
                route = todo[index].route
                entity = route.declare
                if (
                    (entity is not None and entity not in declared)
                    or (route.exchange and route.exchange not in seen)
                ) and not (rejected and todo[index].job_id in rejected):
                    conn.declare(route, todo, index, True)
            out, tagged, count = ahead if ahead is not None else encode_chunk(done, end)
            ahead = None
            base = 0 if kombu_events or confirms is None else confirms.published
            if out:
                data = b"".join(out)
                out.clear()
                write(data)
                connection.bytes_sent += 1
            taken = todo[done:end]
            if confirms is not None:
                confirms.published += count
                if end < total and not kombu_events:
                    # Encoded while the broker works on this chunk; written
                    # only once this chunk is confirmed.
                    ahead = encode_chunk(end, min(end + step, total))
                if base:
                    tagged = [(base + tag, message) for tag, message in tagged]
                taken = confirms.settle(taken, tagged, released)
            record_sent(taken, rejected, sent)
            if signals is not None:
                announce_sent(taken, rejected)
            done = end
    finally:
        del todo[:done]
