"""Whether a broker connection may publish by the dispatcher's fast paths.

:class:`~celery_sched.dispatch.kombu.KombuDispatcher` has two ways around
Kombu's per-message publish: on Redis it writes Kombu's JSON envelope itself
and ``LPUSH``es it (:mod:`~celery_sched.dispatch.path_redis`); on py-amqp
(RabbitMQ) it encodes the message properties itself and calls
``basic_publish`` (:mod:`~celery_sched.dispatch.path_amqp`). Both, and the
task-sent events they write (:mod:`~celery_sched.dispatch.sent_events`),
reproduce what private parts of Kombu and py-amqp write, so :func:`choose`
allows them on a connection only when

1. the setting ``celery_sched_fast_publish`` is ``auto``;
2. the transport is Kombu's Redis transport or py-amqp;
3. the installed ``kombu`` (and, for py-amqp, ``amqp``) is within the range
   the fast paths were tested against (:data:`TESTED_KOMBU`,
   :data:`TESTED_AMQP`);
4. sample messages produced by the fast path are what Kombu's own publish
   produces on that very channel: the Redis list and the decoded envelope
   (delivery tag aside: a fresh unique string each), or the AMQP properties
   byte for byte (and, for py-amqp, the frames the fast path writes
   against py-amqp's own frame writer's); with task-sent events on, also a sample event against
   what Celery's event dispatcher publishes through Kombu: on Redis the
   channels and envelope (delivery tag aside; the event body, clock and
   timestamp included, byte for byte), on py-amqp the exchange, routing
   key, encoded properties and body, byte for byte.

Otherwise that connection publishes through ``Producer.publish``, with one
WARNING saying why when 3 or 4 failed; except that on py-amqp a sample event
that differs only sends the events through Celery's event dispatcher (the
messages keep the fast path). This runs once per connection; the samples
never reach the broker (Kombu's side is captured at the Redis client or at
``basic_publish``; Kombu declares the event exchange as it would for its
first event).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import importlib.metadata
import json
import re
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import amqp
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps
from celery.events.event import Event

from celery_sched.dispatch.amqp_wire import EncodedMessage, PublishFrames

#: Installed versions the fast paths were checked against: ``(lowest,
#: first untested)``, compared on the release numbers. A version outside
#: (or a pre-release) publishes through Kombu. Widen after running
#: tests/unit/test_redis_envelope.py, tests/unit/test_amqp_wire.py and
#: tests/integration/test_fast_publish.py on the new version.
TESTED_KOMBU: tuple[tuple[int, ...], tuple[int, ...]] = ((5, 7, 0), (5, 8))
TESTED_AMQP: tuple[tuple[int, ...], tuple[int, ...]] = ((5, 4, 2), (5, 5))

#: Values of ``celery_sched_fast_publish``.
AUTO = "auto"
OFF = "off"
MODES = (AUTO, OFF)

_RELEASE = re.compile(r"(\d+(?:\.\d+)*)(?:\.post\d+)?")


class PublishPath(enum.StrEnum):
    """How a connection's messages are published."""

    KOMBU = "kombu"  #: ``Producer.publish``
    REDIS = "redis"  #: pipelined ``LPUSH`` of our own envelopes
    AMQP = "amqp"  #: py-amqp ``basic_publish`` with our own properties


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """A connection's publish path; ``reason`` says why not a fast one, and
    ``warn`` whether that reason deserves a WARNING (an untested version or
    a mismatch, not a setting or a transport without a fast path)."""

    path: PublishPath
    reason: str = ""
    warn: bool = False
    #: Whether the fast path writes the task-sent events too (with events
    #: on); False on py-amqp when the sample event differed: Kombu sends them.
    sent_events: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One message as the dispatcher would publish it, in the terms of
    ``Producer.publish`` (to the default exchange)."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    routing_key: str
    delivery_mode: int
    priority: int | None
    task_id: str
    expiration: float | None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AmqpEvent:
    """A task-sent event as handed to py-amqp's ``basic_publish``."""

    exchange: str
    routing_key: str
    properties: bytes
    body: bytes


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a final (or post) release; None for anything
    else (a pre-release, a development or local version)."""
    match = _RELEASE.fullmatch(version)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def untested_version(distribution: str, tested: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    """Why the installed ``distribution`` is outside ``tested``, or ``""``."""
    low, high = tested
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} is not installed as a distribution"
    numbers = release(installed)
    if numbers is None or not low <= numbers < high:
        return (
            f"{distribution} {installed} is outside the tested range "
            f">={_dotted(low)},<{_dotted(high)}"
        )
    return ""


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def choose(
    producer: Any,
    *,
    mode: str,
    redis_eligible: bool,
    samples: Sequence[Sample],
    reply_to: str,
    redis_fast: Callable[[Sample], tuple[str, bytes]],
    amqp_fast: Callable[[Sample], bytes],
    sent_event_kombu: Callable[[Sample, Callable[..., dict[str, Any]]], None] | None = None,
    sent_event_fast: Callable[[Sample, dict[str, Any]], list[tuple[str, bytes]]] | None = None,
    amqp_event_fast: Callable[[Sample, dict[str, Any]], AmqpEvent] | None = None,
) -> Choice:
    """The publish path of ``producer``'s connection.

    ``redis_eligible`` is False when the dispatcher could not use the Redis
    path anyway (no batch publishing). ``redis_fast`` and ``amqp_fast``
    produce, without I/O, what the fast path would write for a sample: the
    Redis list and envelope, or the encoded AMQP properties.

    With task-sent events on: ``sent_event_kombu(sample, factory)``
    publishes the sample's event through Celery's event dispatcher with
    ``factory`` as its ``Event``; with the clock, timestamp and UTC offset
    of the ``event`` Kombu built, ``sent_event_fast(sample, event)`` gives
    the ``(channel, payload)`` pairs the Redis path would ``PUBLISH`` for
    it, ``amqp_event_fast(sample, event)`` what the py-amqp path would
    ``basic_publish`` (:class:`AmqpEvent`). Without the one for the
    connection's path, events go through Kombu's publish.
    """
    if mode == OFF:
        return Choice(path=PublishPath.KOMBU, reason="celery_sched_fast_publish is off")
    channel = producer.channel
    if isinstance(channel, amqp.Channel):
        path = PublishPath.AMQP
        untested = untested_version("kombu", TESTED_KOMBU) or untested_version("amqp", TESTED_AMQP)
    elif getattr(channel.connection.client.transport, "driver_type", None) == "redis":
        if not redis_eligible:
            return Choice(path=PublishPath.KOMBU, reason="task-sent events or no batch publishing")
        path = PublishPath.REDIS
        untested = untested_version("kombu", TESTED_KOMBU)
    else:
        return Choice(path=PublishPath.KOMBU, reason="no fast path for this transport")
    if untested:
        return Choice(path=PublishPath.KOMBU, reason=untested, warn=True)
    try:
        for sample in samples:
            if path is PublishPath.REDIS:
                mismatch = _compare_redis(
                    redis_fast(sample), _kombu_redis_write(producer, sample, reply_to)
                )
            else:
                ours = amqp_fast(sample)
                mismatch = _compare_amqp(
                    ours, _kombu_amqp_properties(producer, sample, reply_to)
                ) or _compare_amqp_frames(channel, sample, ours)
            if mismatch:
                return Choice(
                    path=PublishPath.KOMBU,
                    reason=f"a sample message differs from Kombu's: {mismatch}",
                    warn=True,
                )
            if path is PublishPath.REDIS and sent_event_kombu and sent_event_fast:
                theirs, event = _kombu_redis_event(producer, sample, sent_event_kombu)
                mismatch = _compare_published(sent_event_fast(sample, event), theirs)
                if mismatch:
                    return Choice(
                        path=PublishPath.KOMBU,
                        reason=f"a sample task-sent event differs from Kombu's: {mismatch}",
                        warn=True,
                    )
    except Exception as exc:
        return Choice(
            path=PublishPath.KOMBU,
            reason=f"comparing a sample message with Kombu's failed: {exc!r}",
            warn=True,
        )
    if path is PublishPath.AMQP and sent_event_kombu:
        if amqp_event_fast is None:
            return Choice(path=path, reason="no fast path for task-sent events")
        mismatch = _check_amqp_events(producer, samples, sent_event_kombu, amqp_event_fast)
        if mismatch:
            return Choice(path=path, reason=mismatch, warn=True)
    return Choice(path=path, sent_events=sent_event_kombu is not None)


def _check_amqp_events(
    producer: Any,
    samples: Sequence[Sample],
    publish: Callable[[Sample, Callable[..., dict[str, Any]]], None],
    fast: Callable[[Sample, dict[str, Any]], AmqpEvent],
) -> str:
    """Why the py-amqp path's sample events are not Kombu's, or ``""``."""
    try:
        for sample in samples:
            theirs, event = _kombu_amqp_event(producer, sample, publish)
            mismatch = _compare_amqp_event(fast(sample, event), theirs)
            if mismatch:
                return f"a sample task-sent event differs from Kombu's: {mismatch}"
    except Exception as exc:
        return f"comparing a sample task-sent event with Kombu's failed: {exc!r}"
    return ""


def _publish_kwargs(sample: Sample, reply_to: str) -> dict[str, Any]:
    """What the dispatcher's Kombu path passes ``Producer.publish``."""
    kwargs: dict[str, Any] = {
        "exchange": "",
        "routing_key": sample.routing_key,
        "content_type": sample.content_type,
        "content_encoding": sample.content_encoding,
        # Kombu may keep or change what it is given; the sample stays ours.
        "headers": copy.deepcopy(sample.headers),
        "delivery_mode": sample.delivery_mode,
        "priority": sample.priority,
        "correlation_id": sample.task_id,
        "reply_to": reply_to,
    }
    if sample.expiration is not None:
        kwargs["expiration"] = max(sample.expiration, 0.0)
    return kwargs


