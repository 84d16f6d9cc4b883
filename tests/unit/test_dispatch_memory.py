"""MemoryDispatcher: the fake the engine's unit tests publish through.

What it shares with the Kombu dispatcher (headers, expiry, routing, results)
is the Dispatcher contract (``tests/contract/test_dispatcher_contract.py``);
here are the fake's own record and its test controls.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from kombu.serialization import dumps

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


def test_records_where_each_message_would_go() -> None:
    dispatcher = MemoryDispatcher(origin="celery_sched@unit")
    a, b = job(), job(options={"queue": "q2", "priority": 3})
    dispatcher.publish([a, b], epoch=9, now=NOW)
    first, second = dispatcher.messages
    assert (first.queue, first.exchange, first.routing_key) == ("celery", "", "celery")
    assert first.priority is None and first.epoch == 9 and first.task == "proj.add"
    assert (second.queue, second.routing_key, second.priority) == ("q2", "q2", 3)
    assert dispatcher.sent_ids() == [a.id, b.id]
    assert dispatcher.publish_calls == 1


def test_fail_next_fails_that_many_messages_then_recovers() -> None:
    dispatcher = MemoryDispatcher()
    jobs = [job() for _ in range(5)]
    dispatcher.fail_next(3)
    first = dispatcher.publish(jobs[:2], epoch=1, now=NOW)
    second = dispatcher.publish(jobs[2:], epoch=1, now=NOW)
    assert first.failed == [jobs[0].id, jobs[1].id] and first.sent == []
    assert second.failed == [jobs[2].id] and second.sent == [jobs[3].id, jobs[4].id]
    assert dispatcher.sent_ids() == [jobs[3].id, jobs[4].id]


def test_down_fails_every_message_until_lifted() -> None:
    dispatcher = MemoryDispatcher()
    dispatcher.set_down()
    normal = job()
    assert dispatcher.publish([normal], epoch=1, now=NOW).failed == [normal.id]
    dispatcher.set_down(False)
    assert dispatcher.publish([normal], epoch=1, now=NOW).sent == [normal.id]


def test_a_rejected_job_fails_alone_until_accepted() -> None:
    dispatcher = MemoryDispatcher()
    bad, good = job(), job()
    dispatcher.reject(bad.id, "no such queue")
    result = dispatcher.publish([bad, good], epoch=1, now=NOW)
    assert result.rejected == {bad.id: "no such queue"} and result.sent == [good.id]
    dispatcher.accept(bad.id)
    assert dispatcher.publish([bad], epoch=1, now=NOW).sent == [bad.id]


def test_close_is_recorded_and_a_later_publish_reopens() -> None:
    # The contract (tests/contract/test_dispatcher_contract.py) says a closed
    # dispatcher publishes again; the fake also shows whether it is closed now.
    dispatcher = MemoryDispatcher()
    dispatcher.close()
    assert dispatcher.closed
    assert dispatcher.publish([job()], epoch=1, now=NOW).sent
    assert not dispatcher.closed
