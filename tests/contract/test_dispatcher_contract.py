"""The Dispatcher contract: the memory fake and the Kombu dispatcher (on Redis
and on RabbitMQ) publish the same messages and report them the same way.

What a consumer receives is read back per backend (``conftest.py``): the
fake's recorded messages, or the broker's queues. Header names are spelled
out here rather than imported, so the suite pins the wire format itself.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from celery import Celery, signals
from kombu.serialization import dumps

from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.interfaces import Dispatcher, PublishResult
from celery_sched.models import Job, JobStatus
from celery_sched.timeutil import to_bucket
from tests.contract.conftest import ORIGIN, UNROUTABLE_QUEUE, Delivered, DispatchBackend

TASK = "proj.add"


def claimed(
    *,
    key: str | None = None,
    options: dict[str, Any] | None = None,
    expires_at: dt.datetime | None = None,
    attempt: int = 1,
    task: str = TASK,
    due_at: dt.datetime | None = None,
    schedule_id: int | None = None,
) -> Job:
    """A job as a claim hands it to the dispatcher."""
    content_type, encoding, body = dumps([[1, 2], {"a": 3}, {}], serializer="json")
    now = due_at or dt.datetime.now(dt.UTC)
    return Job(
        id=uuid.uuid4(),
        key=key or f"k-{uuid.uuid4().hex[:8]}",
        task=task,
        body=body if isinstance(body, bytes) else body.encode(),
        content_type=content_type,
        content_encoding=encoding,
        argsrepr="(1, 2)",
        kwargsrepr="{'a': 3}",
        due_at=now,
        due_bucket=to_bucket(now),
        status=JobStatus.DISPATCHED,
        options=options or {},
        expires_at=expires_at,
        attempt=attempt,
        schedule_id=schedule_id,
    )


def with_task(dispatch: DispatchBackend, name: str, **attributes: Any) -> Dispatcher:
    """A dispatcher whose Celery app has the task ``name`` declaring
    ``attributes``: the Kombu backends' own app, a new one for the fake."""
    app = getattr(dispatch, "app", None) or Celery("contract_tasks", set_as_current=False)

    def run(*args: Any, **kwargs: Any) -> None:
        """A task that only declares options."""

    app.task(name=name, shared=False, **attributes)(run)
    dispatcher = dispatch.dispatcher()
    if isinstance(dispatcher, MemoryDispatcher):
        dispatcher.app = app
    return dispatcher


def ids(jobs: Sequence[Job]) -> list[uuid.UUID]:
    return [job.id for job in jobs]


def task_ids(messages: Sequence[Delivered]) -> list[str]:
    return [message.task_id for message in messages]


def assert_each_job_reported_once(result: PublishResult, jobs: Sequence[Job]) -> None:
    reported = [
        *result.sent,
        *result.failed,
        *result.expired,
        *result.rejected,
        *result.withheld,
    ]
    assert sorted(reported) == sorted(ids(jobs)), result


# -- what goes out ---------------------------------------------------------------------


def test_every_job_is_published_once_in_order_and_reported_sent(
    dispatch: DispatchBackend,
) -> None:
    dispatcher = dispatch.dispatcher(chunk=4)
    now = dt.datetime.now(dt.UTC)
    first, second = [claimed() for _ in range(10)], [claimed() for _ in range(3)]

    result = dispatcher.publish(first, epoch=7, now=now)
    assert result == PublishResult(sent=ids(first))
    again = dispatcher.publish(second, epoch=7, now=now)
    assert again == PublishResult(sent=ids(second))

    delivered = dispatch.delivered(13)
    # The task id is the job id; one queue delivers in publish order.
    assert task_ids(delivered) == [str(job.id) for job in [*first, *second]]
    assert {message.queue for message in delivered} == {dispatch.queue}


def test_an_empty_batch_publishes_nothing(dispatch: DispatchBackend) -> None:
    dispatcher = dispatch.dispatcher()
    result = dispatcher.publish([], epoch=1, now=dt.datetime.now(dt.UTC))
    assert result == PublishResult()
    assert dispatch.delivered(0) == []


