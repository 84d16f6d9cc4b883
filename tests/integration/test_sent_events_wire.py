"""Task-sent events on the wire: the fast paths send what Kombu would send.

Issue 15, point 8: with ``task_send_sent_event`` the Redis and the py-amqp
fast paths write the events themselves. Each event is taken raw off the
real broker (a Redis subscriber; a RabbitMQ queue bound to the event
exchange) and compared with the event Kombu's own publish sends for the
same message, clock, timestamp and UTC offset, taken off the broker the same
way: the body byte for byte, and the envelope (Redis, delivery tag aside) or
the properties, exchange and routing key (RabbitMQ). A Celery event receiver
gets one event per job; a sample that differs from Kombu's at start-up sends
the events through Kombu instead.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.events.event import Event

from celery_sched.dispatch import path_kombu, sent_events
from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.models import Job
from celery_sched.settings import Settings
from tests.integration.test_dispatch_kombu import make_job
from tests.integration.test_sent_events_fast_path import capture_sent

pytestmark = pytest.mark.integration

TASK = "sent_events_wire.record"
HOSTNAME = "celery_sched@sent-events-wire"


@pytest.fixture(params=["redis", "amqp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def app(
    request: pytest.FixtureRequest, transport: str, unique_name: str, redis_url: str
) -> Iterator[Celery]:
    broker = redis_url if transport == "redis" else str(request.getfixturevalue("amqp_url"))
    app = Celery("sent_events_wire", broker=broker, set_as_current=False)
    app.conf.task_default_queue = unique_name
    app.conf.task_send_sent_event = True
    yield app
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(unique_name)


def some_jobs(now: dt.datetime) -> list[Job]:
    """Jobs whose events carry non-ASCII, nested and null values, and expiry."""
    return [
        make_job(TASK, (1, "é"), {"n": [1, None, 2.5]}),
        make_job(TASK, (2,), options={"priority": 5}),
        make_job(TASK, (3, "100% ☃"), expires_at=now + dt.timedelta(minutes=5)),
        make_job(TASK, (), {"quote": 'say "hi"\n'}),
    ]


class RawEvents:
    """Task-sent events as they arrive on the broker, undecoded."""

    def __init__(self, app: Celery, transport: str, unique_name: str) -> None:
        self._transport = transport
        self._conn = app.connection_for_write()
        channel = self._conn.default_channel
        exchange = app.events.Dispatcher(self._conn, enabled=False).exchange
        if transport == "redis":
            (topic,) = channel._get_publish_topics(exchange.name, "task.sent")
            self._client = redis.Redis.from_url(app.conf.broker_url)
            self._pubsub = self._client.pubsub()
            self._pubsub.subscribe(topic)
            assert self._pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        else:
            self._queue = f"{unique_name}_events"
            exchange.bind(channel).declare()
            channel.queue_declare(self._queue, exclusive=True, auto_delete=True)
            channel.queue_bind(self._queue, exchange.name, "task.sent")
        self._channel = channel

    def take(self, ids: set[str]) -> dict[str, Any]:
        """The raw event of each task id in ``ids`` (others' events skipped)."""
        got: dict[str, Any] = {}
        deadline = time.monotonic() + 15
        while len(got) < len(ids) and time.monotonic() < deadline:
            raw = self._next()
            if raw is None:
                continue
            task_id = decode(raw)["uuid"]
            if task_id in ids:
                assert task_id not in got, f"two events for {task_id}"
                got[task_id] = raw
        assert set(got) == ids
        return got

    def _next(self) -> Any:
        if self._transport == "redis":
            message = self._pubsub.get_message(timeout=1)
            return message["data"] if message and message["type"] == "message" else None
        message = self._channel.basic_get(self._queue, no_ack=True)
        if message is None:
            time.sleep(0.05)
        return message

    def close(self) -> None:
        if self._transport == "redis":
            self._pubsub.close()
            self._client.close()
        self._conn.release()


def body_of(raw: Any) -> bytes:
    if isinstance(raw, bytes):  # a Redis envelope
        return base64.b64decode(json.loads(raw)["body"])
    body: bytes = raw.body
    return body


def decode(raw: Any) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(body_of(raw))
    return event


def kombus_event(app: Celery, message: OutgoingMessage, like: dict[str, Any]) -> Callable[[], None]:
    """Publishes ``message``'s event through Celery's event dispatcher and
    Kombu's producer, with the clock, UTC offset and timestamp of ``like``."""

    def factory(type: str, **fields: Any) -> dict[str, Any]:
        fields.update(clock=like["clock"], utcoffset=like["utcoffset"])
        event: dict[str, Any] = Event(type, **fields)
        event["timestamp"] = like["timestamp"]
        return event

    def publish() -> None:
        with app.connection_for_write() as conn:
            producer = app.amqp.Producer(conn.default_channel, auto_declare=False)
            events = app.events.Dispatcher(
                conn, hostname=HOSTNAME, enabled=False, buffer_while_offline=False
            )
            path_kombu.send_sent_event(events, producer, message, factory)

    return publish


def assert_same_event(transport: str, ours: Any, theirs: Any) -> None:
    assert body_of(ours) == body_of(theirs)  # byte for byte
    if transport == "redis":
        mine, kombus = json.loads(ours), json.loads(theirs)
        tags = [e["properties"].pop("delivery_tag") for e in (mine, kombus)]
        assert all(isinstance(tag, str) and tag for tag in tags)
        assert tags[0] != tags[1]
        assert mine == kombus
    else:
        assert ours.properties == theirs.properties
        assert ours.properties["application_headers"] == {"hostname": HOSTNAME}
        for name in ("exchange", "routing_key"):
            assert ours.delivery_info[name] == theirs.delivery_info[name]


def test_fast_path_events_are_kombus_on_the_wire(
    app: Celery, transport: str, unique_name: str
) -> None:
    now = dt.datetime.now(dt.UTC)
    jobs = some_jobs(now)
    ids = {str(job.id) for job in jobs}
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME), chunk=3)
    raw = RawEvents(app, transport, unique_name)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=now)
        assert sorted(result.sent) == sorted(job.id for job in jobs)
        expected = PublishPath.REDIS if transport == "redis" else PublishPath.AMQP
        assert dispatcher.sent_by_path == {expected: len(jobs)}
        assert dispatcher.sent_events_path is expected
        ours = raw.take(ids)
        # The same messages again, to have Kombu publish their events.
        messages = dispatcher._prepare(jobs, epoch=1, now=now, rejected={}, expired=[])
        for message in messages:
            kombus_event(app, message, decode(ours[message.task_id]))()
        theirs = raw.take(ids)
    finally:
        dispatcher.close()
        raw.close()
    for task_id in ids:
        assert_same_event(transport, ours[task_id], theirs[task_id])
    clocks = [decode(ours[str(job.id)])["clock"] for job in jobs]
    assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)


