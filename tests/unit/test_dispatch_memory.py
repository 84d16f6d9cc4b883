"""MemoryDispatcher: the fake the engine's unit tests publish through."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from kombu.serialization import dumps

from celery_sched.dispatch import base_headers, message_headers
from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.models import Job, JobStatus
from celery_sched.timeutil import to_bucket

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


def job(*, options: dict[str, Any] | None = None, expires_at: dt.datetime | None = None) -> Job:
    content_type, encoding, body = dumps([[1, 2], {"a": 3}, {}], serializer="json")
    return Job(
        id=uuid.uuid4(),
        key=f"k-{uuid.uuid4().hex[:6]}",
        task="proj.add",
        body=body if isinstance(body, bytes) else body.encode(),
        content_type=content_type,
        content_encoding=encoding,
        argsrepr="(1, 2)",
        kwargsrepr="{'a': 3}",
        due_at=NOW,
        due_bucket=to_bucket(NOW),
        status=JobStatus.DISPATCHED,
        options=options or {},
        expires_at=expires_at,
        attempt=1,
    )


def test_records_messages_with_protocol_headers() -> None:
    dispatcher = MemoryDispatcher(origin="celery_sched@unit")
    a, b = job(), job(options={"queue": "q2", "priority": 3, "headers": {"x": 1}})
    result = dispatcher.publish([a, b], epoch=9, now=NOW)
    assert result.sent == [a.id, b.id] and result.failed == [] and result.expired == []
    first, second = dispatcher.messages
    assert first.headers["id"] == first.headers["root_id"] == str(a.id)
    assert first.headers["task"] == "proj.add"
    assert first.headers["celery_sched_key"] == a.key
    assert first.headers["celery_sched_attempt"] == 1
    assert first.headers["celery_sched_epoch"] == 9
    assert first.headers["celery_beat_task"] is True
    assert first.headers["origin"] == "celery_sched@unit"
    assert first.queue == "celery" and first.routing_key == "celery"
    assert second.queue == "q2" and second.priority == 3 and second.headers["x"] == 1
    assert second.body == b.body


def test_expired_jobs_are_not_sent_and_boundary_counts_as_expired() -> None:
    dispatcher = MemoryDispatcher()
    live = job(expires_at=NOW + dt.timedelta(microseconds=1))
    at_now = job(expires_at=NOW)
    past = job(expires_at=NOW - dt.timedelta(hours=1))
    result = dispatcher.publish([live, at_now, past], epoch=1, now=NOW)
    assert result.sent == [live.id]
    assert result.expired == [at_now.id, past.id]
    assert dispatcher.sent_ids() == [live.id]
    assert dispatcher.messages[0].headers["expires"] == live.expires_at.isoformat()  # type: ignore[union-attr]


def test_fail_next_fails_that_many_messages_then_recovers() -> None:
    dispatcher = MemoryDispatcher()
    jobs = [job() for _ in range(5)]
    dispatcher.fail_next(3)
    first = dispatcher.publish(jobs[:2], epoch=1, now=NOW)
    second = dispatcher.publish(jobs[2:], epoch=1, now=NOW)
    assert first.failed == [jobs[0].id, jobs[1].id] and first.sent == []
    assert second.failed == [jobs[2].id] and second.sent == [jobs[3].id, jobs[4].id]
    assert dispatcher.sent_ids() == [jobs[3].id, jobs[4].id]


def test_expiry_wins_over_failure_and_down_fails_all() -> None:
    dispatcher = MemoryDispatcher()
    dispatcher.set_down()
    gone, normal = job(expires_at=NOW), job()
    result = dispatcher.publish([gone, normal], epoch=1, now=NOW)
    assert result.expired == [gone.id] and result.failed == [normal.id] and result.sent == []
    dispatcher.set_down(False)
    assert dispatcher.publish([normal], epoch=1, now=NOW).sent == [normal.id]


def test_closed_dispatcher_refuses_to_publish() -> None:
    dispatcher = MemoryDispatcher()
    dispatcher.close()
    with pytest.raises(RuntimeError):
        dispatcher.publish([job()], epoch=1, now=NOW)


def test_job_headers_cannot_override_protocol_fields() -> None:
    j = job(options={"headers": {"id": "forged", "task": "evil", "extra": True}, "time_limit": 5})
    headers = message_headers(base_headers(origin="o", epoch=2), j, str(j.id))
    assert headers["id"] == str(j.id) and headers["task"] == "proj.add"
    assert headers["extra"] is True
    assert headers["timelimit"] == [5, None]
