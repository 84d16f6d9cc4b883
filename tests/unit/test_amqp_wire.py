"""The AMQP properties the dispatcher encodes are the bytes py-amqp itself writes."""

from __future__ import annotations

import datetime as dt
import types
import uuid
from typing import Any

import amqp
import pytest
from amqp import spec
from amqp.exceptions import FrameSyntaxError
from amqp.method_framing import frame_writer
from amqp.serialization import dumps
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_sched.dispatch.amqp_wire import EncodedMessage, PropertiesEncoder, PublishFrames
from celery_sched.models import Job, JobStatus
from celery_sched.protocol import base_headers, message_headers
from celery_sched.timeutil import to_bucket

_names = st.text(min_size=0, max_size=20)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.binary(max_size=10),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(_names, inner, max_size=4),
    ),
    max_leaves=12,
)
_short = st.one_of(st.none(), st.text(max_size=40))
_octet = st.one_of(st.none(), st.integers(0, 255))


def theirs(**properties: Any) -> bytes:
    """py-amqp's own encoding, as Kombu's publish produces it."""
    values = {
        ("application_headers" if name == "headers" else name): value
        for name, value in properties.items()
    }
    serialized: bytes = amqp.Message(b"body", **values)._serialize_properties()
    return serialized


@settings(max_examples=300, deadline=None)
@given(
    headers=st.one_of(st.none(), st.dictionaries(_names, _values, max_size=8)),
    content_type=_short,
    content_encoding=_short,
    delivery_mode=_octet,
    priority=_octet,
    correlation_id=_short,
    reply_to=_short,
    expiration=_short,
)
def test_properties_match_py_amqp(**properties: Any) -> None:
    encoder = PropertiesEncoder()
    assert encoder.properties(**properties) == theirs(**properties)
    # Twice: the cached name prefixes give the same bytes.
    assert encoder.properties(**properties) == theirs(**properties)


def test_a_celery_task_message_matches_py_amqp() -> None:
    now = dt.datetime.now(dt.UTC)
    job = Job(
        id=uuid.uuid4(),
        key="report:7",
        task="proj.tasks.report",
        body=b"[[1], {}, {}]",
        content_type="application/json",
        content_encoding="utf-8",
        argsrepr="(1,)",
        kwargsrepr="{}",
        due_at=now,
        due_bucket=to_bucket(now),
        status=JobStatus.DISPATCHED,
        options={"headers": {"x": [1, {"y": None}]}, "time_limit": 30},
        expires_at=now + dt.timedelta(minutes=1),
        attempt=2,
    )
    headers = message_headers(base_headers(origin="beat@host", epoch=3), job, str(job.id))
    properties = {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": headers,
        "delivery_mode": 2,
        "priority": 0,
        "correlation_id": str(job.id),
        "reply_to": str(uuid.uuid4()),
        "expiration": "60000",
    }
    assert PropertiesEncoder().properties(**properties) == theirs(**properties)


def test_a_value_amqp_cannot_carry_fails_as_in_py_amqp() -> None:
    with pytest.raises(FrameSyntaxError):
        theirs(headers={"bad": object()})
    with pytest.raises(FrameSyntaxError):
        PropertiesEncoder().properties(
            content_type=None,
            content_encoding=None,
            headers={"bad": object()},
            delivery_mode=None,
            priority=None,
            correlation_id=None,
            reply_to=None,
            expiration=None,
        )


def test_an_encoded_message_hands_py_amqp_its_bytes() -> None:
    message = EncodedMessage(b"payload", b"\x00\x00")
    assert message.body == b"payload"
    assert message._serialize_properties() == b"\x00\x00"


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 2**31 - 1, 2**31, -(2**31) + 1, -(2**31), 2**63 - 1, -(2**63), True, False, 1.5],
)
def test_numbers_at_the_type_boundaries_match_py_amqp(value: Any) -> None:
    properties: dict[str, Any] = dict.fromkeys(
        (
            "content_type",
            "content_encoding",
            "delivery_mode",
            "priority",
            "correlation_id",
            "reply_to",
            "expiration",
        )
    )
    properties["headers"] = {"n": value, "in": [value], "deep": {"n": value}}
    assert PropertiesEncoder().properties(**properties) == theirs(**properties)


def _py_amqp_publish_bytes(
    frame_max: int, channel_id: int, exchange: str, routing_key: str, message: amqp.Message
) -> bytes:
    """What py-amqp's own frame writer writes for ``basic_publish``."""
    written: list[bytes] = []
    transport = types.SimpleNamespace(write=lambda data: written.append(bytes(data)))
    connection = types.SimpleNamespace(frame_max=frame_max, bytes_sent=0)
    args = dumps("Bssbb", (0, exchange, routing_key, False, False))
    frame_writer(connection, transport)(1, channel_id, spec.Basic.Publish, args, message)
    return b"".join(written)


@settings(max_examples=200, deadline=None)
@given(
    frame_max=st.sampled_from([131072, 4096, 512, 64]),
    channel_id=st.integers(1, 65535),
    exchange=st.text(max_size=30),
    routing_key=st.text(max_size=60),
    body=st.binary(max_size=3000),
    headers=st.dictionaries(_names, _scalars, max_size=5),
)
def test_publish_frames_match_py_amqp(
    frame_max: int,
    channel_id: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: dict[str, Any],
) -> None:
    message = amqp.Message(
        body, content_type="application/json", application_headers=headers, delivery_mode=2
    )
    ours = PublishFrames(channel_id, frame_max).frames(
        exchange, routing_key, message._serialize_properties(), body
    )
    assert ours == _py_amqp_publish_bytes(frame_max, channel_id, exchange, routing_key, message)
