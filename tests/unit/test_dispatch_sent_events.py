"""Task-sent event bodies written per chunk are what Kombu's serializer makes
of Celery's event, for values the start-up sample does not hold.

The brokers' side (envelopes, properties, a receiver) is
tests/integration/test_sent_events_wire.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import pytest
from celery import Celery
from celery.events.event import Event
from kombu.serialization import dumps

from celery_sched.dispatch.amqp_wire import PropertiesEncoder
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.dispatch.routing import Route
from celery_sched.dispatch.sent_events import AmqpSentEvents, _EventBodies, sent_fields

HOSTNAME = 'celery_sched@"host" 100%'


@pytest.fixture
def events() -> Iterator[Any]:
    app = Celery("sent_events_unit", broker="memory://", set_as_current=False)
    with app.connection_for_write() as conn:
        yield app.events.Dispatcher(conn, hostname=HOSTNAME, enabled=False)


def message(task: str, queue: Any, **headers: Any) -> OutgoingMessage:
    task_id = str(uuid.uuid4())
    route = Route(
        exchange="" if queue else "x%s",
        routing_key=queue or "rk",
        queue=queue,
        delivery_mode=2,
        priority=None,
        declare=None,
    )
    values = {"task": task, "argsrepr": "()", "kwargsrepr": "{}", "expires": None, **headers}
    return OutgoingMessage(
        uuid.UUID(task_id), task_id, b"[]", "application/json", "utf-8", values, route, None, None
    )


def kombus_body(events: Any, message: OutgoingMessage, clock: int, ts: float, off: float) -> bytes:
    route = message.route
    fields = sent_fields(
        message.task_id, message.headers, route.queue, route.exchange, route.routing_key
    )
    event = Event(
        "task-sent", hostname=events.hostname, utcoffset=off, pid=events.pid, clock=clock, **fields
    )
    event["timestamp"] = ts
    _, _, body = dumps(event, serializer=events.serializer)
    return body if isinstance(body, bytes) else str(body).encode()


MESSAGES = [
    lambda: message("t.plain", "q"),
    lambda: message("t.ünï%s", "q%d ☃", argsrepr="(1, 'é\\n\"')", kwargsrepr="{'%': None}"),
    lambda: message("t.expires", None, expires="2030-01-01T00:00:00+00:00"),
    # Not strings: what a before_task_publish receiver might leave.
    lambda: message("t.odd", "q", argsrepr=[1, None], kwargsrepr={"k": 2.5}, expires=0),
]


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("utcoffset", [0, -2, 5.5])
def test_bodies_are_kombus(events: Any, serializer: str, utcoffset: float) -> None:
    events.serializer = serializer
    bodies = _EventBodies(events)
    for chunk in range(2):  # a second chunk starts afresh
        bodies.begin(utcoffset + chunk)
        for index, make in enumerate(MESSAGES * 2):  # again, from the chunk's formats
            sent = make()
            ts = 1_700_000_000.123456 + index
            expected = kombus_body(events, sent, index, ts, utcoffset + chunk)
            assert bodies.body(sent, index, ts) == expected


def test_amqp_event_properties_are_py_amqps(events: Any) -> None:
    producer = type("Producer", (), {"exchange": type("X", (), {"delivery_mode": 2})()})()
    written = AmqpSentEvents(events, producer, PropertiesEncoder())
    expected = amqp.Message(
        b"",
        content_type="application/json",
        content_encoding="utf-8",
        application_headers={"hostname": HOSTNAME},
        delivery_mode=1,
        priority=0,
    )._serialize_properties()
    assert written.properties == expected
    assert written.exchange == "celeryev"
