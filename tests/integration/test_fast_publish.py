"""Issue 15, point 9: one chooser per connection decides whether the dispatcher
may bypass Kombu's publish (Redis LPUSH of its own envelopes, py-amqp
basic_publish with its own properties), and messages arrive intact either way.

Every test consumes what was published with a real Kombu consumer."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched.dispatch import fast_path
from celery_sched.dispatch.amqp_wire import PropertiesEncoder, PublishFrames
from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.models import Job
from celery_sched.protocol import RedisEnvelopes
from celery_sched.settings import Settings
from tests.integration.test_dispatch_kombu import make_job

pytestmark = pytest.mark.integration

TASK = "fast_publish.record"
FAST = {"redis": PublishPath.REDIS, "amqp": PublishPath.AMQP}


@pytest.fixture(params=["redis", "amqp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def app(
    request: pytest.FixtureRequest, transport: str, unique_name: str, redis_url: str
) -> Iterator[Celery]:
    broker = redis_url if transport == "redis" else str(request.getfixturevalue("amqp_url"))
    app = Celery("fast_publish", broker=broker, set_as_current=False)
    app.conf.task_default_queue = unique_name
    yield app
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(unique_name)


def jobs(now: dt.datetime) -> list[Job]:
    return [
        make_job(TASK, (1, "é"), {"n": 1}, attempt=2),
        make_job(TASK, (2,), options={"priority": 5, "headers": {"x_custom": {"a": [1, None]}}}),
        make_job(TASK, (3,), expires_at=now + dt.timedelta(minutes=5)),
    ]


def consume(app: Celery, count: int) -> list[Any]:
    """``count`` messages of the app's default queue, by a Kombu consumer."""
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(message)
        message.ack()

    queue = app.amqp.queues[app.conf.task_default_queue]
    with (
        app.connection_for_read() as conn,
        conn.Consumer(queue, accept=["json"], callbacks=[on_message]),
    ):
        for _ in range(100):
            if len(got) >= count:
                break
            conn.drain_events(timeout=5)
    return got


def publish(dispatcher: KombuDispatcher, batch: list[Job], now: dt.datetime) -> None:
    result = dispatcher.publish(batch, epoch=3, now=now)
    assert result.sent == [job.id for job in batch]


def assert_arrived(app: Celery, batch: list[Job]) -> None:
    """Each job arrived once, as a stock worker would read it."""
    # Redis emulates priorities with one list per level: order may differ.
    by_id = {m.headers["id"]: m for m in consume(app, len(batch))}
    assert sorted(by_id) == sorted(str(job.id) for job in batch)
    messages = [by_id[str(job.id)] for job in batch]
    for job, message in zip(batch, messages, strict=True):
        assert message.headers["task"] == TASK
        assert message.headers["lang"] == "py"
        assert message.headers["celery_sched_key"] == job.key
        assert message.headers["celery_sched_epoch"] == 3
        assert message.properties["correlation_id"] == str(job.id)
        assert message.properties["reply_to"] == app.thread_oid
        assert message.content_type == "application/json"
        assert message.decode()[:2] == [list(job.args), job.kwargs]
    for first in range(0, len(batch), 3):
        assert messages[first + 1].headers["x_custom"] == {"a": [1, None]}
        assert int(messages[first + 2].properties["expiration"]) > 290_000


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "celery_sched.dispatch.kombu"
    ]


def test_auto_takes_the_fast_path_here(app: Celery, transport: str) -> None:
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test"))
    now = dt.datetime.now(dt.UTC)
    batch = jobs(now)
    try:
        publish(dispatcher, batch, now)
    finally:
        dispatcher.close()
    assert dispatcher.publish_path is FAST[transport]
    assert dispatcher.sent_by_path == {FAST[transport]: len(batch)}
    assert_arrived(app, batch)


def test_off_publishes_through_kombu(app: Celery) -> None:
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test", fast_publish="off"))
    now = dt.datetime.now(dt.UTC)
    batch = jobs(now)
    try:
        publish(dispatcher, batch, now)
    finally:
        dispatcher.close()
    assert dispatcher.publish_path is PublishPath.KOMBU
    assert dispatcher.sent_by_path == {PublishPath.KOMBU: len(batch)}
    assert_arrived(app, batch)


