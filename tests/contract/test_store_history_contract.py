"""``ScheduleStore.schedule_history`` (``sched history``): memory and postgres alike."""

from __future__ import annotations

import datetime as dt

from celery_sched.interfaces import JobStore
from celery_sched.models import JobStatus
from tests.contract.conftest import new_job
from tests.contract.test_schedule_store_contract import new_schedule, occurrence, stored

SECOND = dt.timedelta(seconds=1)
MINUTE = dt.timedelta(minutes=1)


def test_history_is_the_due_occurrences_newest_first_with_their_times(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("h", now + MINUTE), new_schedule("other", now)])
    row, other = stored(store, "h"), stored(store, "other")
    store.add_job(occurrence(row, now - 3 * MINUTE))
    store.add_job(occurrence(row, now - 2 * MINUTE))
    store.add_job(occurrence(row, now - 1 * MINUTE))
    store.add_job(occurrence(row, now + 10 * MINUTE))  # planned ahead, not due: not history
    store.add_job(occurrence(other, now - 30 * SECOND))  # another schedule's
    store.add_job(new_job("one-off", now - 30 * SECOND))  # no schedule at all

    # The oldest runs to the end; the middle one is only sent.
    epoch = store.acquire_epoch(0, "t")
    claimed = store.claim_due(shard=0, epoch=epoch, limit=2)
    assert [job.due_at for job in claimed] == [now - 3 * MINUTE, now - 2 * MINUTE]
    store.mark_running(claimed[0].id, worker="w1")
    store.mark_finished(claimed[0].id, JobStatus.SUCCEEDED)

    history = store.schedule_history(row.id, limit=10)
    assert [job.due_at for job in history] == [
        now - 1 * MINUTE,
        now - 2 * MINUTE,
        now - 3 * MINUTE,
    ]
    assert all(job.schedule_id == row.id for job in history)
    newest, sent, finished = history
    assert newest.status == JobStatus.PENDING and newest.dispatched_at is None
    assert sent.status == JobStatus.DISPATCHED
    assert sent.dispatched_at is not None and sent.started_at is None
    assert finished.status == JobStatus.SUCCEEDED
    assert finished.dispatched_at is not None and finished.started_at is not None
    assert finished.finished_at is not None
    assert finished.dispatched_at <= finished.started_at <= finished.finished_at

    # Bounded: the newest ``limit`` only.
    assert [job.due_at for job in store.schedule_history(row.id, limit=2)] == [
        now - 1 * MINUTE,
        now - 2 * MINUTE,
    ]
    assert store.schedule_history(row.id, limit=0) == []
    assert [job.schedule_id for job in store.schedule_history(other.id, limit=10)] == [other.id]


def test_history_outlives_its_schedule_and_ties_break_by_id(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("gone", now + MINUTE)])
    row = stored(store, "gone")
    due = now - MINUTE
    first = occurrence(row, due)
    # A triggered occurrence can share the due time of a nominal one.
    second = new_job("gone@extra", due, schedule_id=row.id)
    store.add_job(first)
    store.add_job(second)
    assert store.delete_schedule("gone")
    history = store.schedule_history(row.id, limit=5)
    assert [job.id for job in history] == sorted([first.id, second.id], reverse=True)
    assert store.schedule_history(row.id + 1000, limit=5) == []
