"""The plain-task delivery fence (celery_sched.fence) against a real PostgreSQL.

Drives the worker request class a stock worker builds for each message
(``Task.Request``), as the worker's main process does before handing a
message to the pool: ``execute_using_pool`` checks ``revoked()`` first.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any
from unittest.mock import Mock

import pytest
from celery import Celery, signals
from celery.contrib.testing.mocks import TaskMessage
from celery.exceptions import TaskRevokedError
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request
from celery.worker.state import reserved_requests, task_reserved

import celery_sched
from celery_sched import fence, tracking
from celery_sched.models import JobStatus
from celery_sched.protocol import ATTEMPT_HEADER
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from tests.contract.conftest import new_job

pytestmark = pytest.mark.integration


@pytest.fixture
def store(settings: Settings) -> Iterator[PostgresJobStore]:
    backend = PostgresJobStore(settings)
    backend.migrate()
    yield backend
    backend.close()


@pytest.fixture
def app(store: PostgresJobStore) -> Celery:
    app = Celery("fence-test", set_as_current=False, broker="memory://")
    fence.install(app, ledger=PostgresLedger(store))

    @app.task(name="plain.run", shared=False)
    def run(value: int) -> int:
        return value

    return app


def _request(app: Celery, job_id: uuid.UUID, key: str, attempt: int | None) -> Any:
    headers = {"celery_sched_key": key}
    if attempt is not None:
        headers["celery_sched_attempt"] = attempt  # type: ignore[assignment]
    message = TaskMessage("plain.run", id=str(job_id), args=(1,), **headers)
    task = app.tasks["plain.run"]
    request = fence.fenced(Request)(message, app=app, task=task, on_ack=Mock())
    task_reserved(request)
    return request


def _requeued(store: PostgresJobStore, key: str) -> uuid.UUID:
    """A job the reconciler requeued (attempt 1) after its first dispatch."""
    store.heartbeat("tracker@test", 4242)  # tracked workers: the reconciler requeues
    store.add_job(new_job(key, store.now() - dt.timedelta(seconds=5), visibility_timeout=0.01))
    epoch = store.acquire_epoch(0, "test")
    (claimed,) = store.claim_due(shard=0, epoch=epoch, limit=10)
    time.sleep(0.05)
    store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    return claimed.id


def test_stale_and_cancelled_deliveries_are_acked_and_skipped_the_current_one_runs(
    app: Celery, store: PostgresJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    requeued = _requeued(store, "requeued")
    # The requeue's copy (attempt 1) started; the first copy arrives late.
    assert store.mark_running(requeued, worker="w2", worker_pid=2)
    store.add_job(new_job("cancelled", store.now() + dt.timedelta(hours=1)))
    assert store.cancel("cancelled")
    cancelled = store.get("cancelled")
    assert cancelled is not None

    pool = Mock()
    with caplog.at_level(logging.WARNING, logger="celery_sched.fence"):
        for job_id, key in ((requeued, "requeued"), (cancelled.id, "cancelled")):
            request = _request(app, job_id, key, attempt=0)
            with pytest.raises(TaskRevokedError):
                request.execute_using_pool(pool)
            assert request.acknowledged
            request._on_ack.assert_called_once()
            assert request not in reserved_requests
    pool.apply_async.assert_not_called()
    assert "attempt 0 is older than the job's attempt 1" in caplog.text
    assert "the job is cancelled" in caplog.text
    # Nothing was reported: the rows are as they were.
    assert store.get("requeued").status == JobStatus.RUNNING  # type: ignore[union-attr]
    assert store.get("cancelled").status == JobStatus.CANCELLED  # type: ignore[union-attr]

    current = _request(app, requeued, "requeued", attempt=1)
    current.execute_using_pool(pool)
    pool.apply_async.assert_called_once()
    assert not current.acknowledged  # the pool's run acknowledges it


def test_a_late_copy_of_a_requeued_job_nobody_started_takes_it_over(
    app: Celery, store: PostgresJobStore
) -> None:
    # The queue was slower than the visibility timeout: the first copy
    # arrives after the requeue, before anyone started the job. It goes to
    # the pool as the job's next attempt; the requeue's copy is then fenced.
    requeued = _requeued(store, "slow")
    pool = Mock()
    late = _request(app, requeued, "slow", attempt=0)
    late.execute_using_pool(pool)
    pool.apply_async.assert_called_once()
    assert late._request_dict[ATTEMPT_HEADER] == 2  # what the pool child sees
    row = store.get("slow")
    assert row is not None and (row.status, row.attempt, row.worker) == (JobStatus.RUNNING, 2, None)
    own = _request(app, requeued, "slow", attempt=1)
    with pytest.raises(TaskRevokedError):
        own.execute_using_pool(pool)
    assert pool.apply_async.call_count == 1


def test_messages_without_celery_sched_headers_or_with_a_live_job_are_not_checked_against(
    app: Celery, store: PostgresJobStore
) -> None:
    job = store.add_job(new_job("live", store.now() - dt.timedelta(seconds=1)))
    assert not _request(app, job.id, "live", attempt=0).revoked()
    assert not _request(app, job.id, "live", attempt=None).revoked()
    assert not _request(app, uuid.uuid4(), "pruned", attempt=0).revoked()
    plain = fence.fenced(Request)(
        TaskMessage("plain.run", id=str(job.id)), app=app, task=app.tasks["plain.run"]
    )
    assert not plain.revoked()


def test_an_unreachable_database_lets_deliveries_run(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    down = dataclasses.replace(
        settings, database_url="postgresql+psycopg://postgres@127.0.0.1:1/test"
    )
    app = Celery("fence-down", set_as_current=False, broker="memory://")
    fence.install(app, ledger=PostgresLedger(PostgresJobStore(down)))

    @app.task(name="plain.run", shared=False)
    def run(value: int) -> int:
        return value

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="celery_sched.fence"):
        assert not _request(app, uuid.uuid4(), "k", attempt=0).revoked()
        assert not _request(app, uuid.uuid4(), "k2", attempt=0).revoked()
    assert time.monotonic() - started < 5
    # One failed read, then unchecked for a while (no stall per message).
    assert caplog.text.count("cannot read job") == 1


def test_tracking_install_fences_every_task_when_the_worker_starts(settings: Settings) -> None:
    app = Celery("fence-install", set_as_current=False, broker="memory://")
    app.conf.celery_sched_database_url = settings.database_url
    tracking.install(app)

    class Custom(Request):
        pass

    @app.task(name="plain.late", shared=False)
    def late() -> None:
        """Registered after install."""

    @app.task(name="plain.custom", shared=False, Request=Custom)
    def custom() -> None:
        """Keeps its own request class, with the fence mixed in."""

    @app.task(name="ledger.task", shared=False, base=celery_sched.Task)
    def ledgered() -> None:
        """Fenced by its ledger take: no second read in the main process."""

    assert not issubclass(symbol_by_name(app.tasks["plain.late"].Request), fence.FencedRequest)
    signals.worker_init.send(sender=Mock(app=app))
    late_cls = symbol_by_name(app.tasks["plain.late"].Request)
    custom_cls = symbol_by_name(app.tasks["plain.custom"].Request)
    assert issubclass(late_cls, fence.FencedRequest) and issubclass(late_cls, Request)
    assert issubclass(custom_cls, fence.FencedRequest) and issubclass(custom_cls, Custom)
    assert not issubclass(symbol_by_name(app.tasks["ledger.task"].Request), fence.FencedRequest)


def test_the_setting_turns_the_fence_off(settings: Settings) -> None:
    app = Celery("fence-off", set_as_current=False, broker="memory://")
    app.conf.celery_sched_worker_fence = False
    tracking.install(app)

    @app.task(name="plain.run", shared=False)
    def run() -> None:
        """Not fenced."""

    signals.worker_init.send(sender=Mock(app=app))
    assert not issubclass(symbol_by_name(app.tasks["plain.run"].Request), fence.FencedRequest)
