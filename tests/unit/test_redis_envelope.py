"""The Redis envelopes the dispatcher writes are the ones Kombu's own transport writes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from kombu import Connection, Producer

from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.dispatch.routing import Route
from celery_sched.protocol import RedisEnvelopes


def route(queue: str, delivery_mode: int | None = 2) -> Route:
    return Route(
        exchange="",
        routing_key=queue,
        queue=queue,
        delivery_mode=delivery_mode,
        priority=None,
        declare=None,
    )


def kombu_envelope(message: OutgoingMessage, priority: int, reply_to: str) -> dict[str, Any]:
    """What Kombu's virtual transport stores for the same publish."""
    with Connection("memory://") as conn:
        channel = conn.channel()
        queue = f"q-{uuid.uuid4().hex}"
        channel.queue_declare(queue)
        Producer(channel).publish(
            message.body,
            exchange="",
            routing_key=queue,
            headers=message.headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            priority=priority,
            delivery_mode=message.route.delivery_mode,
            correlation_id=message.task_id,
            reply_to=reply_to,
            # The dispatcher never sends an expired job; at the rounding edge
            # it sends a zero TTL rather than a negative one.
            expiration=None if message.expiration is None else max(message.expiration, 0.0),
        )
        stored: dict[str, Any] = channel._get(queue)
        # Kombu's memory queue is named by the routing key; ours by the route.
        stored["properties"]["delivery_info"]["routing_key"] = message.route.routing_key
        return stored


def message(route: Route, **fields: Any) -> OutgoingMessage:
    task_id = str(uuid.uuid4())
    values: dict[str, Any] = {
        "job_id": uuid.UUID(task_id),
        "task_id": task_id,
        "body": b'[[1, "x"], {"k": "\\u00e9"}, {"callbacks": null}]',
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {"task": "proj.add", "id": task_id, "argsrepr": "(1, 'x')", "n": 1},
        "route": route,
        "priority": None,
        "expiration": None,
    }
    values.update(fields)
    return OutgoingMessage(**values)


@pytest.mark.parametrize(
    ("fields", "priority"),
    [
        ({}, 0),
        ({"expiration": 12.3456}, 0),
        ({"expiration": -5.0}, 9),
        ({"content_type": 'application/x-"odd"', "content_encoding": "binary"}, 3),
        ({"headers": {"task": "t", "ünï": "cödé\u2603", "nested": {"a": [1, None]}}}, 0),
        ({"body": bytes(range(256))}, 1),
    ],
)
def test_envelope_matches_kombu(fields: dict[str, Any], priority: int) -> None:
    envelopes = RedisEnvelopes("reply-to-oid")
    # The first message of a route fills the caches, the second reuses them.
    for _ in range(2):
        msg = message(route("celery"), **fields)
        ours = json.loads(envelopes.encode(msg, priority))
        theirs = kombu_envelope(msg, priority, "reply-to-oid")
        assert ours["properties"].pop("delivery_tag")
        theirs["properties"].pop("delivery_tag")
        assert ours == theirs


def test_routes_priorities_and_tags_do_not_leak_between_messages() -> None:
    envelopes = RedisEnvelopes("oid")
    a, b = route("a", delivery_mode=2), route("b", delivery_mode=1)
    encoded = [
        json.loads(envelopes.encode(message(r), priority))
        for r, priority in [(a, 0), (b, 0), (a, 5), (b, 5), (a, 0)]
    ]
    seen = [
        (
            e["properties"]["delivery_info"]["routing_key"],
            e["properties"]["delivery_mode"],
            e["properties"]["priority"],
        )
        for e in encoded
    ]
    assert seen == [("a", 2, 0), ("b", 1, 0), ("a", 2, 5), ("b", 1, 5), ("a", 2, 0)]
    tags = [e["properties"]["delivery_tag"] for e in encoded]
    assert len(set(tags)) == len(tags)
    ids = [e["properties"]["correlation_id"] for e in encoded]
    assert ids == [e["headers"]["id"] for e in encoded]
