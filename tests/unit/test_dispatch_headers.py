"""Our message headers are exactly what Celery's own as_task_v2 builds."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

from celery import Celery

from celery_sched.protocol import (
    ATTEMPT_HEADER,
    DUE_HEADER,
    EPOCH_HEADER,
    KEY_HEADER,
    base_headers,
    message_headers,
    task_defaults,
)
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore
from celery_sched.validation import JobBuilder

OURS = {KEY_HEADER, ATTEMPT_HEADER, EPOCH_HEADER, DUE_HEADER, "celery_beat_task"}


def _stored(app: Celery, **options: object) -> tuple[object, dict[str, object]]:
    store = MemoryJobStore()
    builder = JobBuilder(app, Settings())
    new = builder.build(
        "proj.add",
        (2, "x" * 300),
        {"flag": True, "nested": {"a": [1, 2]}},
        eta=dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
        countdown=None,
        key="k1",
        check_task=True,
        now=store.now,
        options=dict(options),
    )
    return store.add_job(new), dict(options)


def _celery_headers(app: Celery, job: object, **extra: object) -> dict[str, object]:
    args, kwargs = job.decode()  # type: ignore[attr-defined]
    message = app.amqp.as_task_v2(
        str(job.id),  # type: ignore[attr-defined]
        job.task,  # type: ignore[attr-defined]
        args,
        kwargs,
        root_id=str(job.id),  # type: ignore[attr-defined]
        origin="celery_sched@test",
        **extra,
    )
    return dict(message.headers)


def _app() -> Celery:
    app = Celery("proj", set_as_current=False)

    @app.task(name="proj.add", shared=False)
    def add(a: int, b: str, flag: bool, nested: dict[str, list[int]]) -> None:
        """A task for the header comparison."""

    return app


def test_headers_match_celerys_as_task_v2() -> None:
    app = _app()
    job, _ = _stored(app)
    ours = message_headers(base_headers(origin="celery_sched@test", epoch=3), job, str(job.id))  # type: ignore[arg-type]
    theirs = _celery_headers(app, job)
    assert {k: v for k, v in ours.items() if k not in OURS} == theirs
    assert ours[KEY_HEADER] == "k1" and ours[EPOCH_HEADER] == 3 and ours["celery_beat_task"]
    # The job's due time, exact to the microsecond: the worker's statements
    # name the row by it (issue #30).
    assert ours[DUE_HEADER] == "2030-01-01T00:00:00+00:00"


def test_headers_with_limits_and_expiry_match_celery() -> None:
    app = _app()
    expires = dt.datetime(2030, 1, 1, 1, tzinfo=dt.UTC)
    job, _ = _stored(app, time_limit=30, soft_time_limit=20, expires=expires)
    ours = message_headers(base_headers(origin="celery_sched@test", epoch=1), job, str(job.id))  # type: ignore[arg-type]
    theirs = _celery_headers(app, job, time_limit=30, soft_time_limit=20, expires=expires)
    assert {k: v for k, v in ours.items() if k not in OURS} == theirs
    assert uuid.UUID(str(ours["id"])) == job.id  # type: ignore[attr-defined]


def test_a_stored_headers_option_never_overrides_protocol_fields() -> None:
    """A row stored before validation refused reserved names: its headers only add.

    Before: ``{**base, **extra}`` let ``eta``, ``retries``, ``shadow``,
    ``timelimit``, ``parent_id``, ``celery_sched_epoch`` and friends through.
    """
    app = _app()
    job, _ = _stored(app, headers={"tenant": "a"})
    hostile = {
        "tenant": "a",
        "eta": "2000-01-01T00:00:00+00:00",
        "retries": 99,
        "shadow": "other.task",
        "timelimit": [1, 1],
        "parent_id": "p",
        "task": "evil.task",
        EPOCH_HEADER: 999,
        ATTEMPT_HEADER: 999,
        "celery_sched_failures": 7,
    }
    job = dataclasses.replace(job, options={"headers": hostile})  # type: ignore[type-var]
    base = base_headers(origin="celery_sched@test", epoch=3)
    ours = message_headers(base, job, str(job.id))  # type: ignore[attr-defined]
    clean = message_headers(
        base,
        dataclasses.replace(job, options={"headers": {"tenant": "a"}}),  # type: ignore[type-var]
        str(job.id),  # type: ignore[attr-defined]
    )
    assert ours == clean
    assert ours["tenant"] == "a" and "celery_sched_failures" not in ours
    assert (ours["eta"], ours["retries"], ours["shadow"], ours[EPOCH_HEADER]) == (None, 0, None, 3)
    assert base == base_headers(origin="celery_sched@test", epoch=3)  # not mutated


def test_the_time_limits_a_task_declares_match_what_celery_sends() -> None:
    """``apply_async`` merges the task's ``time_limit`` / ``soft_time_limit``
    under the caller's options; the header is what ``as_task_v2`` makes of them."""
    app = _app()

    @app.task(name="proj.limited", shared=False, time_limit=5, soft_time_limit=3)
    def limited(a: int, b: str, flag: bool, nested: dict[str, list[int]]) -> None:
        """A task declaring time limits."""

    job, _ = _stored(app)
    job = dataclasses.replace(job, task="proj.limited")  # type: ignore[type-var]
    defaults = task_defaults(app.tasks["proj.limited"])
    base = base_headers(origin="celery_sched@test", epoch=1)
    ours = message_headers(base, job, str(job.id), defaults=defaults)  # type: ignore[attr-defined]
    theirs = _celery_headers(app, job, time_limit=5, soft_time_limit=3)
    assert {k: v for k, v in ours.items() if k not in OURS} == theirs
    assert ours["timelimit"] == [5, 3]

    own = dataclasses.replace(job, options={"time_limit": 10})  # type: ignore[type-var]
    ours = message_headers(base, own, str(job.id), defaults=defaults)  # type: ignore[attr-defined]
    assert ours["timelimit"] == [10, 3]


def test_the_due_header_is_each_jobs_own_due_time_across_the_shared_cache() -> None:
    # Due times are formatted once and kept: jobs sharing one get the same
    # text, a different instant (or the same instant in another zone, which
    # compares equal) never gets another's, and a full cache starts over.
    job, _ = _stored(_app())
    base = base_headers(origin="celery_sched@test", epoch=1)
    due = dt.datetime(2030, 1, 1, 12, 0, 0, 5, tzinfo=dt.UTC)
    shared = [dataclasses.replace(job, due_at=due) for _ in range(3)]
    assert {message_headers(base, j, str(j.id))[DUE_HEADER] for j in shared} == {due.isoformat()}
    later = due + dt.timedelta(microseconds=1)
    moved = dataclasses.replace(job, due_at=later)
    assert message_headers(base, moved, str(job.id))[DUE_HEADER] == later.isoformat()
    paris = due.astimezone(dt.timezone(dt.timedelta(hours=1)))
    elsewhere = object.__new__(type(job))
    for field in dataclasses.fields(job):
        object.__setattr__(elsewhere, field.name, getattr(job, field.name))
    object.__setattr__(elsewhere, "due_at", paris)
    assert message_headers(base, elsewhere, str(job.id))[DUE_HEADER] == paris.isoformat()
    for minute in range(5000):
        step = dataclasses.replace(job, due_at=due + dt.timedelta(minutes=minute))
        text = message_headers(base, step, str(job.id))[DUE_HEADER]
        assert text == step.due_at.isoformat()