def test_the_choice_is_made_once_per_connection(
    app: Celery, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    choose = fast_path.choose

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return choose(*args, **kwargs)

    monkeypatch.setattr(fast_path, "choose", counted)
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test"))
    now = dt.datetime.now(dt.UTC)
    batches = [jobs(now) for _ in range(3)]
    try:
        for batch in batches[:2]:
            publish(dispatcher, batch, now)
        assert len(calls) == 1
        dispatcher.close()  # the next publish connects again
        publish(dispatcher, batches[2], now)
        assert len(calls) == 2
    finally:
        dispatcher.close()
    assert dispatcher.sent_by_path == {FAST[transport]: 9}
    assert_arrived(app, [job for batch in batches for job in batch])


@pytest.mark.parametrize("constant", ["TESTED_KOMBU", "TESTED_AMQP"])
def test_an_untested_version_falls_back_with_one_warning(
    app: Celery,
    transport: str,
    constant: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The installed version (5.x) is below this range.
    monkeypatch.setattr(fast_path, constant, ((99,), (100,)))
    # The Redis path does not use py-amqp: its version does not matter there.
    expected = (
        FAST[transport]
        if constant == "TESTED_AMQP" and transport == "redis"
        else (PublishPath.KOMBU)
    )
    caplog.set_level(logging.WARNING, logger="celery_sched.dispatch.kombu")
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test"))
    now = dt.datetime.now(dt.UTC)
    first, second = jobs(now), jobs(now)
    try:
        publish(dispatcher, first, now)
        dispatcher.close()
        publish(dispatcher, second, now)  # a new connection: chosen again, not warned again
    finally:
        dispatcher.close()
    assert dispatcher.publish_path is expected
    assert dispatcher.sent_by_path == {expected: 6}
    if expected is PublishPath.KOMBU:
        name = "kombu" if constant == "TESTED_KOMBU" else "amqp"
        [warning] = warnings_of(caplog)
        assert f"{name} " in warning and "outside the tested range >=99,<100" in warning
    else:
        assert warnings_of(caplog) == []
    assert_arrived(app, first + second)


def test_a_sample_mismatch_falls_back_with_one_warning(
    app: Celery, transport: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fast path that would write one wrong byte is never used: had it
    been, the consumer would see ``lang`` "px" or another reply_to."""
    if transport == "redis":
        encode = RedisEnvelopes.encode

        def wrong_envelope(self: RedisEnvelopes, message: Any, priority: int) -> bytes:
            return encode(self, message, priority).replace(b'"lang":"py"', b'"lang":"px"')

        monkeypatch.setattr(RedisEnvelopes, "encode", wrong_envelope)
    else:
        properties = PropertiesEncoder.properties

        def wrong_properties(self: PropertiesEncoder, **values: Any) -> bytes:
            data = properties(self, **values)
            return data[:-1] + bytes([data[-1] ^ 1])

        monkeypatch.setattr(PropertiesEncoder, "properties", wrong_properties)
    caplog.set_level(logging.WARNING, logger="celery_sched.dispatch.kombu")
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test"))
    now = dt.datetime.now(dt.UTC)
    first, second = jobs(now), jobs(now)
    try:
        publish(dispatcher, first, now)
        dispatcher.close()
        publish(dispatcher, second, now)
    finally:
        dispatcher.close()
    assert dispatcher.publish_path is PublishPath.KOMBU
    assert dispatcher.sent_by_path == {PublishPath.KOMBU: 6}
    [warning] = warnings_of(caplog)
    assert "a sample message differs from Kombu's" in warning
    assert_arrived(app, first + second)


# The frames are py-amqp's: RabbitMQ only.
@pytest.mark.parametrize("transport", ["amqp"])
def test_wrong_publish_frames_fall_back_to_kombu(
    app: Celery, transport: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The py-amqp path writes a chunk's frames itself: frames that differ
    from py-amqp's own by one byte (here the frame-end octet) are never used."""
    frames = PublishFrames.frames

    def wrong_frames(self: PublishFrames, *args: Any) -> bytes:
        data = frames(self, *args)
        return data[:-1] + b"\x00"

    monkeypatch.setattr(PublishFrames, "frames", wrong_frames)
    caplog.set_level(logging.WARNING, logger="celery_sched.dispatch.kombu")
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test"))
    now = dt.datetime.now(dt.UTC)
    batch = jobs(now)
    try:
        publish(dispatcher, batch, now)
    finally:
        dispatcher.close()
    assert dispatcher.publish_path is PublishPath.KOMBU
    [warning] = warnings_of(caplog)
    assert "publish frames" in warning
    assert_arrived(app, batch)
