"""AMQP 0-9-1 basic properties of a task message, encoded for py-amqp.

py-amqp encodes a message's properties (above all the Celery headers table)
with a generic serializer that takes about half of a publish. The encoder
here writes the very same bytes (a property test compares them with
``amqp.Message(...)._serialize_properties()``) for the properties a Celery
task message carries, with fast paths for the value types Celery headers
hold and py-amqp's own ``dumps`` for any other value.

:class:`PublishFrames` writes the frames of a ``basic.publish`` (method,
content header, body) as py-amqp's frame writer would (a unit test compares
them with ``amqp.method_framing.frame_writer``), so that a chunk of
messages goes to the socket in one write instead of one per message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from struct import Struct
from typing import Any

import amqp
from amqp.serialization import dumps

_U8 = Struct("B").pack
_U16 = Struct(">H").pack
_U32 = Struct(">I").pack
_I32 = Struct(">i").pack
_I64 = Struct(">q").pack
_U64 = Struct(">Q").pack
_FRAME = Struct(">BHI").pack
_FRAME_END = b"\xce"
# Basic.Publish (class 60, method 40) and its reserved ticket.
_PUBLISH = _U16(60) + _U16(40) + _U16(0)
# A content header of class Basic (60), weight 0.
_HEADER = _U16(60) + _U16(0)

# The flags of content_type, content_encoding, application_headers,
# delivery_mode, priority, correlation_id, reply_to and expiration: the first
# eight of py-amqp's ``Message.PROPERTIES``, from the top bit down.
_FLAGS = tuple(1 << bit for bit in range(15, 7, -1))

_INT32_MAX = 2147483647
_TRUE = b"t\x01"
_FALSE = b"t\x00"


def _shortstr(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return _U8(len(data)) + data


class PropertiesEncoder:
    """Encodes properties; caches each header name's encoded prefix."""

    def __init__(self) -> None:
        self._names: dict[str, bytes] = {}

    def table(self, headers: Mapping[str, Any]) -> bytes:
        """An AMQP field table (``F``), length prefix included."""
        names = self._names
        parts: list[bytes] = []
        append = parts.append
        for name, value in headers.items():
            prefix = names.get(name)
            if prefix is None:
                if type(name) is not str or len(name.encode("utf-8", "surrogatepass")) > 255:
                    append(_item(name, value))
                    continue
                prefix = names[name] = _shortstr(name)
            encoded = self._value(value)
            append(_item(name, value) if encoded is None else prefix + encoded)
        body = b"".join(parts)
        return _U32(len(body)) + body

    def _value(self, value: Any) -> bytes | None:
        """A field value (type octet and data), or None for a type left to py-amqp."""
        kind = type(value)
        if kind is str:
            data: bytes = value.encode("utf-8", "surrogatepass")
            return b"S" + _U32(len(data)) + data
        if value is None:
            return b"V"
        if kind is bool:
            return _TRUE if value else _FALSE
        if kind is int:
            if -_INT32_MAX <= value <= _INT32_MAX:
                return b"I" + _I32(value)
            return b"L" + _I64(value)
        if kind is dict:
            return b"F" + self.table(value)
        if kind is list or kind is tuple:
            items = []
            for item in value:
                encoded = self._value(item)
                if encoded is None:
                    return None
                items.append(encoded)
            body = b"".join(items)
            return b"A" + _U32(len(body)) + body
        return None

    def properties(
        self,
        *,
        content_type: str | None,
        content_encoding: str | None,
        headers: Mapping[str, Any] | None,
        delivery_mode: int | None,
        priority: int | None,
        correlation_id: str | None,
        reply_to: str | None,
        expiration: str | None,
    ) -> bytes:
        """What ``amqp.Message(**these)._serialize_properties()`` returns."""
        table = self.table
        values: tuple[tuple[Any, Callable[[Any], bytes]], ...] = (
            (content_type, _shortstr),
            (content_encoding, _shortstr),
            (headers, table),
            (delivery_mode, _U8),
            (priority, _U8),
            (correlation_id, _shortstr),
            (reply_to, _shortstr),
            (expiration, _shortstr),
        )
        flags = 0
        parts: list[bytes] = []
        for bit, (value, encode) in zip(_FLAGS, values, strict=True):
            if value is not None:
                flags |= bit
                parts.append(encode(value))
        return _U16(flags) + b"".join(parts)


def _item(name: Any, value: Any) -> bytes:
    """One table entry as py-amqp writes it (its own code: the exact bytes,
    and its own error for a value AMQP cannot carry)."""
    table = dumps("F", ({name: value},))
    return table[4:]


class EncodedMessage(amqp.Message):
    """An ``amqp.Message`` whose properties arrive already encoded."""

    def __init__(self, body: bytes, properties: bytes) -> None:
        super().__init__(body)
        self._encoded = properties

    def _serialize_properties(self) -> bytes:
        return self._encoded


class PublishFrames:
    """The bytes py-amqp writes for ``basic_publish(message, exchange,
    routing_key)`` (``mandatory`` and ``immediate`` off) on one channel of
    one connection: a method frame, a content header frame (``properties``
    as :meth:`PropertiesEncoder.properties` gives them) and the body in
    frames of at most ``frame_max - 8`` bytes (none for an empty body)."""

    def __init__(self, channel_id: int, frame_max: int) -> None:
        self._channel = channel_id
        self._body_max = frame_max - 8
        if self._body_max < 1:
            raise ValueError(f"frame_max {frame_max} leaves no room for a body")
        self._methods: dict[tuple[str, str], bytes] = {}

    def frames(self, exchange: str, routing_key: str, properties: bytes, body: bytes) -> bytes:
        channel = self._channel
        method = self._methods.get((exchange, routing_key))
        if method is None:
            payload = _PUBLISH + _shortstr(exchange) + _shortstr(routing_key) + b"\x00"
            method = _FRAME(1, channel, len(payload)) + payload + _FRAME_END
            self._methods[exchange, routing_key] = method
        size = len(body)
        header = _HEADER + _U64(size) + properties
        out = method + _FRAME(2, channel, len(header)) + header + _FRAME_END
        if size <= self._body_max:
            if size:
                out += _FRAME(3, channel, size) + body + _FRAME_END
            return out
        step = self._body_max
        parts = [out]
        for start in range(0, size, step):
            piece = body[start : start + step]
            parts.append(_FRAME(3, channel, len(piece)) + piece + _FRAME_END)
        return b"".join(parts)