def test_a_receiver_gets_one_event_per_job(app: Celery, transport: str, unique_name: str) -> None:
    now = dt.datetime.now(dt.UTC)
    jobs = some_jobs(now) + [make_job(TASK, (i,)) for i in range(5)]
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME), chunk=2)
    results = []
    try:
        events = capture_sent(
            app, len(jobs), lambda: results.append(dispatcher.publish(jobs, epoch=1, now=now))
        )
        assert dispatcher.publish_path is not PublishPath.KOMBU
    finally:
        dispatcher.close()
    assert sorted(results[0].sent) == sorted(job.id for job in jobs)
    mine = [event for event in events if event["hostname"] == HOSTNAME]
    assert len(mine) == len(jobs)  # one each, none twice
    by_uuid = {event["uuid"]: event for event in mine}
    assert set(by_uuid) == {str(job.id) for job in jobs}
    for job in jobs:
        event = by_uuid[str(job.id)]
        assert event["type"] == "task-sent"
        assert event["name"] == TASK
        assert event["args"] == job.argsrepr
        assert event["kwargs"] == job.kwargsrepr
        assert event["queue"] == unique_name
        assert event["exchange"] == ""
        assert event["routing_key"] == unique_name
        assert event["root_id"] == str(job.id)
        assert event["parent_id"] is None
        assert event["retries"] == 0
        assert event["eta"] is None
        assert event["expires"] == (job.expires_at.isoformat() if job.expires_at else None)
        assert abs(event["timestamp"] - time.time()) < 60


def test_an_amqp_event_differing_from_kombus_goes_through_kombu(
    request: pytest.FixtureRequest,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The messages keep the py-amqp path; only the events fall back."""
    app = Celery("sent_events_wire", broker=str(request.getfixturevalue("amqp_url")))
    app.conf.task_default_queue = unique_name
    app.conf.task_send_sent_event = True
    original = sent_events.AmqpSentEvents.body

    def wrong(self: Any, *args: Any) -> bytes:
        return original(self, *args).replace(b'"pid": ', b'"pid":  ', 1)

    monkeypatch.setattr(sent_events.AmqpSentEvents, "body", wrong)
    now = dt.datetime.now(dt.UTC)
    jobs = [make_job(TASK, (i,)) for i in range(3)]
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME))
    try:
        with caplog.at_level(logging.WARNING, logger="celery_sched.dispatch.kombu"):
            events = capture_sent(
                app, len(jobs), lambda: dispatcher.publish(jobs, epoch=1, now=now)
            )
        assert dispatcher.publish_path is PublishPath.AMQP
        assert dispatcher.sent_by_path == {PublishPath.AMQP: len(jobs)}
        assert dispatcher.sent_events_path is PublishPath.KOMBU
    finally:
        dispatcher.close()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(unique_name)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "task-sent events to" in warnings[0]
    assert "differs from Kombu's: body" in warnings[0]
    mine = [event for event in events if event["hostname"] == HOSTNAME]
    assert sorted(event["uuid"] for event in mine) == sorted(str(job.id) for job in jobs)


@pytest.mark.parametrize("fast_path", ["redis", "amqp"])
def test_a_differing_event_sample_is_never_sent(
    request: pytest.FixtureRequest, fast_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong body caught at start-up: no event is written by the fast path."""
    url = request.getfixturevalue("redis_url" if fast_path == "redis" else "amqp_url")
    app = Celery("sent_events_wire", broker=str(url))
    app.conf.task_send_sent_event = True
    written: list[uuid.UUID] = []
    cls = sent_events.SentEvents if fast_path == "redis" else sent_events.AmqpSentEvents
    original = cls.body

    def wrong(self: Any, message: Any, *args: Any) -> bytes:
        written.append(message.job_id)
        return original(self, message, *args) + b" "

    monkeypatch.setattr(cls, "body", wrong)
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME))
    try:
        dispatcher._connect()
    finally:
        dispatcher.close()
    # Only the start-up samples were written, and they were refused.
    assert written and set(written) == {uuid.UUID("00000000-0000-4000-8000-000000000000")}
    expected = PublishPath.KOMBU if fast_path == "redis" else PublishPath.AMQP
    assert dispatcher.publish_path is expected
    assert dispatcher.sent_events_path is PublishPath.KOMBU
