"""A prepared message on its way out, and the accounting of a chunk.

Every publish path sends each :class:`OutgoingMessage` as part of a chunk
and keeps the same books: a job counts as sent once its chunk is known to
be written
(:func:`record_sent`), never before; ``before_task_publish`` is sent once
per message however often it is retried (:func:`announce`), and
``after_task_publish`` once it counts as sent (:func:`announce_sent`).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kombu import Queue

from celery_sched.dispatch.routing import Route
from celery_sched.protocol import Announced, PublishSignals

#: Messages per chunk: on Redis, flushed per pipeline round trip. After each
#: flush those jobs are known to be sent; a failure can only leave one chunk
#: uncertain.
DEFAULT_CHUNK = 500


@dataclasses.dataclass(slots=True)
class OutgoingMessage:
    """A job's message, ready for any path: body and headers as sent."""

    job_id: uuid.UUID
    task_id: str
    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    route: Route
    priority: int | None
    expiration: float | None
    #: Set once ``before_task_publish`` was sent for it (see announce).
    announced: Announced | None = None


def always() -> bool:
    """A ``may_publish`` that never withholds."""
    return True


def announce(signals: PublishSignals, message: OutgoingMessage) -> None:
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


def announce_sent(chunk: list[OutgoingMessage], rejected: dict[uuid.UUID, str]) -> None:
    """``after_task_publish`` for each message of a chunk the broker took."""
    after = PublishSignals.after
    for message in chunk:
        announced = message.announced
        if announced is not None and message.job_id not in rejected:
            after(announced)


def record_sent(
    chunk: list[OutgoingMessage], rejected: dict[uuid.UUID, str], sent: list[uuid.UUID]
) -> None:
    """Count the jobs of a chunk the broker took as sent, except the rejected ones."""
    if rejected:
        sent.extend([m.job_id for m in chunk if m.job_id not in rejected])
    else:
        sent.extend([m.job_id for m in chunk])
