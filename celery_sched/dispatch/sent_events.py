"""Task-sent events written by the dispatcher itself, for the Redis fast path.

With ``task_send_sent_event`` on (Flower's "sent" state), Celery's
``send_task`` publishes one ``task-sent`` event per message through Kombu.
:class:`SentEvents` writes the same event messages, byte for byte, for the
dispatcher to ``PUBLISH`` in the round trip of a chunk's ``LPUSH``es;
:func:`celery_sched.dispatch.fast_path.choose` compares a sample with Kombu's
own at start-up and falls back to Kombu's publish when they differ.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

from kombu.serialization import dumps as serialize

from celery_sched.protocol import DeliveryTags, envelope_head, envelope_json


def sent_fields(
    task_id: str, headers: Mapping[str, Any], queue: Any, exchange: Any, routing_key: Any
) -> dict[str, Any]:
    """The fields of Celery's own task-sent event (those of
    ``send_task_message``), in its order; the event's hostname (ours) is
    what Flower shows as the task's client."""
    return {
        "uuid": task_id,
        "root_id": task_id,
        "parent_id": None,
        "name": headers["task"],
        "args": headers["argsrepr"],
        "kwargs": headers["kwargsrepr"],
        "retries": 0,
        "eta": None,
        "expires": headers["expires"],
        "queue": queue,
        "exchange": exchange,
        "routing_key": routing_key,
    }


def _json_value(value: Any) -> str:
    """``json.dumps(value)``, faster for the strings most values are."""
    if type(value) is str:
        return _json_str(value)
    return json.dumps(value)


_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii


class SentEvents:
    """Task-sent events as Kombu's Redis transport publishes them for
    ``EventDispatcher.publish('task-sent', fields, producer)``: the event
    (``celery.events.Event`` with the dispatcher's hostname, pid, the app's
    clock) serialized by the event serializer, in the JSON envelope of a
    message to the event exchange with routing key ``task.sent``, for
    ``PUBLISH`` on the channels Kombu's ``_put_fanout`` uses.
    :func:`fast_path.choose` compares one with Kombu's own at start-up.
    """

    ROUTING_KEY = "task.sent"

    def __init__(self, events: Any, channel: Any) -> None:
        self.clock = events.clock
        self._hostname: str = events.hostname
        self._pid: int = events.pid
        self._serializer: str = events.serializer
        self._hostname_json = _json_value(self._hostname)
        exchange = events.exchange.name
        self.topics: list[str] = list(channel._get_publish_topics(exchange, self.ROUTING_KEY))
        self._tags = DeliveryTags()
        self._head: dict[tuple[str, str], bytes] = {}
        self._properties = b"".join(
            (
                b',"headers":',
                envelope_json(events.headers),
                b',"properties":{"delivery_mode":',
                envelope_json(events.delivery_mode),
                b',"delivery_info":',
                envelope_json({"exchange": exchange, "routing_key": self.ROUTING_KEY}),
                b',"priority":',
                envelope_json(channel.default_priority),
                b',"body_encoding":"base64","delivery_tag":"',
            )
        )

    def encode(self, message: Any, *, clock: int, timestamp: float, utcoffset: float) -> bytes:
        """The envelope of ``message``'s event (a dispatcher's message: its
        ``task_id``, ``headers`` and ``route``)."""
        if self._serializer == "json":
            content_type, content_encoding = "application/json", "utf-8"
            body = self._json_event(message, clock, timestamp, utcoffset)
            return self._envelope(body, content_type, content_encoding)
        route = message.route
        fields = sent_fields(
            message.task_id, message.headers, route.queue, route.exchange, route.routing_key
        )
        event = {
            "hostname": self._hostname,
            "utcoffset": utcoffset,
            "pid": self._pid,
            "clock": clock,
            **fields,
            "timestamp": timestamp,
            "type": "task-sent",
        }
        content_type, content_encoding, serialized = serialize(event, serializer=self._serializer)
        body = serialized if isinstance(serialized, bytes) else str(serialized).encode("utf-8")
        return self._envelope(body, content_type, content_encoding)

    def _json_event(self, message: Any, clock: int, timestamp: float, utcoffset: float) -> bytes:
        """What ``json.dumps`` (Kombu's json serializer) makes of the event,
        written out: a third of the cost of building and dumping the dict."""
        headers = message.headers
        route = message.route
        task_id = _json_str(message.task_id)
        return (
            '{"hostname": %s, "utcoffset": %s, "pid": %d, "clock": %d, "uuid": %s, '  # noqa: UP031
            '"root_id": %s, "parent_id": null, "name": %s, "args": %s, "kwargs": %s, '
            '"retries": 0, "eta": null, "expires": %s, "queue": %s, "exchange": %s, '
            '"routing_key": %s, "timestamp": %s, "type": "task-sent"}'
            % (
                self._hostname_json,
                json.dumps(utcoffset),
                self._pid,
                clock,
                task_id,
                task_id,
                _json_value(headers["task"]),
                _json_value(headers["argsrepr"]),
                _json_value(headers["kwargsrepr"]),
                _json_value(headers["expires"]),
                _json_value(route.queue),
                _json_value(route.exchange),
                _json_value(route.routing_key),
                float.__repr__(timestamp),
            )
        ).encode()

    def _envelope(self, body: bytes, content_type: str, content_encoding: str) -> bytes:
        head_key = (content_type, content_encoding)
        head = self._head.get(head_key)
        if head is None:
            head = self._head[head_key] = envelope_head(content_encoding, content_type)
        return b"".join(
            (
                b'{"body":"',
                base64.b64encode(body),
                head,
                self._properties,
                self._tags.next(),
                b'"}}',
            )
        )
