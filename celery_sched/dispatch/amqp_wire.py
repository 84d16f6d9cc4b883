"""AMQP 0-9-1 basic properties of a task message, encoded for py-amqp.

py-amqp encodes a message's properties (above all the Celery headers table)
with a generic serializer that takes about half of a publish. The encoder
here writes the very same bytes (a property test compares them with
``amqp.Message(...)._serialize_properties()``) for the properties a Celery
task message carries, with fast paths for the value types Celery headers
hold and py-amqp's own ``dumps`` for any other value.
"""

from __future__ import annotations

from collections.abc import Mapping
from struct import Struct
from typing import Any

import amqp
from amqp.serialization import dumps

_U8 = Struct("B").pack
_U16 = Struct(">H").pack
_U32 = Struct(">I").pack
_I32 = Struct(">i").pack
_I64 = Struct(">q").pack

# Property flags, in py-amqp's order of ``Message.PROPERTIES``.
_CONTENT_TYPE = 1 << 15
_CONTENT_ENCODING = 1 << 14
_HEADERS = 1 << 13
_DELIVERY_MODE = 1 << 12
_PRIORITY = 1 << 11
_CORRELATION_ID = 1 << 10
_REPLY_TO = 1 << 9
_EXPIRATION = 1 << 8

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
        flags = 0
        parts: list[bytes] = []
        if content_type is not None:
            flags |= _CONTENT_TYPE
            parts.append(_shortstr(content_type))
        if content_encoding is not None:
            flags |= _CONTENT_ENCODING
            parts.append(_shortstr(content_encoding))
        if headers is not None:
            flags |= _HEADERS
            parts.append(self.table(headers))
        if delivery_mode is not None:
            flags |= _DELIVERY_MODE
            parts.append(_U8(delivery_mode))
        if priority is not None:
            flags |= _PRIORITY
            parts.append(_U8(priority))
        if correlation_id is not None:
            flags |= _CORRELATION_ID
            parts.append(_shortstr(correlation_id))
        if reply_to is not None:
            flags |= _REPLY_TO
            parts.append(_shortstr(reply_to))
        if expiration is not None:
            flags |= _EXPIRATION
            parts.append(_shortstr(expiration))
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