class _RecordingRedis:
    """Stands in for the Redis client: keeps what Kombu would ``LPUSH``."""

    def __init__(self) -> None:
        self.pushed: list[tuple[str, bytes]] = []
        self.published: list[tuple[str, bytes]] = []

    def lpush(self, key: str, *values: Any) -> int:
        for value in values:
            self.pushed.append((key, value.encode() if isinstance(value, str) else value))
        return len(self.pushed)

    def publish(self, channel: str, value: Any) -> int:
        self.published.append((channel, value.encode() if isinstance(value, str) else value))
        return 0


@contextlib.contextmanager
def _recording(producer: Any) -> Iterator[_RecordingRedis]:
    """Kombu's Redis channel writing to a recorder instead of Redis."""
    channel = producer.channel
    recorder = _RecordingRedis()

    @contextlib.contextmanager
    def conn_or_acquire(client: Any = None) -> Iterator[Any]:
        yield recorder

    channel.conn_or_acquire = conn_or_acquire
    try:
        yield recorder
    finally:
        del channel.conn_or_acquire


def _kombu_redis_write(producer: Any, sample: Sample, reply_to: str) -> tuple[str, bytes]:
    """The list and envelope Kombu's Redis channel writes for ``sample``.

    Kombu's whole publish runs (``prepare_message``, ``basic_publish``,
    ``_put`` with its priority and serialization); only the client it
    writes through is a recorder, so nothing reaches Redis.
    """
    with _recording(producer) as recorder:
        producer.publish(sample.body, **_publish_kwargs(sample, reply_to))
    if len(recorder.pushed) != 1 or recorder.published:
        raise RuntimeError(f"Kombu wrote {len(recorder.pushed)} values for one message")
    return recorder.pushed[0]


