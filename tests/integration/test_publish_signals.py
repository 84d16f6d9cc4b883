"""Issue 15, point 7: what hooks ``send_task`` sees celery_sched's messages too.

Celery's ``before_task_publish`` / ``after_task_publish`` fire once per message
with the arguments ``send_task`` gives them, on each publish path (the Redis
fast path, the py-amqp direct path, Kombu's ``Producer.publish``), and a
receiver's change to the headers reaches the message; ``task_compression``
compresses the body as Kombu does; ``task_publish_retry_policy`` bounds the
retries of a publish. Every message is read back by a real Kombu consumer.
"""

from __future__ import annotations

import base64
import bz2
import datetime as dt
import logging
import zlib
from collections.abc import Iterator
from queue import Empty
from typing import Any

import amqp
import pytest
import redis
from celery import Celery, signals
from kombu import Queue
from kombu.message import Message

from celery_sched.dispatch import path_redis
from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.settings import Settings
from tests.integration.test_dispatch_kombu import EMBED, delete_queues, make_job

pytestmark = pytest.mark.integration

TASK = "publish_signals.record"
SHRUNK_TASK = "publish_signals.shrunk"

#: (broker, celery_sched_fast_publish) -> the path the dispatcher must take.
PATHS = {
    ("redis", "auto"): PublishPath.REDIS,
    ("amqp", "auto"): PublishPath.AMQP,
    ("redis", "off"): PublishPath.KOMBU,
    ("amqp", "off"): PublishPath.KOMBU,
}


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["auto", "off"])
def fast_publish(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def app(
    request: pytest.FixtureRequest, broker: str, unique_name: str, redis_url: str
) -> Iterator[Celery]:
    url = redis_url if broker == "redis" else str(request.getfixturevalue("amqp_url"))
    app = Celery("publish_signals", broker=url, set_as_current=False)
    app.conf.task_default_queue = unique_name
    yield app
    delete_queues(app, [unique_name, unique_name + "_other"], redis_url)


def take(app: Celery, queue: str) -> list[Message]:
    """Every message in ``queue``, as Kombu's consumer hands it to a worker."""
    return [message for message, _ in take_wire(app, queue)]


def take_wire(app: Celery, queue: str) -> list[tuple[Message, bytes]]:
    """Every message in ``queue`` with its body as it was on the wire
    (Kombu's consumer decompresses the message's own)."""
    got: list[tuple[Message, bytes]] = []
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        if isinstance(channel, amqp.Channel):
            while (raw := channel.basic_get(queue, no_ack=True)) is not None:
                body = raw.body if isinstance(raw.body, bytes) else raw.body.encode()
                got.append((channel.message_to_python(raw), body))
        else:
            # Kombu's virtual channel: the envelope, before its Message
            # decompresses the body.
            while True:
                try:
                    payload = channel._get(queue)
                except Empty:
                    break
                wire = base64.b64decode(payload["body"])
                got.append((channel.message_to_python(payload), wire))
    return got


def dispatcher_for(app: Celery, redis_url: str, fast_publish: str) -> KombuDispatcher:
    return KombuDispatcher(
        app,
        Settings(redis_url=redis_url, hostname="celery_sched@signals", fast_publish=fast_publish),
    )


@pytest.fixture
def receivers() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every before/after_task_publish as ``(signal, arguments)``; the before
    receiver adds a header, as OpenTelemetry's adds ``traceparent``."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def before(sender: Any = None, **kwargs: Any) -> None:
        calls.append(("before", {"sender": sender, **kwargs, "headers": dict(kwargs["headers"])}))
        kwargs["headers"]["x_receiver"] = "seen-" + kwargs["headers"]["id"]

    def after(sender: Any = None, **kwargs: Any) -> None:
        calls.append(("after", {"sender": sender, **kwargs, "headers": dict(kwargs["headers"])}))

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        yield calls
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)


def test_publish_signals_fire_once_per_message_and_a_header_change_is_sent(
    app: Celery,
    broker: str,
    fast_publish: str,
    unique_name: str,
    redis_url: str,
    receivers: list[tuple[str, dict[str, Any]]],
) -> None:
    other = unique_name + "_other"
    jobs = [
        make_job(TASK, (1, "a"), {"n": 1}),
        make_job(TASK, (2,), options={"queue": other, "priority": 3}),
        make_job(TASK, (3,), {"k": [1, None]}),
    ]
    dispatcher = dispatcher_for(app, redis_url, fast_publish)
    try:
        result = dispatcher.publish(jobs, epoch=5, now=dt.datetime.now(dt.UTC))
    finally:
        dispatcher.close()
    assert result.sent == [job.id for job in jobs]
    assert dispatcher.publish_path is PATHS[(broker, fast_publish)]

    # One pair per message, the before of each ahead of its after.
    by_id: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, kwargs in receivers:
        by_id.setdefault(kwargs["headers"]["id"], []).append((name, kwargs))
    assert set(by_id) == {str(job.id) for job in jobs}
    for job in jobs:
        (before_name, before), (after_name, after) = by_id[str(job.id)]
        assert (before_name, after_name) == ("before", "after")
        queue = other if job is jobs[1] else unique_name
        assert before["sender"] == after["sender"] == TASK
        assert before["exchange"] == after["exchange"] == ""
        assert before["routing_key"] == after["routing_key"] == queue
        assert before["body"] == after["body"] == (job.args, job.kwargs, EMBED)
        assert before["headers"]["task"] == TASK
        assert before["headers"]["celery_sched_key"] == job.key
        assert before["headers"]["celery_sched_epoch"] == 5
        assert "x_receiver" not in before["headers"]
        assert after["headers"]["x_receiver"] == f"seen-{job.id}"
        assert [q.name for q in before["declare"]] == [queue]
        assert all(isinstance(q, Queue) for q in before["declare"])
        assert before["properties"]["correlation_id"] == str(job.id)
        assert before["retry_policy"] == app.conf.task_publish_retry_policy
    assert by_id[str(jobs[1].id)][0][1]["properties"]["priority"] == 3

    delivered = {m.headers["id"]: m for m in [*take(app, unique_name), *take(app, other)]}
    assert set(delivered) == {str(job.id) for job in jobs}
    for job in jobs:
        message = delivered[str(job.id)]
        assert message.headers["x_receiver"] == f"seen-{job.id}"
        assert message.decode() == [list(job.args), job.kwargs, EMBED]


