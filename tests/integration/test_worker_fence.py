"""The plain-task delivery fence (celery_sched.fence) against a real PostgreSQL.

Runs the tasks as a worker's pool process does, through Celery's tracer
(``Task.apply``: the tracer calls ``task.run``, which the fence wraps once
``worker_init`` has run), with the message headers a dispatched job carries.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
import uuid
from typing import Any
from unittest.mock import Mock

import pytest
from celery import Celery, signals

import celery_sched
from celery_sched import fence, tracking
from celery_sched.models import ClaimOutcome, JobStatus
from celery_sched.protocol import ATTEMPT_HEADER, request_attempt
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore
from celery_sched.store.partitions import PartitionRange
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from tests.contract.conftest import new_job

pytestmark = pytest.mark.integration


@pytest.fixture
def ran() -> list[int | None]:
    """The attempts the task body ran as (what its request says)."""
    return []


@pytest.fixture
def app(store: PostgresJobStore, ran: list[int | None]) -> Celery:
    app = Celery("fence-test", set_as_current=False, broker="memory://")
    fence.install(app, ledger=PostgresLedger(store))

    @app.task(name="plain.run", shared=False, bind=True)
    def run(self: Any, value: int) -> int:
        ran.append(request_attempt(self.request))
        return value

    signals.worker_init.send(sender=Mock(app=app))
    return app


def _deliver(app: Celery, job_id: uuid.UUID, key: str, attempt: int | None) -> Any:
    """Run one delivery of ``plain.run`` as a pool process does; its state."""
    headers: dict[str, Any] = {"celery_sched_key": key}
    if attempt is not None:
        headers[ATTEMPT_HEADER] = attempt
    result = app.tasks["plain.run"].apply(args=(1,), task_id=str(job_id), headers=headers)
    return result.state


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
    app: Celery, store: PostgresJobStore, ran: list[int | None], caplog: pytest.LogCaptureFixture
) -> None:
    requeued = _requeued(store, "requeued")
    # The requeue's copy (attempt 1) started; the first copy arrives late.
    assert store.mark_running(requeued, worker="w2", worker_pid=2)
    store.add_job(new_job("cancelled", store.now() + dt.timedelta(hours=1)))
    assert store.cancel("cancelled")
    cancelled = store.get("cancelled")
    assert cancelled is not None
    for status in ("dead", "succeeded"):
        job = store.add_job(new_job(status, store.now() - dt.timedelta(seconds=1)))
        assert store.mark_finished(job.id, JobStatus(status))

    with caplog.at_level(logging.WARNING, logger="celery_sched.fence"):
        # Ignored: acknowledged (Celery acks an Ignore), no result, not run.
        assert _deliver(app, requeued, "requeued", attempt=0) == "IGNORED"
        assert _deliver(app, cancelled.id, "cancelled", attempt=0) == "IGNORED"
        for status in ("dead", "succeeded"):
            job = store.get(status)
            assert job is not None
            assert _deliver(app, job.id, status, attempt=job.attempt) == "IGNORED"
    assert ran == []
    assert "attempt 0 is older than the job's attempt 1" in caplog.text
    assert "the job is cancelled" in caplog.text
    assert "the job is dead" in caplog.text and "the job is succeeded" in caplog.text
    # Nothing was reported: the rows are as they were.
    assert store.get("requeued").status == JobStatus.RUNNING  # type: ignore[union-attr]
    assert store.get("cancelled").status == JobStatus.CANCELLED  # type: ignore[union-attr]

    assert _deliver(app, requeued, "requeued", attempt=1) == "SUCCESS"
    assert ran == [1]


def test_a_late_copy_of_a_requeued_job_nobody_started_takes_it_over(
    app: Celery, store: PostgresJobStore, ran: list[int | None]
) -> None:
    # The queue was slower than the visibility timeout: the first copy
    # arrives after the requeue, before anyone started the job. It runs as
    # the job's next attempt; the requeue's copy is then fenced.
    requeued = _requeued(store, "slow")
    assert _deliver(app, requeued, "slow", attempt=0) == "SUCCESS"
    assert ran == [2]  # what the task (and its status reports) see
    row = store.get("slow")
    assert row is not None and (row.status, row.attempt, row.worker) == (JobStatus.RUNNING, 2, None)
    assert _deliver(app, requeued, "slow", attempt=1) == "IGNORED"
    assert ran == [2]


def test_messages_without_celery_sched_headers_or_with_a_live_job_are_not_checked_against(
    app: Celery, store: PostgresJobStore, ran: list[int | None]
) -> None:
    job = store.add_job(new_job("live", store.now() - dt.timedelta(seconds=1)))
    assert _deliver(app, job.id, "live", attempt=0) == "SUCCESS"
    assert _deliver(app, job.id, "live", attempt=None) == "SUCCESS"
    assert _deliver(app, uuid.uuid4(), "pruned", attempt=0) == "SUCCESS"
    plain = app.tasks["plain.run"].apply(args=(1,), task_id=str(job.id))
    assert plain.state == "SUCCESS"
    # A direct call is no delivery.
    assert app.tasks["plain.run"](5) == 5
    assert len(ran) == 5


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

    signals.worker_init.send(sender=Mock(app=app))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="celery_sched.fence"):
        assert _deliver(app, uuid.uuid4(), "k", attempt=0) == "SUCCESS"
        assert _deliver(app, uuid.uuid4(), "k2", attempt=0) == "SUCCESS"
    assert time.monotonic() - started < 5
    # One failed read, then unchecked for a while (no stall per message).
    assert caplog.text.count("cannot read job") == 1


def test_a_fenced_delivery_reports_nothing_a_passing_one_reports_its_start_once(
    settings: Settings, store: PostgresJobStore
) -> None:
    # With tracking, the start of a fenced task is reported by the fence
    # once the delivery passed (not by task_prerun), as the attempt it runs as.
    memory = MemoryJobStore()
    app = Celery("fence-tracking", set_as_current=False, broker="memory://")
    tracking.install(app, store=memory)
    fence.install(app, ledger=PostgresLedger(store))

    @app.task(name="plain.run", shared=False)
    def run(value: int) -> int:
        return value

    signals.worker_init.send(sender=Mock(app=app))
    reported: list[Any] = []
    writer = tracking.writer_for(app)
    original = writer.report
    writer.report = lambda update: (reported.append(update), original(update))  # type: ignore[method-assign]
    try:
        requeued = _requeued(store, "slow")
        assert _deliver(app, requeued, "slow", attempt=0) == "SUCCESS"
        assert _deliver(app, requeued, "slow", attempt=1) == "IGNORED"
    finally:
        writer.report = original  # type: ignore[method-assign]
    starts = [u for u in reported if u.status == JobStatus.RUNNING]
    assert [(u.job_id, u.attempt) for u in starts] == [(requeued, 2)]
    assert [u.status for u in reported] == [JobStatus.RUNNING, JobStatus.SUCCEEDED]


def test_tracking_install_fences_every_task_when_the_worker_starts(settings: Settings) -> None:
    app = Celery("fence-install", set_as_current=False, broker="memory://")
    app.conf.celery_sched_database_url = settings.database_url
    tracking.install(app)

    class Custom(app.Task):  # type: ignore[name-defined,misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    @app.task(name="plain.late", shared=False)
    def late() -> None:
        """Registered after install."""

    @app.task(name="plain.custom", shared=False, base=Custom)
    def custom() -> None:
        """Its own __call__ calls run, which the fence wraps."""

    @app.task(name="ledger.task", shared=False, base=celery_sched.Task)
    def ledgered() -> None:
        """Fenced by its ledger take: no second read."""

    assert not fence.fenced_run(app.tasks["plain.late"])
    signals.worker_init.send(sender=Mock(app=app))
    assert fence.fenced_run(app.tasks["plain.late"])
    assert fence.fenced_run(app.tasks["plain.custom"])
    assert not fence.fenced_run(app.tasks["ledger.task"])
    # Idempotent: a second worker start wraps nothing twice.
    assert fence.apply(app) == 0
    assert isinstance(app.tasks["plain.late"].run.run, type(lambda: None))


def test_the_setting_turns_the_fence_off(settings: Settings) -> None:
    app = Celery("fence-off", set_as_current=False, broker="memory://")
    app.conf.celery_sched_worker_fence = False
    tracking.install(app)

    @app.task(name="plain.run", shared=False)
    def run() -> None:
        """Not fenced."""

    signals.worker_init.send(sender=Mock(app=app))
    assert not fence.fenced_run(app.tasks["plain.run"])


def test_the_fence_reads_a_partition_it_lists_and_falls_back_when_it_is_gone(
    store: PostgresJobStore,
) -> None:
    ledger = PostgresLedger(store)
    job = store.add_job(new_job("listed", store.now() - dt.timedelta(seconds=1)))
    assert store.cancel("listed")
    assert ledger.check_delivery(job.id, 0, due_at=job.due_at).reason == "the job is cancelled"
    assert ledger._by_partition  # read by its partition, prepared
    # A listing that names a partition dropped since (retention): the read
    # falls back to the jobs table and gives the same verdict.
    gone = PartitionRange(
        lower=job.due_at - dt.timedelta(days=2), upper=job.due_at + dt.timedelta(days=2)
    )
    ledger._partitions = (time.monotonic(), [gone.lower], [gone])
    assert gone.name not in ledger._by_partition
    assert ledger.check_delivery(job.id, 0, due_at=job.due_at).reason == "the job is cancelled"
    assert ledger._partitions[1] == []  # forgotten: read again next time


def test_a_task_take_by_its_jobs_partition_applies_the_whole_fence(
    store: PostgresJobStore,
) -> None:
    # celery_sched.Task's take, as a worker makes it (with the due header):
    # one prepared statement on the job's partition and the ledger, and the
    # adopting statement only for an older copy of a job nobody started.
    ledger = PostgresLedger(store)

    def take(job: Any, key: str, owner: str, attempt: int | None) -> Any:
        return ledger.acquire(
            key, owner=owner, lease=60, job_id=job.id, attempt=attempt, due_at=job.due_at
        )

    started = _requeued(store, "started")
    assert store.mark_running(started, worker="w", worker_pid=1)
    row = store.get("started")
    assert row is not None
    claim = take(row, "started", "old", 0)
    assert claim.outcome == ClaimOutcome.FENCED
    assert claim.reason == "attempt 0 is older than the job's attempt 1"
    assert take(row, "started", "new", 1).outcome == ClaimOutcome.ACQUIRED

    _requeued(store, "slow")
    row = store.get("slow")
    assert row is not None
    late = take(row, "slow", "late", 0)
    assert (late.outcome, late.adopted) == (ClaimOutcome.ACQUIRED, 2)
    own = take(row, "slow-own", "own", 1)
    assert own.outcome == ClaimOutcome.FENCED

    now = store.now()
    live = store.add_job(new_job("live", now - dt.timedelta(seconds=1)))
    assert take(live, "live", "a", 0).outcome == ClaimOutcome.ACQUIRED
    assert ledger._acquire_in  # by the partition
    assert take(live, "live", "b", 0).outcome == ClaimOutcome.HELD
    assert ledger.complete("live", owner="a", job_id=live.id)
    assert take(live, "live", "c", 0).outcome == ClaimOutcome.COMPLETED

    cancelled = store.add_job(new_job("cancelled", now + dt.timedelta(hours=1)))
    assert store.cancel("cancelled")
    claim = take(cancelled, "cancelled", "a", 0)
    assert (claim.outcome, claim.reason) == (ClaimOutcome.FENCED, "the job is cancelled")
    for status in ("dead", "succeeded"):
        job = store.add_job(new_job(status, now - dt.timedelta(seconds=1)))
        assert store.mark_finished(job.id, JobStatus(status))
        claim = take(job, status, "a", 0)
        assert (claim.outcome, claim.reason) == (ClaimOutcome.FENCED, f"the job is {status}")
    assert ledger.get("cancelled") is None and ledger.get("dead") is None  # nothing taken
