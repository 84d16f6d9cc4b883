"""Fast Job construction from stored rows must equal the validated constructor."""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import uuid
import zoneinfo
from typing import Any

import pytest

from celery_sched.models import Job, JobStatus, jobs_from_rows
from celery_sched.models.jobs import _JobDraft

NOW = dt.datetime(2024, 6, 1, 12, 0, tzinfo=dt.UTC)


def stored(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "key": "k",
        "task": "t",
        "body": b"[]",
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "argsrepr": "()",
        "kwargsrepr": "{}",
        "due_at": NOW,
        "due_bucket": 1,
        "status": "dispatched",
        "options": {"queue": "q"},
        "expires_at": None,
        "attempt": 2,
        "max_attempts": 5,
        "shard": 3,
        "schedule_id": 7,
        "leader_epoch": 9,
        "visibility_timeout": 1.5,
        "max_runtime": None,
        "created_at": NOW,
        "dispatched_at": NOW,
        "started_at": None,
        "finished_at": None,
        "worker": "w1",
        "last_error": "boom",
        "worker_pid": 4242,
        "claim_id": 77,
    }
    values.update(changes)
    return values


def test_draft_takes_every_job_field_in_order() -> None:
    params = list(inspect.signature(_JobDraft.__init__).parameters)[1:]
    assert params == [field.name for field in dataclasses.fields(Job)]


def test_rows_in_any_column_order_give_equal_frozen_jobs() -> None:
    values = stored()
    names = list(reversed(values))
    [job] = jobs_from_rows(names, [tuple(values[name] for name in names)])
    assert type(job) is Job
    assert job == Job(**values)
    assert job.status is JobStatus.DISPATCHED
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.key = "other"  # type: ignore[misc]


def test_non_utc_datetimes_are_converted_and_bad_status_refused() -> None:
    paris = NOW.astimezone(zoneinfo.ZoneInfo("Europe/Paris"))
    values = stored(due_at=paris, created_at=paris)
    [job] = jobs_from_rows(list(values), [tuple(values.values())])
    assert job.due_at.tzinfo is dt.UTC and job.due_at == NOW
    assert job.created_at is not None and job.created_at.tzinfo is dt.UTC
    bad = stored(status="nope")
    with pytest.raises(ValueError):
        jobs_from_rows(list(bad), [tuple(bad.values())])
    with pytest.raises(ValueError, match="Job fields"):
        jobs_from_rows(["id"], [(uuid.uuid4(),)])
