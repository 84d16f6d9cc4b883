"""The Kombu path: each message through ``Producer.publish``.

Any transport, and the fallback of the fast paths (see
:func:`celery_sched.dispatch.fast_path.choose`). On a transport that
supports it (Redis) a chunk goes through one ``Producer.batch()`` pipeline,
flushed per chunk so that the jobs of each flush are known to be sent.
Task-sent events go through Celery's own event dispatcher, one per message,
right after it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import amqp
import redis.exceptions
from celery.events.event import Event
from kombu.exceptions import (  # type: ignore[attr-defined]  # missing from kombu-stubs
    BatchPublishError,
)

from celery_sched.dispatch.connection import PublishConnection
from celery_sched.dispatch.failures import TRANSIENT_ERRORS, DestinationFailed, server_wide
from celery_sched.dispatch.outgoing import (
    OutgoingMessage,
    announce,
    announce_sent,
    record_sent,
)
from celery_sched.dispatch.sent_events import sent_fields
from celery_sched.protocol import KEY_HEADER, PublishSignals

logger = logging.getLogger(__name__)

# ``Producer.batch`` flushes by itself when it holds ``max_size`` commands;
# we flush explicitly per chunk to know which jobs are sent, so this only
# has to exceed what one chunk can buffer.
_NO_AUTO_FLUSH = 1 << 30


def send(
    conn: PublishConnection,
    todo: list[OutgoingMessage],
    sent: list[uuid.UUID],
    rejected: dict[uuid.UUID, str],
    allowed: Callable[[], bool],
    signals: PublishSignals | None,
    *,
    chunk: int,
    reply_to: str,
    released: list[uuid.UUID],
) -> None:
    """Publish ``todo`` in chunks of ``chunk`` (1 without batch publishing),
    removing each job from it once it is known to be sent (see
    :meth:`KombuDispatcher._send <celery_sched.dispatch.kombu.KombuDispatcher._send>`).

    An error reply for one Redis list inside Kombu's pipeline cannot be told
    apart from the rest of the chunk: the chunk's jobs fail together.
    """
    producer = conn.producer
    channel = conn.channel
    publish = producer.publish
    events = conn.events
    declared = conn.declared
    seen = conn.exchanges_seen
    # Publishing to a missing exchange closes the channel, and RabbitMQ
    # drops what follows on it unread: check such exchanges first.
    check_exchanges = isinstance(channel, amqp.Channel)
    # Publisher confirms (RabbitMQ): each published message with its tag.
    confirms = conn.confirms
    tagged: list[tuple[int, OutgoingMessage]] = []
    done = 0
    total = len(todo)
    try:
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
                        conn.declare(route, todo, index, check_exchanges)
                    try:
                        if signals is not None and message.announced is None:
                            announce(signals, message)
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
                        if confirms is not None:
                            tag = confirms.published
                        if events is not None:
                            send_sent_event(events, producer, message)
                    except TRANSIENT_ERRORS:
                        raise
                    except Exception as exc:
                        reject(rejected, message, exc, logger)
                    else:
                        if confirms is not None:
                            tagged.append((tag, message))
                try:
                    batch.flush()
                except BatchPublishError as exc:
                    cause = exc.__cause__
                    if not isinstance(cause, redis.exceptions.ResponseError) or server_wide(cause):
                        raise
                    raise DestinationFailed(
                        [m.job_id for m in todo[done:end] if m.job_id not in rejected],
                        f"Redis refused a publish batch: {cause}",
                    ) from exc
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


def reject(
    rejected: dict[uuid.UUID, str], message: Any, exc: Exception, log: logging.Logger
) -> None:
    """Note that ``message`` cannot be published (its job is failed, not
    retried: the message itself is at fault), with the traceback in ``log``."""
    log.exception(
        "cannot publish job %s (task %s)",
        message.headers.get(KEY_HEADER),
        message.headers.get("task"),
    )
    rejected[message.job_id] = repr(exc)


def send_sent_event(
    events: Any, producer: Any, message: OutgoingMessage, event: Callable[..., Any] = Event
) -> None:
    """Celery's task-sent event for ``message``, published by ``events``
    (Celery's event dispatcher) on ``producer``, as ``send_task`` does it;
    ``event`` builds the event (the start-up comparison records it)."""
    route = message.route
    fields = sent_fields(
        message.task_id, message.headers, route.queue, route.exchange, route.routing_key
    )
    events.publish("task-sent", fields, producer, Event=event)