def test_headers_are_celery_protocol_2_plus_the_job_key_attempt_and_epoch(
    dispatch: DispatchBackend,
) -> None:
    """What a stock worker reads from every message: the fields of Celery's
    own ``as_task_v2``, ``celery_beat_task``, and our three headers."""
    dispatcher = dispatch.dispatcher()
    job = claimed(key="k-plain", attempt=2)
    result = dispatcher.publish([job], epoch=42, now=dt.datetime.now(dt.UTC))
    assert result.sent == [job.id]

    (message,) = dispatch.delivered(1)
    expected = {
        "lang": "py",
        "task": TASK,
        "id": str(job.id),
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": str(job.id),
        "parent_id": None,
        "argsrepr": "(1, 2)",
        "kwargsrepr": "{'a': 3}",
        "origin": ORIGIN,
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
        "celery_beat_task": True,
        "celery_sched_key": "k-plain",
        "celery_sched_attempt": 2,
        "celery_sched_epoch": 42,
    }
    assert {name: message.headers.get(name) for name in expected} == expected
    # Nothing else, unless it is ours (a header celery_sched adds later).
    extra = set(message.headers) - set(expected)
    assert all(name.startswith("celery_sched_") for name in extra), extra
    # The stored body goes out as stored.
    assert message.body == job.body
    assert (message.content_type, message.content_encoding) == ("application/json", "utf-8")


def test_a_jobs_headers_option_adds_headers_and_overrides_none_of_ours(
    dispatch: DispatchBackend,
) -> None:
    dispatcher = dispatch.dispatcher()
    job = claimed(
        options={
            "headers": {
                "x_custom": "yes",
                "extra": True,
                "id": "forged",
                "task": "evil",
                "celery_sched_epoch": 0,
            },
            "time_limit": 5,
            "ignore_result": True,
        }
    )
    dispatcher.publish([job], epoch=3, now=dt.datetime.now(dt.UTC))

    (message,) = dispatch.delivered(1)
    headers = message.headers
    assert headers["x_custom"] == "yes" and headers["extra"] is True
    assert headers["id"] == headers["root_id"] == str(job.id)
    assert headers["task"] == TASK
    assert headers["celery_sched_epoch"] == 3
    assert headers["timelimit"] == [5, None]
    assert headers["ignore_result"] is True