def test_a_retried_publish_announces_each_message_once(
    redis_url: str,
    unique_name: str,
    receivers: list[tuple[str, dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk whose round trip failed is sent again, with the headers its
    receivers already wrote, and without a second before_task_publish."""
    app = Celery("publish_signals", broker=redis_url, set_as_current=False)
    app.conf.task_default_queue = unique_name
    calls = {"n": 0}

    real_push = path_redis.push_lists

    def flaky_push(client: Any, lists: dict[str, list[bytes]]) -> dict[str, str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise redis.exceptions.ConnectionError("connection reset")
        return real_push(client, lists)

    # The start-up comparison writes through its own recorder, not push_lists.
    monkeypatch.setattr(path_redis, "push_lists", flaky_push)
    jobs = [make_job(TASK, (i,)) for i in range(3)]
    dispatcher = KombuDispatcher(app, Settings(redis_url=redis_url), sleep=lambda _: None)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        assert result.sent == [job.id for job in jobs]
        assert dispatcher.publish_path is PublishPath.REDIS
        assert calls["n"] == 2
        assert [name for name, _ in receivers] == ["before"] * 3 + ["after"] * 3
        delivered = take(app, unique_name)
        assert [m.headers["x_receiver"] for m in delivered] == [f"seen-{j.id}" for j in jobs]
    finally:
        dispatcher.close()
        delete_queues(app, [unique_name], redis_url)


def test_task_compression_compresses_the_body_as_kombu_does(
    app: Celery, broker: str, fast_publish: str, unique_name: str, redis_url: str
) -> None:
    """The app's ``task_compression`` for every task, a task's own
    ``compression`` over it; Kombu's consumer decompresses either."""
    app.conf.task_compression = "zlib"

    def shrunk(*args: Any) -> None:
        """A task that only declares its compression."""

    app.task(name=SHRUNK_TASK, shared=False, compression="bzip2")(shrunk)
    jobs = [make_job(TASK, (1, "x" * 200), {"n": 1}), make_job(SHRUNK_TASK, ("y" * 200,))]
    dispatcher = dispatcher_for(app, redis_url, fast_publish)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    finally:
        dispatcher.close()
    assert result.sent == [job.id for job in jobs]
    assert dispatcher.publish_path is PATHS[(broker, fast_publish)]
    delivered = {m.headers["id"]: (m, wire) for m, wire in take_wire(app, unique_name)}
    (plain, plain_wire), (shrunk, shrunk_wire) = (delivered[str(job.id)] for job in jobs)
    assert plain.headers["compression"] == "application/x-gzip"
    assert zlib.decompress(plain_wire) == jobs[0].body
    assert shrunk.headers["compression"] == "application/x-bz2"
    assert bz2.decompress(shrunk_wire) == jobs[1].body
    for job, message in zip(jobs, (plain, shrunk), strict=True):
        assert message.decode() == [list(job.args), job.kwargs, EMBED]


def unreachable(policy: dict[str, Any] | None, **conf: Any) -> Celery:
    app = Celery("unreachable", broker="redis://:secret@127.0.0.1:1/0", set_as_current=False)
    if policy is not None:
        app.conf.task_publish_retry_policy = policy
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    ("policy", "conf", "sleeps"),
    [
        ({"max_retries": 1, "interval_start": 0.03, "interval_max": 1}, {}, [0.03]),
        ({"max_retries": 0}, {}, []),
        # Kombu's own delays: start, then a step more each time within the max.
        (
            {"max_retries": 4, "interval_start": 0, "interval_step": 0.02, "interval_max": 0.05},
            {},
            [0.0, 0.02, 0.04, 0.04],
        ),
        (
            {"max_retries": 4, "interval_start": 0.01, "interval_step": 0.02, "interval_max": 0.04},
            {},
            [0.01, 0.03, 0.04, 0.04],
        ),
        ({"max_retries": 1}, {"task_publish_retry": False}, []),
    ],
)
def test_task_publish_retry_policy_bounds_the_attempts_of_a_publish(
    policy: dict[str, Any] | None,
    conf: dict[str, Any],
    sleeps: list[float],
    caplog: pytest.LogCaptureFixture,
) -> None:
    slept: list[float] = []
    settings = Settings(hostname="celery_sched@test", connect_retries=5, retry_backoff=0.01)
    dispatcher = KombuDispatcher(unreachable(policy, **conf), settings, sleep=slept.append)
    jobs = [make_job(TASK, (i,)) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="celery_sched.retry"):
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    dispatcher.close()
    assert sorted(result.failed) == sorted(job.id for job in jobs)
    assert slept == pytest.approx(sleeps)
    attempts = len(sleeps) + 1
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == attempts - 1
    assert all(f"/{attempts})" in message for message in retries)
