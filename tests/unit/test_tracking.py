"""Worker-side status tracking through Celery signals, batched per process."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched import tracking
from celery_sched.models import JobStatus
from celery_sched.store.memory import MemoryJobStore
from tests.contract.conftest import new_job


@pytest.fixture
def app_and_store() -> Iterator[tuple[Celery, MemoryJobStore]]:
    app = Celery("tracking-test", set_as_current=False)
    app.conf.task_always_eager = True
    store = MemoryJobStore()
    tracking.install(app, store=store)

    @app.task(name="t.ok", bind=True, shared=False)
    def ok(self: Any) -> str:
        return "fine"

    @app.task(name="t.boom", shared=False)
    def boom() -> None:
        raise ValueError("boom")

    yield app, store
    tracking.flush_all()


def _dispatched(store: MemoryJobStore, key: str) -> uuid.UUID:
    job = new_job(key, store.now() - dt.timedelta(seconds=1))
    store.insert(job)
    epoch = store.acquire_epoch(0, "t")
    store.claim_ids([job.id], shard=0, epoch=epoch)
    return job.id


def test_a_job_run_by_a_worker_is_marked_running_then_succeeded(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "ok")
    app.tasks["t.ok"].apply(task_id=str(job_id), headers={"celery_sched_key": "ok"})
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED
    assert job.started_at is not None


def test_a_failing_job_is_marked_failed_with_the_error(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "boom")
    app.tasks["t.boom"].apply(task_id=str(job_id), headers={"celery_sched_key": "boom"})
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.FAILED
    assert job.last_error == "ValueError: boom"


def test_messages_without_celery_sched_headers_are_ignored(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "plain")
    app.tasks["t.ok"].apply(task_id=str(job_id))
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.DISPATCHED


def test_reports_are_written_in_batches_by_the_background_thread(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    calls: list[int] = []
    original = store.apply_worker_updates

    def counting(updates: Any) -> int:
        calls.append(len(updates))
        return original(updates)

    store.apply_worker_updates = counting  # type: ignore[method-assign]
    ids = [_dispatched(store, f"b{i}") for i in range(50)]
    for job_id in ids:
        app.tasks["t.ok"].apply(task_id=str(job_id), headers={"celery_sched_key": "b"})
    tracking.flush_all()
    assert sum(calls) == 100  # running + succeeded for each
    assert len(calls) < 50  # batched, not one write per report
    assert {store.get_by_id(i).status for i in ids} == {JobStatus.SUCCEEDED}  # type: ignore[union-attr]