def test_publish_signals_fire_per_message_and_a_receivers_headers_are_sent(
    dispatch: DispatchBackend,
) -> None:
    """Celery's before/after_task_publish, as ``send_task`` sends them: once
    per message, the task name as sender; what a before receiver writes
    into the headers (OpenTelemetry's ``traceparent``) is delivered."""
    calls: list[tuple[str, Any, str]] = []

    def before(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        calls.append(("before", sender, headers["id"]))
        headers["traceparent"] = f"00-{uuid.UUID(headers['id']).hex}-0000000000000001-01"

    def after(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        calls.append(("after", sender, headers["id"]))

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        dispatcher = dispatch.dispatcher(chunk=2)
        jobs = [claimed() for _ in range(3)]
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    assert result.sent == ids(jobs)
    for job in jobs:
        mine = [(name, sender) for name, sender, task_id in calls if task_id == str(job.id)]
        assert mine == [("before", TASK), ("after", TASK)]
    assert len(calls) == 2 * len(jobs)
    delivered = dispatch.delivered(3)
    assert [m.headers["traceparent"] for m in delivered] == [
        f"00-{job.id.hex}-0000000000000001-01" for job in jobs
    ]


def test_the_time_limits_a_task_declares_are_in_the_header_under_the_jobs_own(
    dispatch: DispatchBackend,
) -> None:
    """``@app.task(time_limit=5, soft_time_limit=3)`` reaches the worker as
    stock Celery sends it; a job's own limit wins over the task's, limit by limit."""
    dispatcher = with_task(dispatch, "proj.limited", time_limit=5, soft_time_limit=3)
    declared = claimed(task="proj.limited")
    own = claimed(task="proj.limited", options={"time_limit": 10})
    plain = claimed(options={"soft_time_limit": 2})
    result = dispatcher.publish([declared, own, plain], epoch=1, now=dt.datetime.now(dt.UTC))
    assert result == PublishResult(sent=ids([declared, own, plain]))

    by_id = {message.task_id: message.headers for message in dispatch.delivered(3)}
    assert by_id[str(declared.id)]["timelimit"] == [5, 3]
    assert by_id[str(own.id)]["timelimit"] == [10, 3]
    assert by_id[str(plain.id)]["timelimit"] == [None, 2]


def test_a_periodic_occurrences_expires_counts_from_the_send(
    dispatch: DispatchBackend,
) -> None:
    """An occurrence (``schedule_id`` set) carries ``expires`` as seconds and
    no ``expires_at``: the message expires that long after it is sent, as
    under stock beat, however late the send; so does its task's ``expires``."""
    dispatcher = with_task(dispatch, "proj.expiring", expires=20)
    now = dt.datetime.now(dt.UTC)
    long_ago = now - dt.timedelta(minutes=5)
    own = claimed(options={"expires": 30.0}, due_at=long_ago, schedule_id=1)
    declared = claimed(task="proj.expiring", due_at=long_ago, schedule_id=2)
    result = dispatcher.publish([own, declared], epoch=1, now=now)
    assert result == PublishResult(sent=ids([own, declared]))

    by_id = {message.task_id: message.headers for message in dispatch.delivered(2)}
    assert by_id[str(own.id)]["expires"] == (now + dt.timedelta(seconds=30)).isoformat()
    assert by_id[str(declared.id)]["expires"] == (now + dt.timedelta(seconds=20)).isoformat()


def test_a_job_goes_to_the_queue_and_priority_its_options_name(
    dispatch: DispatchBackend,
) -> None:
    dispatcher = dispatch.dispatcher()
    plain = claimed()
    routed = claimed(options={"queue": dispatch.other_queue, "priority": 3})
    result = dispatcher.publish([plain, routed], epoch=1, now=dt.datetime.now(dt.UTC))
    assert result == PublishResult(sent=[plain.id, routed.id])

    by_id = {message.task_id: message for message in dispatch.delivered(2)}
    assert by_id[str(plain.id)].queue == dispatch.queue
    assert by_id[str(routed.id)].queue == dispatch.other_queue
    assert by_id[str(routed.id)].priority == 3
    assert by_id[str(routed.id)].body == routed.body


# -- what does not go out ------------------------------------------------------------


def test_jobs_expired_at_now_are_reported_expired_and_never_published(
    dispatch: DispatchBackend,
) -> None:
    dispatcher = dispatch.dispatcher()
    now = dt.datetime.now(dt.UTC)
    just_alive = claimed(expires_at=now + dt.timedelta(microseconds=1))
    at_now = claimed(expires_at=now)  # the boundary counts as expired
    past = claimed(expires_at=now - dt.timedelta(hours=1))
    later = claimed(expires_at=now + dt.timedelta(hours=1))

    result = dispatcher.publish([just_alive, at_now, past, later], epoch=1, now=now)
    assert result == PublishResult(sent=[just_alive.id, later.id], expired=[at_now.id, past.id])

    # RabbitMQ honours the message TTL, which for ``just_alive`` rounds to 0 ms.
    expected = [later] if dispatch.drops_expired_messages else [just_alive, later]
    delivered = dispatch.delivered(len(expected))
    assert task_ids(delivered) == [str(job.id) for job in expected]
    for message, job in zip(delivered, expected, strict=True):
        assert job.expires_at is not None
        assert message.headers["expires"] == job.expires_at.isoformat()


def test_a_job_that_cannot_be_routed_fails_alone(dispatch: DispatchBackend) -> None:
    dispatcher = dispatch.dispatcher()
    good = [claimed() for _ in range(5)]
    unroutable = claimed(options={"queue": UNROUTABLE_QUEUE})
    dispatch.make_unroutable(unroutable.id)
    jobs = [*good[:2], unroutable, *good[2:]]

    result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    assert result.sent == ids(good)
    assert result.failed == [] and result.expired == [] and result.withheld == []
    assert list(result.rejected) == [unroutable.id]
    assert UNROUTABLE_QUEUE in result.rejected[unroutable.id]
    assert task_ids(dispatch.delivered(len(good))) == [str(job.id) for job in good]


def test_an_unreachable_broker_fails_every_job_without_raising(
    dispatch: DispatchBackend,
) -> None:
    dispatcher = dispatch.unreachable()
    now = dt.datetime.now(dt.UTC)
    expired = claimed(expires_at=now)
    jobs = [claimed() for _ in range(3)]

    result = dispatcher.publish([expired, *jobs], epoch=1, now=now)
    # Expiry is judged before any broker I/O, so it wins over the outage.
    assert result == PublishResult(failed=ids(jobs), expired=[expired.id])


def test_nothing_more_is_published_once_may_publish_says_no(dispatch: DispatchBackend) -> None:
    """``may_publish`` is asked before every chunk; what was not sent when it
    says no is reported withheld, neither sent nor failed."""
    chunk = 4
    dispatcher = dispatch.dispatcher(chunk=chunk)
    jobs = [claimed() for _ in range(10)]
    answers = iter([True, True])
    result = dispatcher.publish(
        jobs, epoch=1, now=dt.datetime.now(dt.UTC), may_publish=lambda: next(answers, False)
    )

    sent = 2 * dispatch.messages_per_check(chunk)
    assert result == PublishResult(sent=ids(jobs[:sent]), withheld=ids(jobs[sent:]))
    assert_each_job_reported_once(result, jobs)
    assert task_ids(dispatch.delivered(sent)) == [str(job.id) for job in jobs[:sent]]


def test_a_stale_leader_publishes_nothing(dispatch: DispatchBackend) -> None:
    dispatcher = dispatch.dispatcher()
    jobs = [claimed() for _ in range(3)]
    result = dispatcher.publish(
        jobs, epoch=1, now=dt.datetime.now(dt.UTC), may_publish=lambda: False
    )
    assert result == PublishResult(withheld=ids(jobs))
    assert dispatch.delivered(0) == []


def test_a_stale_leader_still_reports_expired_jobs_expired(dispatch: DispatchBackend) -> None:
    """Expiry is judged before ``may_publish`` is asked: an expired job ends
    expired (a terminal state needs no broker), the rest is withheld."""
    dispatcher = dispatch.dispatcher()
    now = dt.datetime.now(dt.UTC)
    expired = claimed(expires_at=now - dt.timedelta(seconds=1))
    alive = [claimed() for _ in range(2)]
    result = dispatcher.publish(
        [alive[0], expired, alive[1]], epoch=1, now=now, may_publish=lambda: False
    )
    assert result == PublishResult(expired=[expired.id], withheld=ids(alive))
    assert dispatch.delivered(0) == []


# -- lifecycle -----------------------------------------------------------------------


def test_close_may_be_called_twice_and_before_any_publish(dispatch: DispatchBackend) -> None:
    unused = dispatch.dispatcher()
    unused.close()
    unused.close()

    used = dispatch.dispatcher()
    job = claimed()
    assert used.publish([job], epoch=1, now=dt.datetime.now(dt.UTC)).sent == [job.id]
    used.close()
    used.close()
    # Closing loses nothing already published.
    assert task_ids(dispatch.delivered(1)) == [str(job.id)]


def test_a_closed_dispatcher_publishes_again(dispatch: DispatchBackend) -> None:
    """``close`` is not final: a leader re-elected after stepping down
    publishes through the dispatcher it closed."""
    dispatcher = dispatch.dispatcher()
    first, second = claimed(), claimed()
    assert dispatcher.publish([first], epoch=1, now=dt.datetime.now(dt.UTC)).sent == [first.id]
    dispatcher.close()
    result = dispatcher.publish([second], epoch=2, now=dt.datetime.now(dt.UTC))
    assert result == PublishResult(sent=[second.id])
    assert task_ids(dispatch.delivered(2)) == [str(first.id), str(second.id)]
