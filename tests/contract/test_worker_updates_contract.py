"""Batched worker status reports behave like the single-row transitions."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_sched.errors import StaleEpoch
from celery_sched.interfaces import JobStore, Ledger
from celery_sched.models import Job, JobStatus, ReconcileResult, WorkerUpdate
from tests.contract.conftest import tracked
from tests.contract.test_store_contract import claim_one, leader, status_of


def test_running_then_succeeded_in_one_batch(store: JobStore) -> None:
    job, _epoch = claim_one(store, "ok")
    changed = store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w1"),
            WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED),
        ]
    )
    assert changed == 2
    stored = store.get("ok")
    assert stored is not None
    assert stored.status == JobStatus.SUCCEEDED
    assert stored.worker == "w1"
    assert stored.started_at is not None and stored.finished_at is not None
    assert stored.started_at <= stored.finished_at


def test_failure_records_the_error_and_retry_keeps_the_job_visible(store: JobStore) -> None:
    failing, _ = claim_one(store, "fails")
    retried, _ = claim_one(store, "retries")
    store.apply_worker_updates(
        [
            WorkerUpdate(job_id=failing.id, status=JobStatus.RUNNING, worker="w"),
            WorkerUpdate(job_id=retried.id, status=JobStatus.RUNNING, worker="w"),
            WorkerUpdate(job_id=failing.id, status=JobStatus.FAILED, error="ValueError: boom"),
            WorkerUpdate(job_id=retried.id, status=JobStatus.RETRYING, error="retry in 5s"),
        ]
    )
    failed = store.get("fails")
    assert failed is not None and failed.status == JobStatus.FAILED
    assert failed.last_error == "ValueError: boom"
    assert status_of(store, "retries") == JobStatus.RETRYING


def test_a_retry_that_starts_within_the_same_batch_leaves_the_job_running(
    store: JobStore,
) -> None:
    # Ends "running", as the reports applied one by one would: left
    # "retrying", the reconciler would requeue the job while its retry runs.
    job, _ = claim_one(store, "quick-retry")
    store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w1", attempt=0),
            WorkerUpdate(job_id=job.id, status=JobStatus.RETRYING, error="retry", retry_in=0.0),
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w2", attempt=0),
        ]
    )
    stored = store.get("quick-retry")
    assert stored is not None
    assert (stored.status, stored.worker) == (JobStatus.RUNNING, "w2")


def test_finished_jobs_are_never_changed_and_unknown_ids_are_ignored(store: JobStore) -> None:
    job, _ = claim_one(store, "done")
    store.apply_worker_updates([WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED)])
    # A late duplicate delivery reports running and failed for a finished job.
    changed = store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="late"),
            WorkerUpdate(job_id=job.id, status=JobStatus.FAILED, error="dup"),
            WorkerUpdate(job_id=uuid.uuid4(), status=JobStatus.SUCCEEDED),
        ]
    )
    assert changed == 0
    stored = store.get("done")
    assert stored is not None and stored.status == JobStatus.SUCCEEDED
    assert stored.last_error is None


def test_empty_batch_changes_nothing(store: JobStore) -> None:
    assert store.apply_worker_updates([]) == 0


def test_repeated_reports_in_one_batch_keep_the_first_of_each_kind(store: JobStore) -> None:
    # A redelivered message run twice before one flush reports everything twice.
    job, _ = claim_one(store, "twice")
    other, _ = claim_one(store, "other")
    changed = store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w1"),
            WorkerUpdate(job_id=other.id, status=JobStatus.RUNNING, worker="w3"),
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w2"),
            WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED),
            WorkerUpdate(job_id=job.id, status=JobStatus.FAILED, error="second run"),
            WorkerUpdate(job_id=other.id, status=JobStatus.FAILED, error="E: x"),
        ]
    )
    assert changed == 4
    stored = store.get("twice")
    assert stored is not None
    assert (stored.status, stored.worker, stored.last_error) == (JobStatus.SUCCEEDED, "w1", None)
    failed = store.get("other")
    assert failed is not None
    assert (failed.status, failed.worker, failed.last_error) == (JobStatus.FAILED, "w3", "E: x")


def test_a_start_and_finish_in_one_batch_keep_an_earlier_start(store: JobStore) -> None:
    # A redelivery finishes a job another worker had started in an earlier
    # batch: the finish applies, the second start does not.
    job, _ = claim_one(store, "started-before")
    assert (
        store.apply_worker_updates(
            [WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="first")]
        )
        == 1
    )
    before = store.get("started-before")
    assert before is not None and before.started_at is not None
    changed = store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="second"),
            WorkerUpdate(job_id=job.id, status=JobStatus.FAILED, error="E: late"),
        ]
    )
    assert changed == 1
    stored = store.get("started-before")
    assert stored is not None
    assert (stored.status, stored.worker, stored.last_error) == (
        JobStatus.FAILED,
        "first",
        "E: late",
    )
    assert stored.started_at == before.started_at
    assert stored.finished_at is not None and stored.finished_at >= stored.started_at


def test_a_running_report_of_an_older_attempt_does_not_move_a_requeued_job(
    store: JobStore,
) -> None:
    # Issue 13 (4, 7): the reconciler requeued the job (attempt 1) while the
    # attempt-0 message was still queued; its late start must not move the
    # pending row to running (the new attempt could then never be claimed).
    tracked(store)
    job, epoch = claim_one(store, "requeued", visibility_timeout=0.01)
    time.sleep(0.05)
    store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    requeued = store.get("requeued")
    assert requeued is not None and (requeued.status, requeued.attempt) == (JobStatus.PENDING, 1)
    changed = store.apply_worker_updates(
        [WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="stale", attempt=0)]
    )
    assert changed == 0
    assert status_of(store, "requeued") == JobStatus.PENDING
    # The current attempt's start (and a report without an attempt) applies.
    assert (
        store.apply_worker_updates(
            [WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w", attempt=1)]
        )
        == 1
    )
    stored = store.get("requeued")
    assert stored is not None and (stored.status, stored.worker) == (JobStatus.RUNNING, "w")


# -- issue 13 (12): the heartbeat, the rescuer and lost worker processes ------

#: A worker timeout the tests can sleep past.
SILENT = 0.3


@pytest.fixture(params=["memory", "postgres"])
def rescue_backend(request: pytest.FixtureRequest) -> Iterator[tuple[JobStore, Ledger]]:
    """A job store and the idempotency ledger whose entries its rescuer reads."""
    if request.param == "memory":
        from celery_sched.store.memory import MemoryJobStore, MemoryLedger

        ledger = MemoryLedger()
        yield MemoryJobStore(ledger=ledger), ledger
        return
    from celery_sched.store.postgres import PostgresJobStore, PostgresLedger

    store = PostgresJobStore(request.getfixturevalue("settings"))
    store.migrate()
    postgres_ledger = PostgresLedger(store)
    yield store, postgres_ledger
    postgres_ledger.close()
    store.close()


def _started(store: JobStore, key: str, host: str, pid: int | None, **fields: Any) -> Job:
    """A job claimed and reported running by process ``(host, pid)``."""
    job, _ = claim_one(store, key, **fields)
    report = WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker=host, worker_pid=pid)
    assert store.apply_worker_updates([report]) == 1
    return job


def _rescue(store: JobStore) -> ReconcileResult:
    return store.rescue(shard=0, epoch=store.current_epoch(0), limit=100, worker_timeout=SILENT)


def test_running_reports_record_the_pid_and_a_start_with_finish_too(store: JobStore) -> None:
    job, _ = claim_one(store, "pid")
    quick, _ = claim_one(store, "quick")
    store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="h", worker_pid=41),
            WorkerUpdate(job_id=quick.id, status=JobStatus.RUNNING, worker="h", worker_pid=42),
            WorkerUpdate(job_id=quick.id, status=JobStatus.SUCCEEDED),
        ]
    )
    running, ran = store.get("pid"), store.get("quick")
    assert running is not None and (running.status, running.worker_pid) == (JobStatus.RUNNING, 41)
    assert ran is not None and (ran.status, ran.worker_pid) == (JobStatus.SUCCEEDED, 42)


def test_a_job_of_a_process_that_stopped_beating_is_requeued(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    store, _ = rescue_backend
    store.heartbeat("host-a", 100)
    store.heartbeat("host-a", 200)
    orphan = _started(store, "orphan", "host-a", 100)
    alive = _started(store, "alive", "host-a", 200)
    time.sleep(SILENT + 0.1)
    store.heartbeat("host-a", 200)  # pid 200 goes on beating; pid 100 died
    result = _rescue(store)
    assert (result.rescued, result.requeued, result.dead, result.succeeded) == (1, 1, 0, 0)
    requeued = store.get("orphan")
    assert requeued is not None
    assert (requeued.status, requeued.attempt) == (JobStatus.PENDING, 1)
    assert requeued.id == orphan.id and requeued.started_at is None
    assert requeued.last_error is not None
    assert "host-a" in requeued.last_error and "100" in requeued.last_error
    assert "heartbeat" in requeued.last_error
    assert status_of(store, "alive") == JobStatus.RUNNING
    assert alive.id != orphan.id
    assert _rescue(store) == ReconcileResult()  # nothing left to rescue


def test_a_job_the_ledger_records_as_completed_is_marked_succeeded(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    # A celery_sched.Task finished (its ledger entry completed) but its
    # process was killed before its last report was written.
    store, ledger = rescue_backend
    store.heartbeat("host-b", 7)
    done = _started(store, "done", "host-b", 7)
    ledger.acquire("done", owner="o", lease=60, job_id=done.id)
    assert ledger.complete("done", owner="o")
    # The same key completed for another job (the key reused) does not count.
    other = _started(store, "other", "host-b", 7)
    ledger.acquire("other", owner="o2", lease=60, job_id=uuid.uuid4())
    assert ledger.complete("other", owner="o2")
    assert other.key == "other"
    time.sleep(SILENT + 0.1)
    result = _rescue(store)
    assert (result.rescued, result.succeeded, result.requeued) == (2, 1, 1)
    finished = store.get("done")
    assert finished is not None
    assert (finished.status, finished.attempt) == (JobStatus.SUCCEEDED, 0)
    assert finished.finished_at is not None
    assert status_of(store, "other") == JobStatus.PENDING


def test_fresh_heartbeats_new_starts_and_unknown_hosts_are_left_alone(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    store, _ = rescue_backend
    store.heartbeat("host-c", 1)
    _started(store, "beating", "host-c", 1)
    _started(store, "no-heartbeat-row", "old-worker", 5)  # a worker that does not beat
    time.sleep(SILENT + 0.1)
    store.heartbeat("host-c", 1)
    store.heartbeat("host-d", 2)
    _started(store, "just-started", "host-d", 3)  # stale-less: its start is recent
    assert _rescue(store) == ReconcileResult()
    assert {status_of(store, key) for key in ("beating", "no-heartbeat-row", "just-started")} == {
        JobStatus.RUNNING
    }


def test_a_job_out_of_attempts_is_dead(rescue_backend: tuple[JobStore, Ledger]) -> None:
    store, _ = rescue_backend
    store.heartbeat("host-e", 9)
    _started(store, "last-try", "host-e", 9, max_attempts=1)
    time.sleep(SILENT + 0.1)
    result = _rescue(store)
    assert (result.rescued, result.dead, result.requeued) == (1, 1, 0)
    dead = store.get("last-try")
    assert dead is not None and dead.status == JobStatus.DEAD
    assert dead.finished_at is not None and dead.last_error is not None
    assert "giving up" in dead.last_error


def test_a_job_without_a_pid_matches_every_process_of_its_host(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    store, _ = rescue_backend
    store.heartbeat("host-f", 1)
    store.heartbeat("host-f", 2)
    _started(store, "no-pid", "host-f", None)
    time.sleep(SILENT + 0.1)
    store.heartbeat("host-f", 2)  # one process of the host still beats
    assert _rescue(store) == ReconcileResult()
    time.sleep(SILENT + 0.1)  # now none does
    assert _rescue(store).requeued == 1
    assert status_of(store, "no-pid") == JobStatus.PENDING


def test_a_pid_reused_by_a_later_process_does_not_keep_the_job(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    # A restarted container: same host name, same pid, another process.
    store, _ = rescue_backend
    store.heartbeat("host-g", 8)
    _started(store, "before-restart", "host-g", 8)
    time.sleep(SILENT + 0.1)
    store.heartbeat("host-g", 8, first=True)
    assert _rescue(store).requeued == 1
    assert status_of(store, "before-restart") == JobStatus.PENDING


def test_the_rescuer_is_fenced(rescue_backend: tuple[JobStore, Ledger]) -> None:
    store, _ = rescue_backend
    epoch = leader(store)
    leader(store)
    with pytest.raises(StaleEpoch):
        store.rescue(shard=0, epoch=epoch, limit=10, worker_timeout=SILENT)


def test_heartbeat_rows_not_seen_for_long_are_pruned(
    rescue_backend: tuple[JobStore, Ledger],
) -> None:
    store, _ = rescue_backend
    store.heartbeat("host-h", 1)
    time.sleep(0.2)
    store.heartbeat("host-h", 2)
    assert store.prune_workers(older_than=0.1) == 1
    assert store.prune_workers(older_than=0.1) == 0


def test_a_lost_process_requeues_its_job_at_once(store: JobStore) -> None:
    job, _ = claim_one(store, "lost")
    gone, _ = claim_one(store, "lost-dead", max_attempts=1)
    moved_on, _ = claim_one(store, "moved-on")
    store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="h", worker_pid=3),
            WorkerUpdate(job_id=gone.id, status=JobStatus.RUNNING, worker="h", worker_pid=4),
        ]
    )
    error = "its worker process was lost: WorkerLostError: signal 9 (SIGKILL)"
    changed = store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job.id, status=JobStatus.PENDING, error=error, attempt=0),
            WorkerUpdate(job_id=gone.id, status=JobStatus.PENDING, error=error),
            # A report of an older attempt does not move the job.
            WorkerUpdate(job_id=moved_on.id, status=JobStatus.PENDING, error=error, attempt=7),
        ]
    )
    assert changed == 2
    requeued = store.get("lost")
    assert requeued is not None
    assert (requeued.status, requeued.attempt) == (JobStatus.PENDING, 1)
    assert requeued.last_error is not None and requeued.last_error.startswith(error)
    assert status_of(store, "lost-dead") == JobStatus.DEAD
    assert status_of(store, "moved-on") == JobStatus.DISPATCHED
    # Finished jobs stay finished.
    store.apply_worker_updates([WorkerUpdate(job_id=moved_on.id, status=JobStatus.SUCCEEDED)])
    assert (
        store.apply_worker_updates(
            [WorkerUpdate(job_id=moved_on.id, status=JobStatus.PENDING, error=error)]
        )
        == 0
    )


def test_report_text_is_made_storable(store: JobStore) -> None:
    # Issue 13 (2): PostgreSQL text refuses NUL, and UTF-8 a lone surrogate.
    job, _ = claim_one(store, "odd-text")
    report = WorkerUpdate(
        job_id=job.id, status=JobStatus.FAILED, error="bad\x00byte in /tmp/\udcff" + "x" * 5000
    )
    assert store.apply_worker_updates([report]) == 1
    failed = store.get("odd-text")
    assert failed is not None and failed.last_error is not None
    assert failed.last_error.startswith("bad\ufffdbyte in /tmp/?x")
    assert len(failed.last_error) == 2000


# -- issue 13 (12): a retry whose message was lost -----------------------------------


def _retrying(store: JobStore, key: str, retry_in: float | None, **fields: Any) -> Job:
    """Claim ``key``, start it (attempt 0) and report it retrying in ``retry_in``."""
    job, _ = claim_one(store, key, **fields)
    updates = [
        WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w", attempt=0),
        WorkerUpdate(
            job_id=job.id, status=JobStatus.RETRYING, error="held; retry", retry_in=retry_in
        ),
    ]
    assert store.apply_worker_updates(updates[:1]) == 1
    assert store.apply_worker_updates(updates[1:]) == 1
    stored = store.get(key)
    assert stored is not None and stored.status == JobStatus.RETRYING
    return stored


def _reconcile(store: JobStore, timeout: float, limit: int = 10) -> ReconcileResult:
    tracked(store)
    return store.reconcile(
        shard=0, epoch=store.current_epoch(0), limit=limit, default_visibility_timeout=timeout
    )


def test_a_retry_that_never_starts_is_requeued_a_visibility_timeout_after_it_was_due(
    store: JobStore,
) -> None:
    # Seen in the chaos soak: a retry's message (an ETA 10 s ahead) was lost
    # with the broker; the row stayed retrying for ever.
    before = store.now()
    later = _retrying(store, "later", 3600)
    soon = _retrying(store, "soon", 0.5)
    after = store.now()
    # dispatched_at is when the retry is due, by the store's clock.
    for job, delay in ((later, 3600), (soon, 0.5)):
        assert job.dispatched_at is not None
        due = dt.timedelta(seconds=delay)
        assert before + due <= job.dispatched_at <= after + due, (job.key, job.dispatched_at)
    # Not yet due: left alone however short the visibility timeout.
    assert _reconcile(store, 0.2) == ReconcileResult()
    time.sleep(0.8)
    # Due, but the visibility timeout has not passed since: left alone.
    assert _reconcile(store, 300) == ReconcileResult()
    assert status_of(store, "soon") == JobStatus.RETRYING

    result = _reconcile(store, 0.2)
    assert (result.requeued, result.dead, result.timed_out) == (1, 0, 0)
    requeued = store.get("soon")
    assert requeued is not None
    assert (requeued.status, requeued.attempt) == (JobStatus.PENDING, 1)
    assert requeued.dispatched_at is None and requeued.started_at is None
    assert requeued.last_error is not None and "retry did not start" in requeued.last_error
    assert status_of(store, "later") == JobStatus.RETRYING
    # The lost retry's message, should it arrive after all, is of attempt 0:
    # its start does not move the requeued job.
    late = WorkerUpdate(job_id=soon.id, status=JobStatus.RUNNING, worker="late", attempt=0)
    assert store.apply_worker_updates([late]) == 0
    assert status_of(store, "soon") == JobStatus.PENDING


def test_the_retry_delivery_starting_moves_a_retrying_job_to_running(store: JobStore) -> None:
    job = _retrying(store, "retried", 0.0)
    # The retried message carries the same attempt: its start applies.
    start = WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w2", attempt=0)
    assert store.apply_worker_updates([start]) == 1
    running = store.get("retried")
    assert running is not None
    assert (running.status, running.worker, running.attempt) == (JobStatus.RUNNING, "w2", 0)
    time.sleep(0.3)
    # Running, so the reconciler leaves it to the rescuer and max_runtime.
    assert _reconcile(store, 0.1) == ReconcileResult()
    assert status_of(store, "retried") == JobStatus.RUNNING


def test_a_retry_of_unknown_delay_is_due_at_once_and_dies_past_max_attempts(
    store: JobStore,
) -> None:
    before = store.now()
    unknown = _retrying(store, "unknown", None)
    _retrying(store, "last", 0.0, max_attempts=1)
    after = store.now()
    assert unknown.dispatched_at is not None and before <= unknown.dispatched_at <= after
    time.sleep(0.3)
    result = _reconcile(store, 0.1)
    assert (result.requeued, result.dead) == (1, 1)
    assert status_of(store, "unknown") == JobStatus.PENDING
    dead = store.get("last")
    assert dead is not None
    assert (dead.status, dead.attempt) == (JobStatus.DEAD, 1)
    assert dead.finished_at is not None
    assert dead.last_error is not None and dead.last_error.endswith("giving up")


def test_stale_dispatched_jobs_go_before_overdue_retries(store: JobStore) -> None:
    _retrying(store, "retry", 0.0)
    claim_one(store, "dispatched")
    time.sleep(0.3)
    assert _reconcile(store, 0.1, limit=1).requeued == 1
    assert status_of(store, "dispatched") == JobStatus.PENDING
    assert status_of(store, "retry") == JobStatus.RETRYING
    assert _reconcile(store, 0.1, limit=1).requeued == 1
    assert status_of(store, "retry") == JobStatus.PENDING


def test_mark_retrying_sets_when_the_retry_is_due_and_refuses_a_bad_delay(
    store: JobStore,
) -> None:
    job, _ = claim_one(store, "single")
    assert store.mark_running(job.id, worker="w") is True
    for bad in (-1.0, float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError, match="retry_in"):
            store.mark_retrying(job.id, error="x", retry_in=bad)
        with pytest.raises(ValueError, match="retry_in"):
            WorkerUpdate(job_id=job.id, status=JobStatus.RETRYING, retry_in=bad)
    with pytest.raises(ValueError, match="retry_in"):
        WorkerUpdate(job_id=job.id, status=JobStatus.FAILED, retry_in=5)
    assert status_of(store, "single") == JobStatus.RUNNING  # nothing written
    before = store.now()
    assert store.mark_retrying(job.id, error="later", retry_in=60) is True
    stored = store.get("single")
    assert stored is not None and stored.dispatched_at is not None
    assert before + dt.timedelta(seconds=60) <= stored.dispatched_at
    assert stored.dispatched_at <= store.now() + dt.timedelta(seconds=60)
