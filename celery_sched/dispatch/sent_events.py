"""Task-sent events written by the dispatcher itself, for the fast paths.

With ``task_send_sent_event`` on (Flower's "sent" state), Celery's
``send_task`` publishes one ``task-sent`` event per message through Kombu.
The classes here write the same event messages, byte for byte:
:class:`SentEvents` the envelopes Kombu's Redis transport ``PUBLISH``\\ es
(the Redis path sends them in the round trip of a chunk's ``LPUSH``
commands), :class:`AmqpSentEvents` the messages Kombu hands py-amqp's
``basic_publish`` (the py-amqp path sends each right after its task
message). :func:`celery_sched.dispatch.fast_path.choose` compares a sample
of each with Kombu's own at start-up and falls back to Kombu's publish when
they differ.

An event costs about as much to write as its message, so what every event
of a chunk shares (hostname, UTC offset, pid, and per task and route the
name and destination) is written once per chunk, after :meth:`begin`; per
event only the clock, the task id, the argument and expiry strings and the
timestamp are formatted, straight into JSON as ``json.dumps`` (Kombu's JSON
serializer) writes them.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Callable, Mapping
from typing import Any

from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps as serialize

from celery_sched.dispatch.amqp_wire import EncodedMessage, PropertiesEncoder
from celery_sched.protocol import DeliveryTags, envelope_head, envelope_json

#: The routing key of a task-sent event (its type with ``.`` for ``-``).
ROUTING_KEY = "task.sent"


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


_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii
_json_dumps = json.dumps


def _json_value(value: Any) -> str:
    """``json.dumps(value)``, faster for the strings most values are."""
    if type(value) is str:
        return _json_str(value)
    return _json_dumps(value)


def _literal(text: str) -> str:
    """``text`` as the constant part of a %-format."""
    return text.replace("%", "%%")


class _EventBodies:
    """The serialized bodies of task-sent events: ``celery.events.Event``
    with the event dispatcher's hostname and pid, the app's clock and the
    fields of :func:`sent_fields`, as the event serializer writes it.

    :meth:`begin` starts a chunk (its UTC offset, as Celery reads it per
    event); :meth:`body` writes one event of it.
    """

    def __init__(self, events: Any) -> None:
        self.clock = events.clock
        self._hostname: str = events.hostname
        self._pid: int = events.pid
        self._serializer: str = events.serializer
        content_type, content_encoding, _ = serialize({}, serializer=self._serializer)
        #: The event messages' content type and encoding.
        self.content_type: str = content_type
        self.content_encoding: str = content_encoding
        self._json = self._serializer == "json"
        self._utcoffset: float = 0.0
        self._head = ""
        # Per chunk: the %-format of a (task name, route)'s events.
        self._formats: dict[tuple[Any, int], str] = {}

    def begin(self, utcoffset: float) -> None:
        """Start a chunk of events sent with ``utcoffset`` (Celery's
        ``utcoffset()``, hours west of UTC)."""
        self._utcoffset = utcoffset
        self._head = _literal(
            '{"hostname": %s, "utcoffset": %s, "pid": %d, "clock": '  # noqa: UP031
            % (_json_value(self._hostname), _json_dumps(utcoffset), self._pid)
        )
        self._formats = {}

    def body(self, message: Any, clock: int, timestamp: float) -> bytes:
        """The serialized event of ``message`` (a dispatcher's message: its
        ``task_id``, ``headers`` and ``route``)."""
        if not self._json:
            return self._serialized(message, clock, timestamp)
        headers = message.headers
        route = message.route
        name = headers["task"]
        key = (name, id(route))  # routes outlive the chunk: its messages hold them
        form = self._formats.get(key)
        if form is None:
            form = self._formats[key] = self._format(name, route)
        task_id = _json_str(message.task_id)
        args = headers["argsrepr"]
        kwargs = headers["kwargsrepr"]
        expires = headers["expires"]
        if type(expires) is str:
            expires = _json_str(expires)
        else:
            expires = "null" if expires is None else _json_dumps(expires)
        return (
            form
            % (
                clock,
                task_id,
                task_id,
                _json_str(args) if type(args) is str else _json_dumps(args),
                _json_str(kwargs) if type(kwargs) is str else _json_dumps(kwargs),
                expires,
                float.__repr__(timestamp),
            )
        ).encode()

    def _format(self, name: Any, route: Any) -> str:
        """What ``json.dumps`` (Kombu's json serializer) makes of the event,
        as a %-format of its per-event values: the clock (``%d``), the task
        id twice, args, kwargs, expires and the timestamp (``%s``, as JSON)."""
        return "".join(
            (
                self._head,
                '%d, "uuid": %s, "root_id": %s, "parent_id": null, "name": ',
                _literal(_json_value(name)),
                ', "args": %s, "kwargs": %s, "retries": 0, "eta": null, "expires": %s, "queue": ',
                _literal(_json_value(route.queue)),
                ', "exchange": ',
                _literal(_json_value(route.exchange)),
                ', "routing_key": ',
                _literal(_json_value(route.routing_key)),
                ', "timestamp": %s, "type": "task-sent"}',
            )
        )

    def _serialized(self, message: Any, clock: int, timestamp: float) -> bytes:
        """The event through Kombu's serializer (one other than json)."""
        route = message.route
        fields = sent_fields(
            message.task_id, message.headers, route.queue, route.exchange, route.routing_key
        )
        event = {
            "hostname": self._hostname,
            "utcoffset": self._utcoffset,
            "pid": self._pid,
            "clock": clock,
            **fields,
            "timestamp": timestamp,
            "type": "task-sent",
        }
        _, _, serialized = serialize(event, serializer=self._serializer)
        return serialized if isinstance(serialized, bytes) else str(serialized).encode("utf-8")


class SentEvents(_EventBodies):
    """Task-sent events as Kombu's Redis transport publishes them for
    ``EventDispatcher.publish('task-sent', fields, producer)``: the event
    body, base64, in the JSON envelope of a message to the event exchange
    with routing key ``task.sent``, for ``PUBLISH`` on the channels
    Kombu's ``_put_fanout`` uses (:attr:`topics`).
    """

    def __init__(self, events: Any, channel: Any) -> None:
        super().__init__(events)
        exchange = events.exchange.name
        self.topics: list[str] = list(channel._get_publish_topics(exchange, ROUTING_KEY))
        self._tags = DeliveryTags()
        after_body = b"".join(
            (
                envelope_head(self.content_encoding, self.content_type),
                b',"headers":',
                envelope_json(events.headers),
                b',"properties":{"delivery_mode":',
                envelope_json(events.delivery_mode),
                b',"delivery_info":',
                envelope_json({"exchange": exchange, "routing_key": ROUTING_KEY}),
                b',"priority":',
                envelope_json(channel.default_priority),
                b',"body_encoding":"base64","delivery_tag":"',
            )
        )
        # The envelope around the base64 body and the delivery tag.
        self._envelope = b'{"body":"%s' + after_body.replace(b"%", b"%%") + b'%s"}}'

    def encode(self, message: Any, clock: int, timestamp: float) -> bytes:
        """The envelope of ``message``'s event, in the chunk :meth:`begin` started."""
        body = self.body(message, clock, timestamp)
        return self._envelope % (binascii.b2a_base64(body, newline=False), self._tags.next())


class AmqpSentEvents(_EventBodies):
    """Task-sent events as Kombu's publish hands them to py-amqp's
    ``basic_publish`` for ``EventDispatcher.publish('task-sent', fields,
    producer)``: the event body with the properties Kombu gives it (the
    content type and encoding of the event serializer, the dispatcher's
    headers, its delivery mode, priority 0), to the event exchange
    (:attr:`exchange`, declared by :meth:`declare` as Kombu does before its
    first event) with routing key :data:`ROUTING_KEY`.
    """

    def __init__(self, events: Any, producer: Any, encoder: PropertiesEncoder) -> None:
        super().__init__(events)
        self._entity = events.exchange
        self.exchange: str = events.exchange.name
        # Kombu's publish: the dispatcher's delivery mode, or the one of
        # the producer's exchange (the event exchange is passed by name).
        delivery_mode = events.delivery_mode or producer.exchange.delivery_mode
        self.properties: bytes = encoder.properties(
            content_type=self.content_type,
            content_encoding=self.content_encoding,
            headers=events.headers,
            delivery_mode=maybe_delivery_mode(delivery_mode),
            priority=0,
            correlation_id=None,
            reply_to=None,
            expiration=None,
        )

    def declare(self, producer: Any) -> None:
        """Declare the event exchange on ``producer``'s channel, once per
        connection (Kombu's cache of declared entities)."""
        producer.maybe_declare(self._entity)

    def message(self, message: Any, clock: int, timestamp: float) -> EncodedMessage:
        """``message``'s event, in the chunk :meth:`begin` started."""
        return EncodedMessage(self.body(message, clock, timestamp), self.properties)
