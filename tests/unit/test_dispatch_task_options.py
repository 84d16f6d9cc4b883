"""What a task declares for its messages (issue 15, point 4) and a periodic
occurrence's ``expires``, through the memory dispatcher: the Kombu one
builds its headers from the same functions (the contract suite and
``tests/integration/test_dispatch_kombu.py`` check that it agrees)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from celery import Celery

from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.models import Job, JobStatus, StoredSchedule
from celery_sched.schedules.rows import occurrence_job
from celery_sched.store.memory import MemoryJobStore
from celery_sched.timeutil import to_bucket

T0 = dt.datetime(2030, 1, 1, 7, 0, tzinfo=dt.UTC)
BODY = b'[[1], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'


def make_app() -> Celery:
    app = Celery("task_options", set_as_current=False)

    @app.task(name="t.limited", shared=False, time_limit=5, soft_time_limit=3)
    def limited(x: int) -> None:
        return None

    @app.task(name="t.expiring", shared=False, expires=20)
    def expiring(x: int) -> None:
        return None

    @app.task(name="t.plain", shared=False)
    def plain(x: int) -> None:
        return None

    return app


def schedule(task: str, **options: Any) -> StoredSchedule:
    return StoredSchedule(
        id=7,
        name="every-minute",
        task=task,
        kind="interval",
        spec={"seconds": 60},
        body=BODY,
        content_type="application/json",
        content_encoding="utf-8",
        argsrepr="(1,)",
        kwargsrepr="{}",
        options=options,
        timezone="UTC",
        misfire=None,
        overlap="allow",
        catchup_window=None,
        max_catchup=None,
        relative=False,
        enabled=True,
        source="api",
        paused=False,
        version=1,
        last_nominal_at=None,
        next_nominal_at=T0,
    )


def occurrence(row: StoredSchedule, nominal: dt.datetime, planned_at: dt.datetime) -> Job:
    new = occurrence_job(
        row,
        nominal,
        now=planned_at,
        job_id=uuid.uuid4(),
        max_attempts=5,
        shard_of=lambda _key: 0,
    )
    return MemoryJobStore().add_job(new)


def one_off(task: str, **options: Any) -> Job:
    return Job(
        id=uuid.uuid4(),
        key=f"k-{uuid.uuid4().hex[:6]}",
        task=task,
        body=BODY,
        content_type="application/json",
        content_encoding="utf-8",
        argsrepr="(1,)",
        kwargsrepr="{}",
        due_at=T0,
        due_bucket=to_bucket(T0),
        status=JobStatus.DISPATCHED,
        options=options,
    )


def test_the_time_limits_a_task_declares_reach_the_header() -> None:
    """Before: ``@app.task(time_limit=5, soft_time_limit=3)`` sent no limits."""
    dispatcher = MemoryDispatcher(app=make_app())
    jobs = [
        one_off("t.limited"),
        one_off("t.limited", time_limit=10),  # the job's own wins, key by key
        one_off("t.plain"),
        one_off("t.plain", soft_time_limit=2),
    ]
    result = dispatcher.publish(jobs, epoch=1, now=T0)
    assert result.sent == [job.id for job in jobs]
    assert [m.headers["timelimit"] for m in dispatcher.messages] == [
        [5.0, 3.0],
        [10, 3.0],
        [None, None],
        [None, 2],
    ]


def test_a_periodic_occurrences_expires_counts_from_the_send() -> None:
    """Stock beat counts ``expires`` from ``apply_async``. Before, the planner
    fixed ``nominal + expires`` in advance: an occurrence sent late expired
    early, or was never sent."""
    row = schedule("t.plain", expires=30, queue="reports")
    job = occurrence(row, T0, planned_at=T0 - dt.timedelta(minutes=1))
    assert job.expires_at is None and job.schedule_id == 7
    assert dict(job.options) == {"queue": "reports", "expires": 30.0}

    dispatcher = MemoryDispatcher()
    on_time = dispatcher.publish([job], epoch=1, now=T0)
    late_at = T0 + dt.timedelta(minutes=5)  # longer than expires after nominal
    late = dispatcher.publish([job], epoch=1, now=late_at)
    assert on_time.sent == late.sent == [job.id] and late.expired == []
    first, second = dispatcher.messages
    assert first.headers["expires"] == (T0 + dt.timedelta(seconds=30)).isoformat()
    assert second.headers["expires"] == (late_at + dt.timedelta(seconds=30)).isoformat()
    assert first.expiration == second.expiration == 30.0


def test_a_periodic_occurrence_takes_its_tasks_expires_from_the_send() -> None:
    app = make_app()
    declared = occurrence(schedule("t.expiring"), T0, T0)
    overridden = occurrence(schedule("t.expiring", expires=90), T0, T0)
    now = T0 + dt.timedelta(seconds=45)
    dispatcher = MemoryDispatcher(app=app)
    dispatcher.publish([declared, overridden], epoch=1, now=now)
    assert [m.headers["expires"] for m in dispatcher.messages] == [
        (now + dt.timedelta(seconds=20)).isoformat(),
        (now + dt.timedelta(seconds=90)).isoformat(),
    ]
