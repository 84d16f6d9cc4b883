"""Worker-side status tracking through Celery signals, batched per process."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched import tracking
from celery_sched.errors import StoreError, StoreUnavailable
from celery_sched.models import JobStatus, WorkerUpdate
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


class FlakyStore(MemoryJobStore):
    """A memory store whose worker-update writes fail while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down: type[Exception] | None = None
        self.attempts = 0

    def apply_worker_updates(self, updates: Any) -> int:
        self.attempts += 1
        if self.down is not None:
            raise self.down("PostgreSQL at postgresql://db is unavailable")
        return super().apply_worker_updates(updates)


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_reports_made_while_the_store_is_down_are_written_once_it_is_back() -> None:
    store = FlakyStore()
    ids = [_dispatched(store, f"o{i}") for i in range(3)]
    store.down = StoreUnavailable
    writer = tracking.StatusWriter(store, interval=0.01, retry_interval=0.05)
    try:
        for job_id in ids:
            writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        _wait_for(lambda: store.attempts >= 2)  # failed, kept, tried again
        writer.report(WorkerUpdate(job_id=ids[0], status=JobStatus.SUCCEEDED, worker="w1"))
        assert {store.get_by_id(i).status for i in ids} == {JobStatus.DISPATCHED}  # type: ignore[union-attr]
        store.down = None
        _wait_for(lambda: store.get_by_id(ids[0]).status is JobStatus.SUCCEEDED)  # type: ignore[union-attr]
        assert [store.get_by_id(i).status for i in ids[1:]] == [JobStatus.RUNNING] * 2  # type: ignore[union-attr]
    finally:
        writer.close()


def test_reports_beyond_the_limit_drop_the_oldest_first(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    ids = [_dispatched(store, f"l{i}") for i in range(5)]
    store.down = StoreUnavailable
    writer = tracking.StatusWriter(store, interval=60, retry_interval=60, max_held=3)
    try:
        for job_id in ids:
            writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        assert writer.flush() is False
        assert "dropped the 2 oldest job status reports" in caplog.text
        store.down = None
        assert writer.flush() is True
        statuses = [store.get_by_id(i).status for i in ids]  # type: ignore[union-attr]
        assert statuses == [JobStatus.DISPATCHED] * 2 + [JobStatus.RUNNING] * 3
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("error", "final", "kept"),
    [(StoreError, False, False), (StoreUnavailable, True, False), (StoreUnavailable, False, True)],
)
def test_only_an_unavailable_store_keeps_reports_and_only_until_the_last_flush(
    error: type[Exception], final: bool, kept: bool
) -> None:
    store = FlakyStore()
    job_id = _dispatched(store, "k")
    store.down = error
    writer = tracking.StatusWriter(store, interval=60, retry_interval=60)
    try:
        writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        writer.flush(final=final)
        store.down = None
        writer.flush()
        job = store.get_by_id(job_id)
        assert job is not None
        assert job.status is (JobStatus.RUNNING if kept else JobStatus.DISPATCHED)
    finally:
        writer.close()


@pytest.fixture
def broker_app() -> Iterator[Celery]:
    """An app that publishes for real, to Kombu's in-process memory transport."""
    app = Celery("tracking-retry-test", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    tracking.install(app, store=MemoryJobStore())

    @app.task(name="t.flaky", bind=True, shared=False)
    def flaky(self: Any) -> None:
        raise AssertionError("never executed here")

    yield app


def _published_headers(app: Celery) -> dict[str, Any]:
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        try:
            message = queue.get(timeout=1)
            message.ack()
            return dict(message.headers)
        finally:
            queue.close()


def _inside(app: Celery, task_id: str, **headers: Any) -> Any:
    """Make ``t.flaky`` the running task, as a worker does, with these headers."""
    from celery._state import _task_stack

    task = app.tasks["t.flaky"]
    task.push_request(id=task_id, called_directly=False, retries=0, **headers)
    _task_stack.push(task)
    return task


def _leave(task: Any) -> None:
    from celery._state import _task_stack

    _task_stack.pop()
    task.pop_request()


def test_a_plain_task_retry_keeps_the_job_headers(broker_app: Celery) -> None:
    # Tracking relies on this: Celery (>= 5.7) keeps a request's custom headers
    # on the message a retry publishes, so the retried run is the same job.
    job_id = str(uuid.uuid4())
    task = _inside(
        broker_app,
        job_id,
        celery_sched_key="job-7",
        celery_sched_attempt=2,
        celery_sched_epoch=9,
    )
    try:
        task.retry(countdown=60, throw=False)
    finally:
        _leave(task)
    headers = _published_headers(broker_app)
    assert headers["id"] == job_id
    assert headers["celery_sched_key"] == "job-7"
    assert headers["celery_sched_attempt"] == 2
    assert headers["celery_sched_epoch"] == 9


def test_other_messages_sent_from_a_task_do_not_get_its_headers(broker_app: Celery) -> None:
    task = _inside(broker_app, str(uuid.uuid4()), celery_sched_key="job-8")
    try:
        broker_app.send_task("t.flaky", task_id=str(uuid.uuid4()))
    finally:
        _leave(task)
    headers = _published_headers(broker_app)
    assert "celery_sched_key" not in headers