def _kombu_redis_event(
    producer: Any, sample: Sample, publish: Callable[[Sample, Callable[..., dict[str, Any]]], None]
) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
    """The ``(channel, payload)`` pairs Kombu's Redis channel publishes for
    the sample's task-sent event, and the event Celery built for it."""
    built: list[dict[str, Any]] = []

    def factory(type: str, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = Event(type, **fields)
        built.append(event)
        return event

    with _recording(producer) as recorder:
        publish(sample, factory)
    if len(built) != 1 or not recorder.published or recorder.pushed:
        raise RuntimeError(
            f"Kombu published {len(recorder.published)} and pushed {len(recorder.pushed)} "
            f"values for {len(built)} events"
        )
    return recorder.published, built[0]


@contextlib.contextmanager
def _capturing(channel: Any) -> Iterator[list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]:
    """py-amqp's ``channel`` keeping what is given to ``basic_publish``
    (message, positional and keyword arguments) instead of sending it."""
    captured: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def basic_publish(message: Any, *args: Any, **kwargs: Any) -> None:
        captured.append((message, args, kwargs))

    # py-amqp sets ``basic_publish`` on the instance in confirm mode.
    own = channel.__dict__.get("basic_publish")
    channel.basic_publish = basic_publish
    try:
        yield captured
    finally:
        if own is None:
            del channel.basic_publish
        else:
            channel.basic_publish = own


def _kombu_amqp_properties(producer: Any, sample: Sample, reply_to: str) -> bytes:
    """py-amqp's own encoding of the properties Kombu's publish gives ``sample``."""
    with _capturing(producer.channel) as captured:
        producer.publish(sample.body, **_publish_kwargs(sample, reply_to))
    if len(captured) != 1:
        raise RuntimeError(f"Kombu published {len(captured)} messages for one")
    message, _, _ = captured[0]
    properties: bytes = message._serialize_properties()
    return properties


def _kombu_amqp_event(
    producer: Any, sample: Sample, publish: Callable[[Sample, Callable[..., dict[str, Any]]], None]
) -> tuple[AmqpEvent, dict[str, Any]]:
    """What Kombu's publish hands py-amqp's ``basic_publish`` for the
    sample's task-sent event, and the event Celery built for it."""
    built: list[dict[str, Any]] = []

    def factory(type: str, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = Event(type, **fields)
        built.append(event)
        return event

    with _capturing(producer.channel) as captured:
        publish(sample, factory)
    if len(built) != 1 or len(captured) != 1:
        raise RuntimeError(f"Kombu published {len(captured)} messages for {len(built)} events")
    message, args, kwargs = captured[0]
    exchange = kwargs["exchange"] if "exchange" in kwargs else args[0]
    routing_key = kwargs["routing_key"] if "routing_key" in kwargs else args[1]
    body = message.body
    theirs = AmqpEvent(
        exchange=exchange,
        routing_key=routing_key,
        properties=message._serialize_properties(),
        body=body if isinstance(body, bytes) else str(body).encode("utf-8"),
    )
    return theirs, built[0]


def _compare_amqp_event(ours: AmqpEvent, theirs: AmqpEvent) -> str:
    if (ours.exchange, ours.routing_key) != (theirs.exchange, theirs.routing_key):
        return (
            f"exchange and routing key {ours.exchange!r}, {ours.routing_key!r} "
            f"instead of {theirs.exchange!r}, {theirs.routing_key!r}"
        )
    if ours.body != theirs.body:
        return f"body {ours.body!r} instead of {theirs.body!r}"
    return _compare_amqp(ours.properties, theirs.properties)


def _compare_amqp_frames(channel: Any, sample: Sample, properties: bytes) -> str:
    """Why the py-amqp path's frames for ``sample`` (a chunk is written as
    these, :class:`~celery_sched.dispatch.amqp_wire.PublishFrames`) are not
    what py-amqp's own frame writer writes on ``channel``, or ``""``."""
    frame_max = channel.connection.frame_max
    written: list[bytes] = []
    recorder = types.SimpleNamespace(write=lambda data: written.append(bytes(data)))
    writer = frame_writer(types.SimpleNamespace(frame_max=frame_max, bytes_sent=0), recorder)
    args = dumps("Bssbb", (0, "", sample.routing_key, False, False))
    writer(1, channel.channel_id, spec.Basic.Publish, args, EncodedMessage(sample.body, properties))
    ours = PublishFrames(channel.channel_id, frame_max).frames(
        "", sample.routing_key, properties, sample.body
    )
    theirs = b"".join(written)
    if ours == theirs:
        return ""
    return "publish frames " + _compare_amqp(ours, theirs)


def _compare_redis(ours: tuple[str, bytes], theirs: tuple[str, bytes]) -> str:
    if ours[0] != theirs[0]:
        return f"list {ours[0]!r} instead of {theirs[0]!r}"
    mine, kombus = json.loads(ours[1]), json.loads(theirs[1])
    # A fresh unique string per message on either side.
    tags = [envelope.get("properties", {}).pop("delivery_tag", None) for envelope in (mine, kombus)]
    if not all(isinstance(tag, str) for tag in tags):
        return f"delivery tags {tags[0]!r} and {tags[1]!r}"
    return _first_difference(mine, kombus, "envelope")


def _compare_published(ours: list[tuple[str, bytes]], theirs: list[tuple[str, bytes]]) -> str:
    if [topic for topic, _ in ours] != [topic for topic, _ in theirs]:
        return f"channels {[t for t, _ in ours]!r} instead of {[t for t, _ in theirs]!r}"
    for mine, kombus in zip(ours, theirs, strict=True):
        mismatch = _compare_redis(mine, kombus)
        if mismatch:
            return mismatch
    return ""


def _first_difference(mine: Any, kombus: Any, where: str) -> str:
    """Where two decoded envelopes first differ, e.g. ``envelope.headers.lang:
    'px' instead of 'py'`` (no delivery tag, so the same on every connection)."""
    if isinstance(mine, dict) and isinstance(kombus, dict):
        for key in sorted(mine.keys() | kombus.keys()):
            if key not in mine or key not in kombus:
                side = "only ours" if key in mine else "only Kombu's"
                return f"{where}.{key} is in {side}"
            found = _first_difference(mine[key], kombus[key], f"{where}.{key}")
            if found:
                return found
        return ""
    if mine != kombus or type(mine) is not type(kombus):
        return f"{where}: {mine!r} instead of {kombus!r}"
    return ""


def _compare_amqp(ours: bytes, theirs: bytes) -> str:
    if ours == theirs:
        return ""
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    return (
        f"encoded properties differ from byte {at} (of {len(ours)}, py-amqp {len(theirs)}): "
        f"{ours[at : at + 16]!r} instead of {theirs[at : at + 16]!r}"
    )
