"""Issue 15, point 8: with ``task_send_sent_event`` the Redis fast path stays
in use and sends Celery's task-sent events itself, as Kombu would publish them.

A real Celery event receiver on the same broker checks what arrives."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched.dispatch import kombu as kombu_dispatch
from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.settings import Settings
from tests.integration.test_dispatch_kombu import make_job

pytestmark = pytest.mark.integration

TASK = "sent_events.record"
HOSTNAME = "celery_sched@sent-events"


@pytest.fixture
def app(unique_name: str, redis_url: str) -> Iterator[Celery]:
    app = Celery("sent_events", broker=redis_url, set_as_current=False)
    app.conf.task_default_queue = unique_name
    app.conf.task_send_sent_event = True
    yield app
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(unique_name)


def capture_sent(app: Celery, count: int, publish: Any) -> list[dict[str, Any]]:
    """The task-sent events a Celery receiver gets while ``publish()`` runs."""
    events: list[dict[str, Any]] = []
    ready = threading.Event()
    errors: list[BaseException] = []
    with app.connection_for_read() as conn:

        def on_sent(event: dict[str, Any]) -> None:
            events.append(event)
            if len(events) >= count:
                receiver.should_stop = True

        receiver = app.events.Receiver(conn, handlers={"task-sent": on_sent}, queue_ttl=60)
        receiver.on_consume_ready = lambda *a, **kw: ready.set()  # type: ignore[method-assign]

        def capture() -> None:
            try:
                receiver.capture(limit=None, timeout=15, wakeup=False)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        thread = threading.Thread(target=capture, daemon=True)
        thread.start()
        assert ready.wait(10)
        time.sleep(1.0)  # the Redis fanout subscribes on the first poll
        publish()
        thread.join(20)
        receiver.should_stop = True
    assert not errors, errors
    return events


def test_task_sent_events_are_sent_by_the_redis_fast_path(app: Celery, unique_name: str) -> None:
    now = dt.datetime.now(dt.UTC)
    jobs = [make_job(TASK, (i, "é"), {"k": [i, None]}) for i in range(4)]
    jobs.append(make_job(TASK, (9,), expires_at=now + dt.timedelta(minutes=5)))
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME), chunk=2)
    results = []

    def publish() -> None:
        results.append(dispatcher.publish(jobs, epoch=1, now=now))

    try:
        events = capture_sent(app, len(jobs), publish)
        assert dispatcher.publish_path is PublishPath.REDIS
        assert dispatcher.sent_events_path is PublishPath.REDIS
        assert dispatcher.sent_by_path == {PublishPath.REDIS: len(jobs)}
    finally:
        dispatcher.close()
    assert sorted(results[0].sent) == sorted(job.id for job in jobs)
    assert len(events) == len(jobs)  # one each, none twice
    by_uuid = {event["uuid"]: event for event in events}
    assert set(by_uuid) == {str(job.id) for job in jobs}
    for job in jobs:
        event = by_uuid[str(job.id)]
        assert event["type"] == "task-sent"
        assert event["name"] == TASK
        assert event["args"] == job.argsrepr
        assert event["kwargs"] == job.kwargsrepr
        assert event["hostname"] == HOSTNAME
        assert event["queue"] == unique_name
        assert event["exchange"] == ""
        assert event["routing_key"] == unique_name
        assert event["root_id"] == str(job.id)
        assert event["parent_id"] is None
        assert event["retries"] == 0
        assert event["eta"] is None
        assert isinstance(event["clock"], int)
        assert abs(event["timestamp"] - time.time()) < 60
    assert by_uuid[str(jobs[-1].id)]["expires"] == jobs[-1].expires_at.isoformat()  # type: ignore[union-attr]
    assert by_uuid[str(jobs[0].id)]["expires"] is None
    # The messages themselves are on the queue, one each.
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(unique_name) == len(jobs)


def test_an_event_differing_from_kombus_falls_back_with_a_warning(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original = kombu_dispatch.SentEvents.encode

    def wrong(self: Any, *args: Any, **kwargs: Any) -> bytes:
        return original(self, *args, **kwargs).replace(b'"hostname":', b'"hostnom":', 1)

    monkeypatch.setattr(kombu_dispatch.SentEvents, "encode", wrong)
    now = dt.datetime.now(dt.UTC)
    jobs = [make_job(TASK, (i,)) for i in range(3)]
    dispatcher = KombuDispatcher(app, Settings(hostname=HOSTNAME))
    with caplog.at_level(logging.WARNING, logger="celery_sched.dispatch.kombu"):
        try:
            events = capture_sent(
                app, len(jobs), lambda: dispatcher.publish(jobs, epoch=1, now=now)
            )
        finally:
            dispatcher.close()
    assert dispatcher.publish_path is PublishPath.KOMBU
    assert dispatcher.sent_events_path is PublishPath.KOMBU
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "task-sent event" in warnings[0]
    assert "envelope.headers.hostname" in warnings[0]
    assert {event["uuid"] for event in events} == {str(job.id) for job in jobs}
    assert {event["hostname"] for event in events} == {HOSTNAME}
