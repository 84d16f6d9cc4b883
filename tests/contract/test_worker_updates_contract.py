"""Batched worker status reports behave like the single-row transitions."""

from __future__ import annotations

import uuid

from celery_sched.interfaces import JobStore
from celery_sched.models import JobStatus, WorkerUpdate
from tests.contract.test_store_contract import claim_one, status_of


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
